"""The one small interface every collective of the engine goes through.

`TorchComm` wraps a torch.distributed process group (gloo on CPU, NCCL on GPU; the device comes
from the tensors). `SingleComm` is the one-rank implementation, so world size 1 runs the same code.

On gloo (torch 2.13), collectives of buffers below SECOND_BUFFER_MAX_BYTES take the fastest way
measured here (4 ranks on this 2-core machine, 1M / 5M fp32 elements):
- a reduce-scatter is an all-to-all into a receive buffer of the input's size, then this rank's sum of
  the chunks it received, rank by rank: 11.8 / 50.1 ms, against 19.2 / 62.3 ms for a ring all-reduce
  of the whole buffer and 22.5 / 87.1 ms for gloo's own reduce-scatter;
- an all-gather is gloo's own: 10.3 / 46.5 ms, against 14.9 / 67.1 ms for an all-reduce of a buffer
  zero outside the rank's chunk.
Both need a second buffer of the whole size (gloo's all-gather makes its own, measured: 191 MiB more
at the peak for a 191 MiB output). Larger buffers are all-reduced in place, as before, and add
nothing to a worker's peak (GPT-2 medium's shape peaks at the backward's end, reducing the tied
embedding's 206 MB bucket).

A gloo group comes wrapped in an AbortableGroup (abortable.py): every wait on its work can be broken
by an abort from another thread.

A worker has two groups per generation (see worker/groups.py), and its TorchComms say which one
each is: the "train" group carries the engine's collectives on device tensors, the "host" group
(always gloo) carries host buffers (host_memory.py) only. A tensor on the wrong one raises
TrafficError at once: NCCL would fail on a host tensor, or deadlock, and a device tensor on the
host group would be a hidden copy.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

from elastic_zero.zero.abortable import AbortableGroup
from elastic_zero.zero.host_memory import STEP_MMAP_THRESHOLD, checking_traffic, is_host_buffer

ROLES = ("train", "host")
# gloo collectives below this use a second buffer of their size: a stepping worker's heap hands out and
# takes back buffers below its mmap threshold (host_memory.py), so it faults in no fresh pages
SECOND_BUFFER_MAX_BYTES = STEP_MMAP_THRESHOLD


class TrafficError(RuntimeError):
    """A tensor was given to the group that must not carry it (a bug in the caller)."""


class Handle(Protocol):
    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class _Pending:
    """A torch Work waited on through its group (an AbortableGroup's waits can be broken)."""

    def __init__(self, work, wait) -> None:
        self._work, self._wait = work, wait

    def wait(self) -> None:
        self._wait(self._work)


class _Then:
    """A pending collective with a finishing step to run after it completes."""

    def __init__(self, work: Handle, finish) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._finish()


class Comm(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle: ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
        """Sum `input` (world_size equal chunks) over ranks; this rank's chunk lands in `output`.
        `input` may be overwritten."""
        ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
        """Concatenate every rank's `input` into `output`; `input` may be this rank's chunk of `output`."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle: ...


class SingleComm:
    rank = 0
    world_size = 1

    def all_reduce(self, tensor, op="sum", async_op=False):
        return _Done()

    def reduce_scatter(self, output, input, async_op=False):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _Done()

    def all_gather(self, output, input, async_op=False):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _Done()

    def broadcast(self, tensor, src=0):
        return None

    def send(self, tensor, dst, tag=0):
        raise ValueError("a one-rank group has no peer to send to")

    def recv(self, tensor, src, tag=0):
        raise ValueError("a one-rank group has no peer to receive from")


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchComm:
    """A Comm over a torch.distributed process group (a ProcessGroup or a backend object)."""

    def __init__(self, process_group, role: str | None = None) -> None:
        """`role`: "train" or "host" to check every tensor against the group's use; None checks nothing."""
        if role not in (None, *ROLES):
            raise ValueError(f"role must be one of {ROLES} or None, got {role!r}")
        self.pg = process_group
        self._wait = process_group.wait if isinstance(process_group, AbortableGroup) else _wait_plain
        self.rank = process_group.rank()
        self.world_size = process_group.size()
        self.backend = _backend_name(process_group)
        self.second_buffer_max_bytes = SECOND_BUFFER_MAX_BYTES  # (gloo only)
        if role == "host" and self.backend != "gloo":
            raise ValueError(f"the host group must be gloo, got {self.backend}")
        self.role = role
        self._device_type = "cuda" if self.backend == "nccl" else "cpu"
        self._check_buffers = checking_traffic()
        # called as each collective is entered (a worker counts them on its progress board: which rank
        # the others wait for shows in the counts)
        self.on_collective: Callable[[], None] | None = None

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        if self.on_collective is not None:
            self.on_collective()
        if self.role is None:
            return
        for t in tensors:
            if self.role == "host":
                wrong = t.device.type != "cpu" or (self._check_buffers and not is_host_buffer(t))
            else:
                wrong = t.device.type != self._device_type or (self._check_buffers and is_host_buffer(t))
            if wrong:
                kind = "host buffer" if t.device.type == "cpu" and is_host_buffer(t) else f"{t.device.type} tensor"
                raise TrafficError(f"{op} of a {kind} ({t.numel()} x {t.dtype}) on the {self.role} group "
                                   f"({self.backend}): " + ("it carries host buffers only" if self.role == "host"
                                                            else "it carries device tensors only"))

    def all_reduce(self, tensor, op="sum", async_op=False):
        self._check("all_reduce", tensor)
        opts = AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS[op]
        return self._maybe_wait(self.pg.allreduce([tensor], opts), async_op)

    def reduce_scatter(self, output, input, async_op=False):
        _check_chunks(output, input, self.world_size, "reduce_scatter")
        self._check("reduce_scatter", output, input)
        if self.backend != "gloo":
            return self._maybe_wait(self.pg._reduce_scatter_base(output, input, ReduceScatterOptions()), async_op)
        if self._second_buffer_allowed(input):
            received = torch.empty_like(input)  # chunk j: rank j's chunk of this rank's share
            work = self._pending(self.pg.alltoall_base(received, input, [], [], AllToAllOptions()))

            def finish() -> None:  # ranks summed in one order on every rank: the same bits wherever it runs
                torch.sum(received.view(self.world_size, -1), dim=0, out=output)
        else:
            work = self._pending(self.pg.allreduce([input], AllreduceOptions()))
            n = output.numel()
            mine = input[self.rank * n:(self.rank + 1) * n]

            def finish() -> None:
                if output.data_ptr() != mine.data_ptr():
                    output.copy_(mine)

        return self._maybe_wait(_Then(work, finish), async_op)

    def all_gather(self, output, input, async_op=False):
        _check_chunks(input, output, self.world_size, "all_gather")
        self._check("all_gather", output, input)
        if self.backend != "gloo" or self._second_buffer_allowed(output):
            return self._maybe_wait(self.pg._allgather_base(output, input, AllgatherOptions()), async_op)
        n = input.numel()  # gloo's own would gather into a buffer of the output's size, then copy it
        lo, hi = self.rank * n, (self.rank + 1) * n
        if output.data_ptr() != input.data_ptr() + lo * input.element_size():
            output[lo:hi].copy_(input)
        output[:lo].zero_()
        output[hi:].zero_()
        return self._maybe_wait(self.pg.allreduce([output], AllreduceOptions()), async_op)

    def _second_buffer_allowed(self, whole: torch.Tensor) -> bool:
        """Whether a gloo collective of `whole` may take its fastest way, which holds a second buffer of its size."""
        return whole.numel() * whole.element_size() < self.second_buffer_max_bytes

    def broadcast(self, tensor, src=0):
        self._check("broadcast", tensor)
        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._wait(self.pg.broadcast([tensor], opts))

    def send(self, tensor, dst, tag=0):
        self._check("send", tensor)
        return self._pending(self.pg.send([tensor], dst, tag))

    def recv(self, tensor, src, tag=0):
        self._check("recv", tensor)
        return self._pending(self.pg.recv([tensor], src, tag))

    def _pending(self, work) -> Handle:
        return work if isinstance(work, (_Then, _Pending)) else _Pending(work, self._wait)

    def _maybe_wait(self, work, async_op: bool):
        handle = self._pending(work)
        if async_op:
            return handle
        handle.wait()
        return _Done()


def _wait_plain(work) -> None:
    work.wait()


def _check_chunks(chunk: torch.Tensor, whole: torch.Tensor, world_size: int, what: str) -> None:
    if whole.numel() != chunk.numel() * world_size:
        raise ValueError(
            f"{what}: buffer of {whole.numel()} elements is not {world_size} chunks of {chunk.numel()}"
        )


def _backend_name(pg) -> str:
    for getter in ("_get_backend_name", "name"):
        fn = getattr(pg, getter, None)
        if fn is not None:
            try:
                return str(fn()).lower()
            except Exception:  # a wrapper whose backend is not set yet
                continue
    return "unknown"


def as_comm(process_group) -> Comm:
    """A Comm from None (one rank), an existing Comm, or a torch.distributed process group."""
    if process_group is None:
        return SingleComm()
    if isinstance(process_group, (SingleComm, TorchComm)):
        return process_group
    return TorchComm(process_group)


def new_process_group(store, prefix: str, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 60.0):
    """A process group of its own (no default group): `backend` over `store`, keys under `prefix`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":  # its abort() closes nothing: waits on it are made breakable instead
        return AbortableGroup(dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def agree_on_all_ranks(comm: Comm, text: str, device: torch.device, what: str) -> None:
    """Raise ValueError on every rank unless all ranks hold the same `text` (compared by digest)."""
    if comm.world_size == 1:
        return
    mine = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    probe = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    comm.all_reduce(probe, op="max")
    if probe.tolist() != [mine, -mine]:
        raise ValueError(f"rank {comm.rank}: the ranks of the process group built different {what}")
