"""ShardBuffers: this rank's shard of the training state as the engine holds it, and copies of it.

It owns the fp32 master (a tensor of its own, or, in fp32 at stages 1-2, the units' own chunks of
their parameter buffers), the reduced gradient and the optimizer's state vectors; it knows where
each unit's piece of them lives, and copies them out (a ShardState on the device, in host buffers,
or as views in place) and in. It runs no collective: the engine (engine.py) does those, and cuts
new ShardBuffers when the partition changes (reconfigure)."""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Mapping, Sequence

import torch

from elastic_zero.plan.layout import FlatLayout
from elastic_zero.plan.partition import Partition
from elastic_zero.zero.host_memory import host_empty
from elastic_zero.zero.shard import ShardState
from elastic_zero.zero.unit_buffer import UnitBuffer


class ShardBuffers:
    def __init__(self, layout: FlatLayout, partition: Partition, rank: int, units: Sequence[UnitBuffer],
                 state_names: Sequence[str], master_is_view: bool, device: torch.device, where: torch.device,
                 state_where: torch.device) -> None:
        """`device`: where the engine computes (a CUDA one gets side-stream host copies); `where`: where
        the master is allocated, `state_where` the gradient and optimizer state (meta: shaped, holding
        nothing, for state that is allocated later or filled by a reconfigure)."""
        self.layout, self.partition, self.rank, self.units = layout, partition, rank, list(units)
        self.names = ("params", *state_names)
        self.master_is_view = master_is_view
        self.device = device
        self.master = None if master_is_view else torch.zeros(partition.shard_numel, device=where)
        self.grad: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.allocate_state(state_where)
        self._readers: list = []  # CUDA events of host copies of the shard still running

    def allocate_state(self, where: torch.device) -> None:
        """The gradient shard and the optimizer's state vectors, zeros."""
        numel = self.partition.shard_numel
        self.grad = torch.zeros(numel, device=where)
        self.state = {name: torch.zeros(numel, device=where) for name in self.names[1:]}

    def release(self) -> None:
        """Let the master (unless it is the units' chunks), the gradient and the optimizer state go,
        once the host copies still reading them are done."""
        self.await_readers()
        self.master, self.grad, self.state = None, None, {}

    # ---- where each unit's piece of the shard's vectors lives ----------------------------------

    def _slice(self, unit: UnitBuffer) -> slice:
        start = self.partition.shard_unit_offset(unit.index)
        return slice(start, start + unit.chunk)

    def master_of(self, unit: UnitBuffer) -> torch.Tensor:
        return unit.own() if self.master_is_view else self.master[self._slice(unit)]

    def grad_of(self, unit: UnitBuffer) -> torch.Tensor:
        return self.grad[self._slice(unit)]

    def vector_of(self, name: str, unit: UnitBuffer) -> torch.Tensor:
        return self.master_of(unit) if name == "params" else self.state[name][self._slice(unit)]

    def unit_views(self) -> dict:
        """{vector name (and "grads"): unit -> its chunk}, what update_groups.py cuts the update by."""
        views = {name: (lambda unit, name=name: self.vector_of(name, unit)) for name in self.names}
        views["grads"] = self.grad_of
        return views

    # ---- copies out and in ---------------------------------------------------------------------

    def copy(self, scalars: dict) -> ShardState:
        """A device copy of the shard; the caller has let the gathers that write it land."""
        ranges = self.partition.ranges(self.rank)
        vectors = {name: torch.cat([self.vector_of(name, u)[: r.numel] for u, r in zip(self.units, ranges)])
                   for name in self.names}
        return ShardState(self.layout, self.partition, self.rank, vectors, dict(scalars))

    def host_copy(self, scalars: dict) -> tuple[ShardState, "torch.cuda.Event | None"]:
        """A copy in host buffers, made without a device-side concatenation. On CUDA the copy runs on
        a side stream into pinned buffers: it is complete once the returned event is, and the next
        write of the shard waits for it (await_readers); on CPU it is complete on return."""
        on_cuda = self.device.type == "cuda"
        ranges = self.partition.ranges(self.rank)
        numel = sum(r.numel for r in ranges)
        vectors = {}
        stream = torch.cuda.Stream(self.device) if on_cuda else None
        if on_cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after the update that wrote the shard
        with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
            for name in self.names:
                out = host_empty(numel, self.vector_of(name, self.units[0]).dtype, pinned=on_cuda)
                offset = 0
                for unit, r in zip(self.units, ranges):
                    out[offset : offset + r.numel].copy_(self.vector_of(name, unit)[: r.numel], non_blocking=on_cuda)
                    offset += r.numel
                vectors[name] = out
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record(stream)
            self._readers.append(event)
        return ShardState(self.layout, self.partition, self.rank, vectors, dict(scalars)), event

    def in_place(self, scalars: dict) -> ShardState:
        """The shard whose vectors are views of these buffers, not copies; valid while nothing writes them."""
        return ShardState(self.layout, self.partition, self.rank, _InPlace(self), dict(scalars))

    def write(self, state: ShardState) -> None:
        """Take `state`'s vectors (checked by the caller to fit this partition and rank); the
        padding past each range is zeroed."""
        self.await_readers()
        ranges = self.partition.ranges(self.rank)
        for name in self.names:
            offset = 0
            for unit, r in zip(self.units, ranges):
                dest = self.vector_of(name, unit)
                dest[: r.numel].copy_(state.vectors[name][offset : offset + r.numel])
                dest[r.numel :].zero_()
                offset += r.numel

    def await_readers(self) -> None:
        """Order every later write of the shard after the host copies of it still running (on the
        device's stream: the host does not wait)."""
        for event in self._readers:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._readers.clear()

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the shard's own tensors: the master (none when it is the units' chunks), the
        gradient and the optimizer state."""
        return {"params": _held(self.master), "grads": _held(self.grad),
                "optimizer": sum(_held(b) for b in self.state.values())}


def _held(t) -> int:
    """A hollow engine's tensors are on meta: shaped, holding nothing."""
    return 0 if t is None or t.is_meta else t.untyped_storage().nbytes()


