"""The worker's side of the fault drills ([[faults]]): drills.py says which are due at a moment;
this carries them out. The job's store makes each fire once, even when a recovery repeats a step, and
a kill writes its time there first (the coordinator times the recovery from it)."""

from __future__ import annotations

import os
import time

from elastic_zero.job.spec import HANG_ACTIONS, KILL_ACTIONS
from elastic_zero.protocol import GenerationPlan
from elastic_zero.worker.drills import due_drills
from elastic_zero.worker.node_duties import coordinator_handle


class DrillRunner:
    def __init__(self, faults, store, replicator, writer, duties, actor_id: str, coordinator: str | None,
                 namespace: str | None) -> None:
        """`replicator` and `writer`: what a kill waits for first (the swap in flight, the save in
        flight); `duties`: the worker's node duties (a hang is theirs)."""
        self._faults, self._store, self._replicator, self._writer = faults, store, replicator, writer
        self._duties, self._actor_id, self._coordinator, self._namespace = duties, actor_id, coordinator, namespace

    def fire(self, moment: str, plan: GenerationPlan, rank: int | None, step: int) -> None:
        for i, fault in due_drills(self._faults, moment, rank, step, plan.step, plan.source):
            if fault.action == "raise":  # a bug, not a fault: it happens every time the step is run
                raise RuntimeError(f"injected error at step {step} (faults[{i}])")
            if self._store.add(f"fault/{i}", 1) != 1:
                continue  # fired once already (before a recovery that repeats this step)
            if fault.action in KILL_ACTIONS:
                # the swap in flight arrives first (a buddy lost inside one: test_replication.py); at the
                # "commit" moment (drills.py) none is: the step's was committed just before
                if self._replicator.in_flight is not None:
                    self._replicator.in_flight.done.wait()
                if fault.action == "kill_after_save" and self._writer is not None:
                    self._writer.wait()  # the save in flight written (and on rank 0 committed) first
                self._store.set(f"fault/{i}/at", repr(time.time()))  # the coordinator times the recovery from here
                if fault.action == "device_error":  # as a failing GPU shows itself: train() ends the process
                    raise RuntimeError(f"CUDA error: an illegal memory access was encountered (injected by faults[{i}])")
                os._exit(1)
            if fault.action in HANG_ACTIONS:  # alive, not training: found stuck (plan/stuck.py)
                self._duties.hang(fault.action)
            coordinator = coordinator_handle(self._coordinator, self._namespace)
            if fault.action == "kill_coordinator":  # as its process dying would: its replacement takes over
                import ray

                ray.kill(coordinator, no_restart=True)
            if fault.action == "preempt":
                coordinator.preemption_notice.remote(self._actor_id, fault.deadline_s)
            elif fault.action == "scale":
                coordinator.scale.remote(fault.workers)
