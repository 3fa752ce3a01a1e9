"""Which member of a running generation is stuck: its process alive (its beats come) but its training
not moving, while its peers went on past it: a hang in a data read, in a kernel, before a collective
the others already entered. Its peers then wait inside that collective, and without this rule the
generation would end only at the collective timeout (elastic.collective_timeout_s, 30 s by default).

Each beat carries where its worker's training is (heartbeats.py): the steps done, the phase, and the
collectives its training group entered since the phase began. Every rank of a generation goes
through the same phases and, within each, the same collectives, so these positions are comparable
across ranks. A member is stuck when some peer of its generation is further on and its own position
has not changed for longer than the bound: `factor` times the measured step (a straggler 3x slower
moves at least once a step, and its peers' steps are as slow as its own: they wait for it), at
least `floor_s`. A member entering its generation (restoring, building groups), or a joiner in the
generation's first step (which pays its one-off costs: CUDA's handles, kernels' first runs), is not
judged: its peers wait for it by design. When every member is at the same place, nobody is behind
anybody, and the collective timeout still ends the generation. Pure: the clock is an argument.

Time in which a member's process was ready to run but had no CPU does not count: a starved worker
stands as still as a hung one, and on a loaded machine the slowest rank can wait seconds for a core
while its peers, done first, wait in the collective (a worker starved on purpose was killed as
stuck; CI once lost two workers of four at once on a loaded machine, a shard and its replica
together). The beats carry that wait (cpu_waits.StillnessMeter); a hang in a wait, a sleep or
a lock wants no CPU and is judged as before; a hang that spins (a busy wait) on a loaded machine is
found later, by the share of the time it waited for a core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

# a step's phases in the order a rank goes through them, its step count moving at "commit"
# (worker/trainer.py): at the same step count, a later phase is further on
PHASE_ORDER = ("starting", "entering", "commit", "save", "idle", "eval", "data", "compute", "agree", "update")
JUDGED_PHASES = frozenset(PHASE_ORDER[2:])  # the training loop's


@dataclass(frozen=True)
class Where:
    """Where a member's training is, as its latest beat said."""

    generation: int
    steps: int
    phase: str
    collectives: int  # entered since the phase began

    @property
    def key(self) -> tuple[int, int, int]:
        return self.steps, PHASE_ORDER.index(self.phase), self.collectives

    def describe(self) -> str:
        return f"step {self.steps} ({self.phase}, collective {self.collectives})"


def stuck_bound_s(median_step_s: float | None, factor: float, floor_s: float) -> float | None:
    """How long a member behind its peers may stay put: `factor` times the measured step, at least
    `floor_s`; None (nobody is judged) while no step was measured, or with the rule off (factor 0)."""
    if factor <= 0 or median_step_s is None:
        return None
    return max(floor_s, factor * median_step_s)


def still_past(moved_at: Mapping[str, float], watched: Iterable[str], now: float, bound_s: float) -> list[str]:
    """The watched members whose position has not changed for longer than `bound_s`: the only ones
    stuck_members() can find stuck (a wait for a CPU only shortens a stillness). One look at each, so
    that the common case, nobody still, costs O(members) and builds nothing (at 1,024 members the
    whole rule, four times a second, took a third of the coordinator loop's CPU)."""
    return [a for a in watched if now - moved_at.get(a, now) > bound_s]


def judged_members(where: Mapping[str, Where], watched: Iterable[str], generation: int) -> list[str]:
    """The watched members whose latest beat puts them in `generation`'s training loop: the only ones
    the rule compares (one entering its generation, or beating for another, is not judged)."""
    return [a for a in watched if (w := where.get(a)) is not None and w.generation == generation
            and w.phase in JUDGED_PHASES]


def stuck_members(where: Mapping[str, Where], moved_at: Mapping[str, float], watched: Iterable[str],
                  generation: int, first_step: int, now: float, bound_s: float | None,
                  joiners: Collection[str] = (), starved_s: Mapping[str, float] | None = None
                  ) -> tuple[tuple[str, ...], str]:
    """(the watched members of `generation`, which began at step `first_step` with `joiners` new
    to it, that are stuck, why), or ((), why not). `where[a]`: its latest beat's position;
    `moved_at[a]`: when that position last changed; `starved_s[a]`: how long, since then, its
    process waited for a CPU (not counted as standing still; none given: 0)."""
    if bound_s is None:
        return (), "no bound: the rule is off, or no step was measured yet"
    judged = {a: where[a] for a in judged_members(where, watched, generation)}
    if len(judged) < 2:
        return (), "fewer than two members to compare"
    starved_s = starved_s or {}
    still = {a: now - moved_at.get(a, now) - starved_s.get(a, 0.0) for a in judged}
    ahead = max(judged.values(), key=lambda w: w.key)
    behind = [a for a, w in judged.items() if (a not in joiners or w.steps > first_step) and w.key < ahead.key]
    stuck = tuple(sorted(a for a in behind if still[a] > bound_s))
    if not stuck:
        starved = [a for a in behind if now - moved_at.get(a, now) > bound_s]
        if starved:
            return (), f"{', '.join(sorted(starved))} stood still past the bound, waiting for a CPU: starved, not stuck"
        return (), "every member behind its peers moved within the bound"
    peers = sorted(a for a, w in judged.items() if w.key == ahead.key)
    worst = max(stuck, key=lambda a: still[a])
    waited = starved_s.get(worst, 0.0)
    return stuck, (f"{', '.join(stuck)} did not move for {still[worst]:.1f} s (bound {bound_s:.1f} s"
                   + (f"; {waited:.1f} s more waiting for a CPU, not counted" if waited >= 0.05 else "")
                   + f") at {judged[worst].describe()} while {', '.join(peers)} went on to {ahead.describe()}")
