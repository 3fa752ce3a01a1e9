"""ZeroEngine: data-parallel training with ZeRO stage 1, 2 or 3 sharding.

Every unit (see units.py) keeps its parameters in one flat buffer of N equal chunks; the model's
parameters are views into it. Rank r owns chunk r of every unit: the fp32 master copy, the
optimizer state and the reduced gradient of those elements.

- stage 1: full gradients stay on every rank; each unit is reduce-scattered once its gradients
  are complete in a synchronising backward, so the reduction overlaps the rest of backward.
- stage 2: as 1, but each unit's gradients go to a temporary bucket that is reduce-scattered and
  dropped as soon as the unit is done: only the gradient shard persists.
- stage 3: as 2, and the full parameter buffers are freed outside a unit's forward and backward;
  they are gathered just before use, the next unit prefetched while the current one computes.

In fp32 at stages 1 and 2 the master shard is the rank's own chunk of the parameter buffer, so no
second fp32 copy of the parameters exists. After step() the updated chunks are all-gathered
asynchronously; a unit's forward waits for its own buffer, so the gather overlaps the forward.
Read parameters outside forward only after synchronize() (full_state_dict does it).
"""

from __future__ import annotations

import json
import time
from typing import Collection, Mapping, Sequence

import torch
from torch import nn

from elastic_zero.plan.layout import build_layout
from elastic_zero.plan.partition import partition_layout
from elastic_zero.zero import exit_guard
from elastic_zero.zero.comm import agree_on_all_ranks, as_comm
from elastic_zero.zero.loss_scale import DynamicLossScale
from elastic_zero.zero.meta import UnitInitializer, has_meta_parameters
from elastic_zero.zero.shard import ShardState, check_shard_fits
from elastic_zero.zero.shard_buffers import ShardBuffers
from elastic_zero.zero.update_groups import update_groups
from elastic_zero.zero.units import find_units, param_specs
from elastic_zero.zero.unit_buffer import UnitBuffer
from elastic_zero.zero.unit_flow import UnitFlow
from elastic_zero.zero.whole_state import gather_state_dict, take_starting_values

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUT_ALIGN = 16  # elements each parameter's offset in a unit's flat buffer is a multiple of


