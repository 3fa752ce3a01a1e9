"""When the coordinator asks for a safe point: part of its pure state machine (state.py).

A safe point is asked for when members must leave or ready workers can join. Three cases wait:
- leavers that would take the job below min_workers wait for their replacements (and, when a shard
  would have no replica outside them, a checkpoint is asked for at once);
- joiners, while others of the job are still starting, wait for them up to `join_window_s`, so
  that they all join at one safe point (each resize is a stall for every member);
- a safe point already asked for is not asked again.
"""

from __future__ import annotations

from dataclasses import replace

from elastic_zero.coordinator.events import CheckpointNow, RequestSafePoint
from elastic_zero.coordinator.memory_rules import min_workers


def ask_for_safe_point_if_needed(state, reason: str, now: float):
    """(state, commands, reason) once members must leave or ready workers could join: a safe point
    asked for, a checkpoint instead when leaving now would lose shards, or a wait."""
    wants = state.leaving or (state.ready and state.staying_count() < state.target)
    least = min_workers(state)
    if wants and state.staying_count() + len(state.ready) < least:
        reason = f"{reason}: leavers wait for replacements (min_workers {state.min_workers}" + \
            (f"; memory needs {least})" if least > state.min_workers else ")")
        number = state.generation.number if state.generation is not None else None
        if state.running and state.checkpoint_asked_in != number and _unreplicated_if_gone(state, state.leaving):
            # if they go before replacements join, shards go with them: a checkpoint of the step reached
            return replace(state, checkpoint_asked_in=number), (CheckpointNow(),), \
                f"{reason}; a shard has no replica outside the leavers: checkpoint now"
        return state, (), reason
    if state.running and wants and not state.safe_point_requested:
        if not state.leaving and state.spawning > 0 and state.staying_count() + len(state.ready) < state.target:
            # joiners only (nobody has to go): those still starting may join at the same safe point,
            # one stall instead of one each, if they are ready within the window (not when the ready
            # ones fill the target: those starting would be standby workers, who join nothing)
            since = now if state.joiners_wait_since is None else state.joiners_wait_since
            if now - since < state.join_window_s:
                return replace(state, joiners_wait_since=since), (), \
                    (f"{reason}: {len(state.ready)} ready, {state.spawning} still starting; they join together "
                     f"if ready within {state.join_window_s:g} s")
        return replace(state, safe_point_requested=True, joiners_wait_since=None), (RequestSafePoint(),), \
            f"{reason}: safe point requested"
    return state, (), reason


def _unreplicated_if_gone(state, leaving) -> bool:
    """Whether some leaver's shard has no replica outside the leavers: its only replica is on a
    leaver too (or on itself: one rank), or the job keeps no replicas."""
    generation = state.generation
    if not state.replicated:
        return bool(leaving)
    going = {generation.rank_of(a) for a in leaving if any(m.actor_id == a for m in generation.members)}
    return any(generation.buddies[r] in going for r in going)
