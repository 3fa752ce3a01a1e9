"""The process groups of a generation: built together, aborted together. One per worker, owned by
its Trainer (trainer.py); the groups built are kept in the worker's generation gate
(generation_gate.py), which aborts them.

Each generation has up to three groups, keyed by role under the prefix g<number>/<role>/:
- "train": the training group (NCCL on GPU, gloo on CPU), for the engine's collectives on device
  tensors and nothing else;
- "host": gloo over the same ranks, for the replicas, the sample logs and anything else in host
  memory (worker/replication.py);
- "handover": gloo over the participants of a handover (the members and the leavers); without
  leavers it is exactly the members in rank order and serves as the host group too.

NCCL carries only device tensors, and a host transfer on the training group would also queue
behind (or between) the engine's collectives; TorchComm's role check enforces the split.
"""

from __future__ import annotations

import os
import threading

from elastic_zero.zero import TorchComm, new_process_group
from elastic_zero.zero.abortable import GroupAborted

# NCCL's watchdog aborts a broken communicator and fails its work without killing the process
# (the default, 3, tears the process down): the survivors must live on to build the next generation
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


class GenerationGroups:
    def __init__(self, store, timeout_s: float, gate, on_collective) -> None:
        """`store`: the job's store; `timeout_s`: the collective timeout; `gate`: the worker's
        generation gate; `on_collective`: called as the training group enters each collective."""
        self._store, self._timeout_s, self._gate, self._on_collective = store, timeout_s, gate, on_collective

    def build(self, plan, wanted: dict[str, tuple[int, int, str]]) -> dict:
        """Build the groups `wanted` ({role: (rank, size, backend)}) of generation `plan.number` at
        once, and make them the current ones. Building waits in the store for every member; a member
        that died first would hold this worker there for the whole timeout (seen in the chaos drill: a
        survivor killed as unresponsive after 30 s), so the builds run on helper threads and an
        abort_generation() gives them up at once."""
        if "nccl" in {backend for _, _, backend in wanted.values()}:
            os.environ.setdefault(*NCCL_ERROR_HANDLING)  # read when the NCCL group is created
        lock = threading.Lock()
        outcome: dict = {}
        given_up: list[bool] = []
        finished = threading.Event()

        def build(role: str, rank: int, size: int, backend: str) -> None:
            try:
                # a connection of its own: a build given up still waits in the store until its
                # timeout, and on a shared client it would hold every later request behind it
                store = self._store.clone()
                result = new_process_group(store, f"g{plan.number}/{role}/", rank, size, backend,
                                           timeout_s=self._timeout_s)
            except Exception as exc:  # handed to the waiting thread, which raises it
                result = exc
            with lock:
                outcome[role] = result
                late = bool(given_up)
                if len(outcome) == len(wanted):
                    finished.set()
            if late and not isinstance(result, Exception):
                result.abort()  # built after all, for a generation that is over

        gate = self._gate
        with gate.lock:
            gate.building = finished
            if gate.aborted.is_set():
                finished.set()
        for role, (rank, size, backend) in wanted.items():
            threading.Thread(target=build, args=(role, rank, size, backend), daemon=True,
                             name=f"group-g{plan.number}-{role}").start()
        finished.wait()
        with gate.lock:
            gate.building = None
            with lock:
                if gate.aborted.is_set():
                    given_up.append(True)
                built = dict(outcome)
            errors = [e for e in built.values() if isinstance(e, Exception)]
            if given_up or errors:  # no group of a generation that cannot have them all is kept
                for pg in built.values():
                    if not isinstance(pg, Exception):
                        pg.abort()
                if given_up:
                    raise GroupAborted(f"generation {plan.number} was aborted while its groups were being built")
                raise errors[0]
            gate.groups.update(built)
        return built

    def train_comm(self) -> TorchComm:
        comm = TorchComm(self._gate.groups["train"], role="train")
        comm.on_collective = self._on_collective  # counted on the progress board (node_duties.py)
        return comm

    def handover_comm(self) -> TorchComm:
        return TorchComm(self._gate.groups["handover"], role="host")

    def host_comm(self) -> TorchComm:
        groups = self._gate.groups
        return TorchComm(groups.get("host") or groups["handover"], role="host")