class ZeroEngine:
    def __init__(
        self,
        model: nn.Module,
        optimizer,
        stage: int = 1,
        process_group=None,
        *,
        grad_clip: float | None = None,
        compute_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype | None = None,
        wrap: type | Sequence[type] | None = None,
        align: int = LAYOUT_ALIGN,
        device: torch.device | str | None = None,
        init_values: Mapping[str, torch.Tensor] | None = None,
        own_init: Collection[str] = (),
        hollow: bool = False,
    ) -> None:
        """`device`: where a model built on the meta device lives (default cpu; a real model's is its
        parameters'). `init_values`: a meta model's starting weights by name (default: its own
        initialization, unit by unit; meta.py); `own_init`: the names of parameters they lack on
        purpose (new adapters, a new head), which take the model's own. `hollow`: allocate no state
        and set no values, for an engine that reconfigure() fills first (a worker joining a running
        job: a world-size-1 shard would be the whole model's state)."""
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of float32, bfloat16, float16, got {compute_dtype}")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {grad_clip}")
        self.module = model
        self.optimizer = optimizer
        self.stage = stage
        self.grad_clip = grad_clip
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype or compute_dtype
        self.comm = as_comm(process_group)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.step_count = 0
        self.skipped_steps = 0
        self._grad_norm: torch.Tensor | None = None  # the last step's global gradient norm, on the device
        # fp16 gradients underflow without it; bf16 has fp32's exponent range and needs none
        self.loss_scale = DynamicLossScale() if compute_dtype == torch.float16 else None

        # a model on the meta device gets real (storage-less) parameters now, and values unit by unit below
        initializer = UnitInitializer(model, torch.device(device or "cpu"), init_values, own_init) \
            if has_meta_parameters(model) else None
        unit_modules = find_units(model, wrap)
        specs = param_specs(model, unit_modules)
        self.device = specs[0][1].device
        elsewhere = [spec.name for spec, p in specs if p.device != self.device]
        if elsewhere:
            raise ValueError(f"parameters must share one device: {elsewhere[0]!r} is not on {self.device}")
        self.layout = build_layout([spec for spec, _ in specs], align=align)
        agree_on_all_ranks(self.comm, json.dumps(self.layout.to_dict(), sort_keys=True), self.device,
                           f"parameter layouts ({len(self.layout.slots)} parameters, "
                           f"{self.layout.param_numel} elements on rank {self.rank})")
        self._params = {spec.name: p for spec, p in specs}
        self._unit_modules = dict(unit_modules)
        # The master copy is the rank's own chunk of each parameter buffer where it can be.
        self._master_is_view = stage in (1, 2) and compute_dtype == torch.float32
        self._host_copy = None  # the one step(host_copy=True) made: (ShardState, event, seconds)
        self._flow = UnitFlow(stage, self.reduce_dtype, self.loss_scale)
        # the gradient and optimizer state are made after the units take their values: with a model
        # built for real, its own tensors go unit by unit first, so the two are never held together
        self._partition_over(self.comm, hollow, state_later=not hollow)
        if not hollow:
            take_starting_values(self.comm, self.shard, self.units, stage, self.device, initializer, self._after_bind)
            self.shard.allocate_state(self.device)
            self._groups = self._build_update_groups()
        if initializer is not None:
            initializer.fill_frozen(model)
        self._flow.install_hooks(model)
        exit_guard.track(self)  # closed at interpreter exit if still open: see exit_guard.py

    def _partition_over(self, comm, hollow: bool = False, state_later: bool = False) -> None:
        """Cut the layout over `comm`'s ranks and allocate this rank's buffers (values not set;
        `hollow`: shaped, holding no bytes)."""
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.partition = partition_layout(self.layout, self.world_size)
        where = torch.device("meta") if hollow else self.device
        self.units: list[UnitBuffer] = []
        for ui, span in enumerate(self.layout.units):
            members = [(self._params[s.name], s) for s in self.layout.unit_slots(ui)]
            # stage 3 holds a unit's full buffer only while it is used: none is allocated up front
            # (a hollow engine's buffers are on the meta device: shaped, holding nothing)
            self.units.append(UnitBuffer(ui, span, self._unit_modules.get(span.name), members, self.partition,
                                         self.rank, self.compute_dtype, where, allocated=self.stage != 3 or hollow))
        self.shard = ShardBuffers(self.layout, self.partition, self.rank, self.units, self.optimizer.state_names,
                                  self._master_is_view, self.device, where,
                                  torch.device("meta") if state_later else where)
        self._groups = self._build_update_groups()
        self._flow.cut_over(comm, self.units, self.shard)

    def _build_update_groups(self):
        """The update's runs, as views of the shard's vectors."""
        return update_groups(self.layout, self.partition, self.rank, self.optimizer, self.units,
                             self.shard.unit_views())

    def interrupt(self) -> None:
        """Abandon the step in flight (from another thread): forward and backward raise
        StepInterrupted at the next unit boundary. discard_partial_step() clears it."""
        self._flow.interrupt()

    def clear_interrupt(self) -> None:
        self._flow.clear_interrupt()

    # ---- the training API --------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """Backward of `loss`; gradients are averaged over ranks and accumulate over micro batches.

        Stage 1 with sync=False only accumulates locally (use it for all but the last micro batch);
        stages 2 and 3 always reduce, since they keep no full gradients."""
        self._flow.sync = sync
        if self.loss_scale is not None:
            loss = loss * self.loss_scale.scale
        try:
            loss.backward()
            self._flow.finish_backward()
        finally:
            self._flow.sync = True

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm the last step clipped by (read from the device when asked)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def step(self, host_copy: bool = False) -> bool:
        """Clip by the global norm over all shards, update the shard, publish the parameters.
        `host_copy`: also copy the updated shard to host memory, before the parameters are published
        (take it with take_host_copy()): at stages 1-2 in fp32 the master is the gathered buffer's own
        chunk, which a copy made later would have to wait for the gathers to finish with.

        Returns False when fp16 gradients overflowed: the step is skipped and the loss scale backs off."""
        if self._flow.backward_in_flight():
            self._flow.finish_backward()  # loss.backward() was called directly
        self._grad_norm = None
        if self.loss_scale is not None:
            overflow = torch.logical_not(torch.isfinite(self.shard.grad).all()).to(torch.float32).reshape(1)
            self.comm.all_reduce(overflow, op="max")
            overflowed = bool(overflow.item())
            self.loss_scale.update(overflowed)
            if overflowed:
                self.skipped_steps += 1
                return False
        if self.grad_clip is not None:
            # on the device, as torch's clip_grad_norm_: no read back of the norm (on a GPU the host
            # would wait for the backward); a coefficient clamped at 1 leaves the gradients as they are
            sq = torch.linalg.vector_norm(self.shard.grad).square().reshape(1)
            self.comm.all_reduce(sq)
            self._grad_norm = sq.sqrt()
            self.shard.grad.mul_(torch.clamp(self.grad_clip / (self._grad_norm + 1e-6), max=1.0))
        # at stages 1-2 the master shard is a chunk of the buffer an unfinished gather (a step with
        # no forward since the last) may still write: let it land before the update
        self.synchronize()
        self.shard.await_readers()
        lr_scale = self.optimizer.schedule.scale(self.step_count)
        for hyper, views in self._groups:
            states = {name: views[name] for name in self.optimizer.state_names}
            self.optimizer.update(views["params"], views["grads"], states, hyper, self.step_count + 1, lr_scale)
        self.step_count += 1
        if host_copy:
            started = time.perf_counter()
            snapshot, copied = self.host_shard_state()
            self._host_copy = (snapshot, copied, time.perf_counter() - started)
        if self.stage in (1, 2):
            for unit in self.units:
                self._flow.launch_gather(unit)
        return True

    def zero_grad(self) -> None:
        self.shard.grad.zero_()
        for unit in self.units:
            unit.zero_grads(self.stage)

    def discard_partial_step(self) -> None:
        """After a failed collective: forget the work in flight and the gradients of the lost step."""
        self.forget_work_in_flight()
        self._flow.clear_interrupt()
        if self.shard.grad is not None:  # (None: its state was released for a recovery)
            self.shard.grad.zero_()
        for unit in self.units:
            unit.start_backward()
            unit.zero_grads(self.stage)

    def forget_work_in_flight(self) -> None:
        """Drop the handles of the collectives in flight, never to wait for them: their group was
        aborted. A gather dropped leaves its unit's full buffer unknown (the shard is intact): only
        reconfigure() or load_shard_state() makes the engine train again."""
        self._flow.forget_work_in_flight()

    def close(self) -> None:
        """Finish pending work, remove the hooks and let go of the process group, so that it can be
        destroyed now rather than during interpreter shutdown (where gloo's threads may abort). Not
        needed at the end of a program: an engine still open then is closed by exit_guard.py."""
        exit_guard.untrack(self)
        if self.comm is None:
            return
        self.synchronize()
        self._flow.detach()
        self.comm = None

    def synchronize(self) -> None:
        """Wait until every parameter buffer that is allocated holds the current parameters."""
        self._flow.synchronize()

    # ---- the state as plain data (the shard's own buffers: shard_buffers.py) -------------------

    def vector_names(self) -> tuple[str, ...]:
        return self.shard.names

    def _scalars(self) -> dict:
        scalars: dict = {"step": self.step_count}
        if self.loss_scale is not None:
            scalars["loss_scale"] = self.loss_scale.scale
        return scalars

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict with the full fp32 parameters; every rank must call it."""
        self.synchronize()
        out = gather_state_dict(self.comm, self.shard, self.units, self.module, self.device)
        return {} if rank0_only and self.rank != 0 else out

    def shard_state(self) -> ShardState:
        """A copy of this rank's shard: every state vector over the rank's ranges, and the step."""
        self.synchronize()
        return self.shard.copy(self._scalars())

    def host_shard_state(self) -> tuple[ShardState, "torch.cuda.Event | None"]:
        """A copy of this rank's shard in host buffers (pinned, on a side stream, on CUDA: complete
        once the returned event is; on CPU complete on return, the event None)."""
        if self._master_is_view:  # the master is the gathered buffer's own chunk, which the gathers rewrite
            self.synchronize()
        return self.shard.host_copy(self._scalars())

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
        return self.shard.in_place(self._scalars())

    def load_shard_state(self, state: ShardState) -> None:
        """Replace this rank's shard with `state` (same layout, world size and rank) and republish."""
        check_shard_fits(state, self.layout, self.partition, self.rank, self.vector_names())
        self.shard.await_readers()
        self.synchronize()
        self._write_shard(state)

    def release_state(self) -> None:
        """Free the shard's state (master, gradient, optimizer state): a handover, whose shards move
        from replicas or a host copy, lets it go before the new shard arrives. Only reconfigure()
        makes the engine usable again."""
        self.synchronize()
        self.shard.release()  # after the host copies still reading it
        self._host_copy, self._groups = None, ()  # (the update's groups hold views of it)

    def reconfigure(self, process_group, state: ShardState) -> None:
        """Continue on another process group (another world size) from `state`, this rank's shard of
        the new partition: the model, its hooks and the optimizer stay; the buffers are cut anew."""
        comm = as_comm(process_group)
        check_shard_fits(state, self.layout, partition_layout(self.layout, comm.world_size), comm.rank,
                         self.vector_names())
        if self._flow.backward_in_flight():
            raise RuntimeError("reconfigure() at a safe point only: a backward has not been stepped")
        self.release_state()  # `state` holds every value the new partition takes: never both at once
        self._partition_over(comm)
        for unit in self.units:
            unit.bind_params()
        self._write_shard(state)
        for unit in self.units:
            self._after_bind(unit)

    def _write_shard(self, state: ShardState) -> None:
        self._host_copy = None  # of the shard replaced
        self.shard.write(state)
        self.step_count = int(state.scalars["step"])
        if self.loss_scale is not None and "loss_scale" in state.scalars:
            self.loss_scale.scale = float(state.scalars["loss_scale"])
        # Publish lazily, as after step(): each unit's forward waits for its own buffer, so the
        # gathers overlap the first forward. Stage 3 frees the buffers instead (see _after_bind).
        if self.stage != 3:
            for unit in self.units:
                self._flow.launch_gather(unit)

    def memory_report(self) -> dict[str, int]:
        """Bytes held on this rank now, by category, with the parameter count and world size."""
        def held(t) -> int:  # a hollow engine's buffers are on meta: shaped, holding nothing
            return 0 if t is None or t.is_meta else t.untyped_storage().nbytes()

        shard = self.shard.bytes_held()
        return {
            "params": shard["params"] + sum(held(u.full) for u in self.units),
            "grads": shard["grads"] + sum(held(u.grad_full) for u in self.units),
            "optimizer": shard["optimizer"],
            "buffers": sum(b.nbytes for b in self.module.buffers()),
            "param_count": self.layout.param_numel,
            "world_size": self.world_size,
            "stage": self.stage,
        }

    def _after_bind(self, unit: UnitBuffer) -> None:
        if self.stage == 1:
            unit.attach_grad_views()  # after binding: gradients take the parameters' dtype
        if self.stage == 3:
            unit.free()
