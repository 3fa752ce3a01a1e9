"""ZeroEngine's state as plain data: its starting values, the gathered state dict, this rank's shard
(and its host copies), moving onto another process group from a resharded shard, and the bytes it
all holds. A mixin of ZeroEngine (engine.py), kept apart so the engine module holds the training
path only."""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Mapping

import torch

from elastic_zero.plan.partition import partition_layout
from elastic_zero.zero.comm import agree_on_all_ranks, as_comm
from elastic_zero.zero.host_memory import host_empty
from elastic_zero.zero.shard import ShardState, check_shard_fits
from elastic_zero.zero.unit_buffer import UnitBuffer


class ShardIO:
    # ---- where each unit's piece of the shard's vectors lives ----------------------------------

    def _shard_slice(self, unit: UnitBuffer) -> slice:
        start = self.partition.shard_unit_offset(unit.index)
        return slice(start, start + unit.chunk)

    def _master_unit(self, unit: UnitBuffer) -> torch.Tensor:
        if self._master_is_view:
            return unit.own()
        return self._master[self._shard_slice(unit)]

    def vector_names(self) -> tuple[str, ...]:
        return ("params", *self.optimizer.state_names)

    def _vector_unit(self, name: str, unit: UnitBuffer) -> torch.Tensor:
        if name == "params":
            return self._master_unit(unit)
        return self._state[name][self._shard_slice(unit)]

    # ---- the state as plain data ---------------------------------------------------------------

    def _take_initial_values(self, initializer) -> None:
        """Every unit's starting values, a unit at a time. From given weights at stage 3, each rank
        reads only its own range (N ranks read the model once). Otherwise rank 0's values are broadcast:
        a model's own initialization is random, and at stages 1-2 each rank holds whole units anyway."""
        own_ranges = initializer is not None and initializer.init_values is not None and self.stage == 3
        if own_ranges:  # no broadcast makes them agree: ranks reading different files must not fork
            agree_on_all_ranks(self.comm, initializer.fingerprint(), self.device, "weights to start from (init_from)")
        for unit in self.units:
            if own_ranges:
                self._master_unit(unit).copy_(unit.own_initial_values(initializer.read_flat))
                unit.bind_params()
            else:
                full32 = unit.initial_values(initializer.values if initializer is not None else None)
                self.comm.broadcast(full32, 0)
                if not self._master_is_view:
                    self._master_unit(unit).copy_(full32[unit.own_slice])
                unit.take_values(full32)
                del full32
            self._after_bind(unit)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict with the full fp32 parameters; every rank must call it."""
        self.synchronize()
        values: dict[int, torch.Tensor] = {}
        for unit in self.units:
            full32 = torch.empty(unit.padded, device=self.device)
            self.comm.all_gather(full32, self._master_unit(unit))
            for p, slot in unit.members:
                start = slot.offset - unit.span.offset
                values[id(p)] = full32[start : start + slot.numel].view(slot.shape).cpu().clone()
        if rank0_only and self.rank != 0:
            return {}
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            out[name] = values[id(t)] if id(t) in values else t.detach().cpu().clone()
        return out

    def shard_state(self) -> ShardState:
        """A copy of this rank's shard: every state vector over the rank's ranges, and the step."""
        self.synchronize()
        ranges = self.partition.ranges(self.rank)
        vectors = {
            name: torch.cat([self._vector_unit(name, u)[: r.numel] for u, r in zip(self.units, ranges)])
            for name in self.vector_names()
        }
        scalars: dict = {"step": self.step_count}
        if self.loss_scale is not None:
            scalars["loss_scale"] = self.loss_scale.scale
        return ShardState(self.layout, self.partition, self.rank, vectors, scalars)

    def host_shard_state(self) -> tuple[ShardState, "torch.cuda.Event | None"]:
        """A copy of this rank's shard in host buffers, made without a device-side concatenation. On
        CUDA the copy runs on a side stream into pinned buffers: it is complete once the returned
        event is; on CPU it is complete on return (and the event is None)."""
        if self._master_is_view:  # the master is the gathered buffer's own chunk, which the gathers rewrite
            self.synchronize()
        on_cuda = self.device.type == "cuda"
        ranges = self.partition.ranges(self.rank)
        numel = sum(r.numel for r in ranges)
        vectors = {}
        stream = torch.cuda.Stream(self.device) if on_cuda else None
        if on_cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after the update that wrote the shard
        with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
            for name in self.vector_names():
                out = host_empty(numel, self._vector_unit(name, self.units[0]).dtype, pinned=on_cuda)
                offset = 0
                for unit, r in zip(self.units, ranges):
                    source = self._vector_unit(name, unit)[: r.numel]
                    out[offset : offset + r.numel].copy_(source, non_blocking=on_cuda)
                    offset += r.numel
                vectors[name] = out
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record(stream)
            self._shard_readers.append(event)  # the next update of the shard waits for the copy
        scalars: dict = {"step": self.step_count}
        if self.loss_scale is not None:
            scalars["loss_scale"] = self.loss_scale.scale
        return ShardState(self.layout, self.partition, self.rank, vectors, scalars), event

    def take_host_copy(self):
        """(host copy of the shard, its CUDA event or None, seconds the copy took) made by the last
        step(host_copy=True) if no step followed it, else None; taken once."""
        taken, self._host_copy = self._host_copy, None
        if taken is not None and int(taken[0].scalars["step"]) != self.step_count:
            return None
        return taken

    def shard_in_place(self) -> ShardState:
        """This rank's shard whose vectors are views of the engine's own tensors, not copies: what a
        save that nothing trains beside (the final weights, a stop) writes from, a block at a time.
        The engine must not change until it is written."""
        self.synchronize()
        scalars: dict = {"step": self.step_count}
        if self.loss_scale is not None:
            scalars["loss_scale"] = self.loss_scale.scale
        return ShardState(self.layout, self.partition, self.rank, _InPlace(self, self.vector_names()), scalars)

    def load_shard_state(self, state: ShardState) -> None:
        """Replace this rank's shard with `state` (same layout, world size and rank) and republish."""
        self._check_shard(state, self.world_size, self.rank)
        self._await_shard_readers()
        self.synchronize()
        self._write_shard(state)

    def release_state(self) -> None:
        """Free the shard's state (master, gradient, optimizer state): a handover, whose shards move
        from replicas or a host copy, lets it go before the new shard arrives. Only reconfigure()
        makes the engine usable again."""
        self._await_shard_readers()  # before the buffers a host copy may still read are freed
        self.synchronize()
        self._master = self._grad = self._host_copy = None
        self._state, self._groups = {}, ()  # (the update's groups hold views of them)

    def reconfigure(self, process_group, state: ShardState) -> None:
        """Continue on another process group (another world size) from `state`, this rank's shard of
        the new partition: the model, its hooks and the optimizer stay; the buffers are cut anew."""
        comm = as_comm(process_group)
        self._check_shard(state, comm.world_size, comm.rank)
        if self._pending_reduces or any(u.grads_seen for u in self.units):
            raise RuntimeError("reconfigure() at a safe point only: a backward has not been stepped")
        self.release_state()  # `state` holds every value the new partition takes: never both at once
        self._partition_over(comm)
        for unit in self.units:
            unit.bind_params()
        self._write_shard(state)
        for unit in self.units:
            self._after_bind(unit)

    def _check_shard(self, state: ShardState, world_size: int, rank: int) -> None:
        check_shard_fits(state, self.layout, partition_layout(self.layout, world_size), rank, self.vector_names())

    def _write_shard(self, state: ShardState) -> None:
        self._await_shard_readers()
        self._host_copy = None  # of the shard replaced
        ranges = self.partition.ranges(self.rank)
        for name in self.vector_names():
            offset = 0
            for unit, r in zip(self.units, ranges):
                dest = self._vector_unit(name, unit)
                dest[: r.numel].copy_(state.vectors[name][offset : offset + r.numel])
                dest[r.numel :].zero_()
                offset += r.numel
        self.step_count = int(state.scalars["step"])
        if self.loss_scale is not None and "loss_scale" in state.scalars:
            self.loss_scale.scale = float(state.scalars["loss_scale"])
        # Publish lazily, as after step(): each unit's forward waits for its own buffer, so the
        # gathers overlap the first forward. Stage 3 frees the buffers instead (see _after_bind).
        if self.stage != 3:
            for unit in self.units:
                self._launch_gather(unit)

    def memory_report(self) -> dict[str, int]:
        """Bytes held on this rank now, by category, with the parameter count and world size."""
        def held(t) -> int:  # a hollow engine's tensors are on meta: shaped, holding nothing
            return 0 if t is None or t.is_meta else t.untyped_storage().nbytes()

        return {
            "params": held(self._master) + sum(held(u.full) for u in self.units),
            "grads": held(self._grad) + sum(held(u.grad_full) for u in self.units),
            "optimizer": sum(held(b) for b in self._state.values()),
            "buffers": sum(b.nbytes for b in self.module.buffers()),
            "param_count": self.layout.param_numel,
            "world_size": self.world_size,
            "stage": self.stage,
        }


class _InPlace(Mapping):
    """A shard's vectors by name, each a _VectorInPlace over the engine's unit chunks."""

    def __init__(self, engine, names) -> None:
        self._engine, self._names = engine, tuple(names)

    def __getitem__(self, name: str) -> "_VectorInPlace":
        if name not in self._names:
            raise KeyError(name)
        return _VectorInPlace(self._engine, name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _VectorInPlace:
    """One vector of the shard, packed in unit order as a ShardState's are, made of views of the
    engine's unit chunks: a slice within one unit's range is a view, no copy (a checkpoint writer
    slices it block by block); a slice across ranges is put together."""

    def __init__(self, engine, name: str) -> None:
        ranges = engine.partition.ranges(engine.rank)
        self.pieces = [engine._vector_unit(name, unit)[: r.numel] for unit, r in zip(engine.units, ranges)]
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
