"""When the job's kill drills (job/spec.py `faults`) killed their workers: each drill's worker
writes the time into the job's store as it kills, and a recovery counts its stall from the earliest
kill it follows (a killed worker's report, if any, comes later)."""

from __future__ import annotations

from elastic_zero.job.spec import KILL_ACTIONS


class DrillKills:
    def __init__(self, store, faults) -> None:
        self._store, self._faults = store, faults
        self._timed: set[str] = set()

    def new_times(self) -> list[float]:
        """When the kill drills that fired since the last call killed their workers (epoch seconds)."""
        times = []
        for i, fault in enumerate(self._faults):
            key = f"fault/{i}/at"
            if fault.action in KILL_ACTIONS and key not in self._timed and self._store.check([key]):
                self._timed.add(key)
                times.append(float(self._store.get(key).decode()))
        return times

    def fired_before(self, restarts: int) -> None:
        """The drills that killed this job's earlier coordinators (kill_coordinator, in order: one a
        restart) fired: marked so in this coordinator's store, which is new, so that a step run again
        does not kill this one too."""
        killers = [i for i, fault in enumerate(self._faults) if fault.action == "kill_coordinator"]
        for i in killers[:restarts]:
            self._store.set(f"fault/{i}", "1")
