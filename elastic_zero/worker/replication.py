"""Replication overlapped with compute: a step's snapshot goes to the buddy while the next step runs.

After a step the worker copies its shard into host buffers (on CUDA, on a side stream into pinned
memory) and hands it here; a helper thread waits for the copy and swaps snapshots with the buddy
over the host group (replica.exchange) while the training thread goes on with the next step. The
step is committed when the worker collects the exchange (finish()), which it does before the next
step's closing all-reduce: the commit rule is unchanged, a step is committed when every rank holds
its snapshot and its ward's.

A buddy lost during the exchange fails it (its connection drops, or abort_generation() aborts the
host group, or the group's timeout passes): finish() raises, and the step is not committed. One
exchange is in flight at a time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from elastic_zero.worker.replica import exchange
from elastic_zero.zero.comm import Comm
from elastic_zero.zero.shard import ShardState


@dataclass
class InFlight:
    """One step's replication under way."""

    step: int
    snapshot: ShardState
    rows: list  # the sample records this commit carries: (step, rank, first position, count)
    copied: object | None  # a CUDA event marking the end of the device-to-host copy; None on CPU
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple | None = None  # (ward snapshot, ward log) once the exchange succeeded
    error: BaseException | None = None
    arrived_at: float | None = None  # when the ward's copy had arrived (time.perf_counter())
    copy_s: float = 0.0  # the step's own time copying the snapshot off the device (the caller's measure)
    started_at: float = field(default_factory=time.perf_counter)
    copied_at: float | None = None  # when the copy off the device was complete (the exchange's start)

    def wait_copied(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def times(self) -> tuple[float, float]:
        """(the copy off the device, the swap over the link) in seconds, once it arrived: the copy is
        the caller's part and what the exchange waited for it (a side stream's copy runs on)."""
        copied_at = self.copied_at if self.copied_at is not None else self.started_at
        arrived_at = self.arrived_at if self.arrived_at is not None else copied_at
        return self.copy_s + (copied_at - self.started_at), arrived_at - copied_at


class Replicator:
    def __init__(self) -> None:
        self.in_flight: InFlight | None = None

    def start(self, comm: Comm, step: int, snapshot: ShardState, copied, buddies: Sequence[int],
              rows: list, copy_s: float = 0.0) -> InFlight:
        """Swap `snapshot` (this rank's shard after `step`) and the sample records `rows` with the
        buddies in the background. `copy_s`: what copying it off the device took the caller."""
        if self.in_flight is not None:
            raise RuntimeError(f"replication of step {self.in_flight.step} is still in flight")
        flight = InFlight(step, snapshot, list(rows), copied, copy_s=copy_s)
        log = _log_tensor(rows) if rows else None

        def run() -> None:
            try:
                flight.wait_copied()
                # (on CPU the copy was complete before the thread began: its start is not the copy's)
                flight.copied_at = time.perf_counter() if flight.copied is not None else flight.started_at
                flight.result = exchange(comm, snapshot, buddies, log)
                flight.arrived_at = time.perf_counter()
            except BaseException as exc:  # noqa: BLE001 - handed to finish(), on the training thread
                flight.error = exc
            flight.done.set()

        # a daemon: an exchange stuck on a dead peer must never hold up the process's exit
        threading.Thread(target=run, daemon=True, name=f"replicate-s{step}").start()
        self.in_flight = flight
        return flight

    def finish(self) -> InFlight | None:
        """Wait for the exchange in flight and return it, its ward's copy in `result`; raise its
        error if it failed. None when nothing is in flight."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return None
        flight.done.wait()
        if flight.error is not None:
            raise flight.error
        return flight

    def settle(self) -> InFlight | None:
        """After a failure (the groups aborted, so the exchange ends soon): the exchange in flight
        if it had completed, else None."""
        try:
            return self.finish()
        except BaseException:  # noqa: BLE001 - a failed exchange commits nothing, which is the answer
            return None


def _log_tensor(rows: list) -> torch.Tensor:
    """The sample records as an int64 [k, 4] host buffer (the same k on every rank)."""
    from elastic_zero.zero.host_memory import host_copy

    return host_copy(torch.tensor(rows, dtype=torch.int64)).reshape(-1, 4)
