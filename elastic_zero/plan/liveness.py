"""Which workers of a generation have gone silent: a node that vanishes (power, network, a frozen
machine) resets no connections, so its peers would learn of it only at the collective timeout and
Ray only after its health checks give up. Every worker sends a heartbeat a few times a second; a
member silent for longer than the timeout, while others are heard, is lost. Pure: the clock is an
argument.

Silence is read against the witnesses (every worker of the job, in the generation or not): when
none was heard lately, the listener itself was likely starved (a busy machine, a paused process),
and nobody is declared lost; then Ray's own death notices and the collective timeout still end
the generation.
"""

from __future__ import annotations

from typing import Iterable, Mapping


def silent_members(last_heard: Mapping[str, float], watched: Iterable[str], now: float, timeout_s: float,
                   witnesses: Iterable[str] = ()) -> tuple[tuple[str, ...], str]:
    """(the watched members silent for more than `timeout_s`, why), or ((), why not). Someone
    among the watched and the witnesses must have been heard within half the timeout.

    last_heard[a]: when a was last heard of (a heartbeat, or being watched from then on); a member
    never heard of counts from `now`, that is, not yet silent. `witnesses` is read only when a
    watched member is silent (it may be a generator: the common case costs O(watched))."""
    watched = list(watched)
    if all(now - last_heard.get(a, now) <= timeout_s for a in watched):  # the common case, in O(members)
        return (), "every member was heard within the timeout"
    watched = sorted(set(watched))
    silence = {a: now - last_heard.get(a, now) for a in sorted(set(watched) | set(witnesses))}
    silent = tuple(a for a in watched if silence[a] > timeout_s)
    if not silent:
        return (), "every member was heard within the timeout"
    heard = [a for a in silence if silence[a] <= timeout_s / 2]
    if not heard:
        return (), f"nobody was heard for {min(silence.values()):.1f} s: the listener, not every member, may be stalled"
    worst = max(silent, key=lambda a: silence[a])
    return silent, (f"no heartbeat from {', '.join(silent)} for {silence[worst]:.1f} s (timeout {timeout_s:g} s) "
                    f"while {', '.join(heard)} were heard")


def next_silence_at(last_heard: Mapping[str, float], watched: Iterable[str], now: float,
                    timeout_s: float) -> float | None:
    """When the first of the watched would pass the timeout if no beat of theirs came before: the
    earliest moment silent_members() can find anybody (None: nobody watched)."""
    oldest = min((last_heard.get(a, now) for a in watched), default=None)
    return None if oldest is None else oldest + timeout_s


def next_look_at(now: float, due: float | None, poll_s: float, min_gap_s: float, behind_s: float) -> float:
    """When to look for silent members again, after a look that found none to declare: at `due`
    (next_silence_at), within [min_gap_s, poll_s] from now. A due moment already past means some
    member is silent but nobody was heard lately: the listener is behind, not the members, and a look
    every few milliseconds would take the very CPU it needs to catch up (seen at 1,024 simulated
    workers: the loop spun on this scan, and the listener paused for 180 s): then after `behind_s`."""
    if due is not None and due <= now:
        return now + behind_s
    return max(now + min_gap_s, min(now + poll_s, (due if due is not None else now) + min_gap_s))


def nodes_gone_silent(lost: Iterable[str], node_of: Mapping[str, str], last_heard: Mapping[str, float],
                      now: float, timeout_s: float) -> set[str]:
    """The nodes of the `lost` workers that went silent as a whole: no worker there (node_of: every
    worker of the job and its node) was heard within `timeout_s`. A node whose other workers are heard
    is alive: the lost worker's process hung or died alone, and new workers may still go there.
    (Seen in CI: a worker starved for a second on a one-node cluster made the node "lost", and
    every replacement was refused there for good.)"""
    lost = set(lost)
    nodes = {node_of[a] for a in lost if a in node_of}
    heard_on = {node_of[a] for a in node_of if a not in lost and now - last_heard.get(a, float("-inf")) <= timeout_s}
    return nodes - heard_on