class _InPlace(Mapping):
    """A shard's vectors by name, each a _VectorInPlace over the buffers' unit chunks."""

    def __init__(self, buffers: ShardBuffers) -> None:
        self._buffers = buffers

    def __getitem__(self, name: str) -> "_VectorInPlace":
        if name not in self._buffers.names:
            raise KeyError(name)
        return _VectorInPlace(self._buffers, name)

    def __iter__(self):
        return iter(self._buffers.names)

    def __len__(self) -> int:
        return len(self._buffers.names)


class _VectorInPlace:
    """One vector of the shard, packed in unit order as a ShardState's are, made of views of the
    unit chunks: a slice within one unit's range is a view, no copy (a checkpoint writer slices it
    block by block); a slice across ranges is put together."""

    def __init__(self, buffers: ShardBuffers, name: str) -> None:
        ranges = buffers.partition.ranges(buffers.rank)
        self.pieces = [buffers.vector_of(name, unit)[: r.numel] for unit, r in zip(buffers.units, ranges)]
        self.starts = list(itertools.accumulate([0] + [p.numel() for p in self.pieces[:-1]]))
        self.dtype = self.pieces[0].dtype if self.pieces else torch.float32
        self._numel = sum(p.numel() for p in self.pieces)

    def numel(self) -> int:
        return self._numel

    def dim(self) -> int:
        return 1

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, step = index.indices(self._numel)
        if step != 1:
            raise IndexError("a shard vector in place is sliced with step 1 only")
        parts = []
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while start < stop and i < len(self.pieces):
            lo, piece = self.starts[i], self.pieces[i]
            take = min(stop, lo + piece.numel())
            if take > start:
                parts.append(piece[start - lo : take - lo])
                start = take
            i += 1
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else self.pieces[0][:0]
