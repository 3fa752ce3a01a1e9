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

import functools
import json
import time
from typing import Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from elastic_zero.plan.layout import build_layout
from elastic_zero.plan.partition import partition_layout
from elastic_zero.zero import exit_guard
from elastic_zero.zero.comm import agree_on_all_ranks, as_comm
from elastic_zero.zero.loss_scale import DynamicLossScale
from elastic_zero.zero.meta import UnitInitializer, has_meta_parameters
from elastic_zero.zero.shard_io import ShardIO
from elastic_zero.zero.update_groups import update_groups
from elastic_zero.zero.units import find_units, param_specs
from elastic_zero.zero.unit_buffer import UnitBuffer

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCES_IN_FLIGHT = 2  # gradient reductions a backward keeps going at once, each holding its unit's bucket
LAYOUT_ALIGN = 16  # elements each parameter's offset in a unit's flat buffer is a multiple of


class StepInterrupted(RuntimeError):
    """interrupt() was called: the step in flight is abandoned at the next unit boundary."""


class ZeroEngine(ShardIO):
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
        hollow: bool = False,
    ) -> None:
        """`device`: where a model built on the meta device lives (default cpu; a real model's is its
        parameters'). `init_values`: a meta model's starting weights by name (default: its own
        initialization, unit by unit; meta.py). `hollow`: allocate no state and set no values, for an
        engine that reconfigure() fills first (a worker joining a running job: a world-size-1 shard
        would be the whole model's state)."""
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
        initializer = UnitInitializer(model, torch.device(device or "cpu"), init_values) \
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
        self._pending_reduces: list = []
        self._shard_readers: list = []  # CUDA events of host copies of the shard still running (shard_io.py)
        self._host_copy = None  # the one step(host_copy=True) made: (ShardState, event, seconds)
        self._sync = True
        self._interrupted = False
        # the gradient and optimizer state are made after the units take their values: with a model
        # built for real, its own tensors go unit by unit first, so the two are never held together
        self._partition_over(self.comm, hollow, state_later=not hollow)
        if not hollow:
            self._take_initial_values(initializer)
            self._allocate_state(self.device)
        if initializer is not None:
            initializer.fill_frozen(model)
        self._install_hooks()
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
        shard_numel = self.partition.shard_numel
        self._master = None if self._master_is_view else torch.zeros(shard_numel, device=where)
        self._allocate_state(torch.device("meta") if state_later else where)
        self._order = [u for u in self.units if u.module is not None]
        self._root = next((u for u in self.units if u.module is None), None)

    def _allocate_state(self, where: torch.device) -> None:
        """The gradient shard and the optimizer's state vectors (zeros), and the update's views of them."""
        shard_numel = self.partition.shard_numel
        self._grad = torch.zeros(shard_numel, device=where)
        self._state = {name: torch.zeros(shard_numel, device=where) for name in self.optimizer.state_names}
        self._groups = self._build_update_groups()

    def _build_update_groups(self):
        views = {name: functools.partial(self._vector_unit, name) for name in self.vector_names()}
        views["grads"] = lambda unit: self._grad[self._shard_slice(unit)]
        return update_groups(self.layout, self.partition, self.rank, self.optimizer, self.units, views)

    # ---- hooks -------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        # Hooks name units by index: reconfigure() replaces the UnitBuffer objects.
        hooks = [self.module.register_forward_pre_hook(self._before_root_forward)]
        for unit in self._order:
            hooks.append(unit.module.register_forward_pre_hook(functools.partial(self._before_unit_forward, unit.index)))
            if self.stage == 3:
                hooks.append(unit.module.register_forward_hook(functools.partial(self._after_unit_forward, unit.index)))
        for unit in self.units:
            for p, _ in unit.members:
                hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, unit.index)))
        self._hooks = hooks

    def interrupt(self) -> None:
        """Abandon the step in flight (from another thread): forward and backward raise
        StepInterrupted at the next unit boundary. discard_partial_step() clears it."""
        self._interrupted = True

    def clear_interrupt(self) -> None:
        self._interrupted = False

    def _check_interrupt(self) -> None:
        if self._interrupted:
            raise StepInterrupted("the step was interrupted (the generation is being torn down)")

    def _before_root_forward(self, module, args) -> None:
        self._check_interrupt()
        if self._root is not None:
            self._ensure_gathered(self._root)
        if self.stage == 3 and self._order:
            self._prefetch(self._order[0])

    def _before_unit_forward(self, index: int, module, args) -> None:
        self._check_interrupt()
        unit = self.units[index]
        if self.stage == 3:
            pos = self._order.index(unit)
            if pos + 1 < len(self._order):
                self._prefetch(self._order[pos + 1])
        self._ensure_gathered(unit)

    def _after_unit_forward(self, index: int, module, args, output) -> None:
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._before_unit_backward, index))
        self.units[index].free()

    def _before_unit_backward(self, index: int, grad) -> None:
        unit = self.units[index]
        pos = self._order.index(unit)
        if pos > 0 and not self._order[pos - 1].grads_done:
            self._prefetch(self._order[pos - 1])
        self._ensure_gathered(unit)

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        self._check_interrupt()
        unit = self.units[index]
        if unit.grad_arrived(param, self.stage, self.reduce_dtype):
            self._reduce(unit)

    # ---- collectives -------------------------------------------------------------------------

    def _prefetch(self, unit: UnitBuffer) -> None:
        if unit.is_free:
            self._launch_gather(unit)

    def _ensure_gathered(self, unit: UnitBuffer) -> None:
        if unit.is_free:
            self._launch_gather(unit)
        unit.wait_gathered()

    def _launch_gather(self, unit: UnitBuffer) -> None:
        unit.wait_gathered()  # a gather still in flight writes this buffer: never start a second over it
        unit.allocate()
        own = unit.own()
        if not self._master_is_view:
            own.copy_(self._master_unit(unit))
        unit.gather_handle = self.comm.all_gather(unit.full, own, async_op=True)

    def _reduce(self, unit: UnitBuffer) -> None:
        bucket = unit.take_grad_bucket(self.stage, self.reduce_dtype, self._sync)
        if bucket is None:
            return
        out = bucket[unit.own_slice]
        self._pending_reduces.append((unit, out, self.comm.reduce_scatter(out, bucket, async_op=True)))
        if self.stage == 3:
            unit.free()
        # each pending reduction holds its unit's whole gradient bucket: folding the oldest into the
        # shard as backward goes bounds them to a few units, where the whole model's would pile up
        while len(self._pending_reduces) > REDUCES_IN_FLIGHT:
            self._fold(*self._pending_reduces.pop(0))

    def _fold(self, unit: UnitBuffer, out: torch.Tensor, handle) -> None:
        """Wait for one unit's reduction and put its share into the gradient shard."""
        handle.wait()
        scale = 1.0 / self.world_size
        if self.loss_scale is not None:
            scale /= self.loss_scale.scale
        shard = self._grad[self._shard_slice(unit)]
        if self.stage == 1:  # full gradients accumulate locally; the reduction replaces the shard
            shard.copy_(out)
            if scale != 1.0:
                shard.mul_(scale)
        else:
            shard.add_(out, alpha=scale)

    def _finish_backward(self) -> None:
        for unit in self.units:
            if not unit.grads_done:
                self._reduce(unit)  # parameters that got no gradient this backward
        for pending in self._pending_reduces:
            self._fold(*pending)
        self._pending_reduces = []
        for unit in self.units:
            unit.start_backward()
            if self.stage == 3:
                unit.free()

    # ---- the training API --------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """Backward of `loss`; gradients are averaged over ranks and accumulate over micro batches.

        Stage 1 with sync=False only accumulates locally (use it for all but the last micro batch);
        stages 2 and 3 always reduce, since they keep no full gradients."""
        self._sync = sync
        if self.loss_scale is not None:
            loss = loss * self.loss_scale.scale
        try:
            loss.backward()
            self._finish_backward()
        finally:
            self._sync = True

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
        if self._pending_reduces or any(u.grads_seen for u in self.units):
            self._finish_backward()  # loss.backward() was called directly
        self._grad_norm = None
        if self.loss_scale is not None:
            overflow = torch.logical_not(torch.isfinite(self._grad).all()).to(torch.float32).reshape(1)
            self.comm.all_reduce(overflow, op="max")
            overflowed = bool(overflow.item())
            self.loss_scale.update(overflowed)
            if overflowed:
                self.skipped_steps += 1
                return False
        if self.grad_clip is not None:
            # on the device, as torch's clip_grad_norm_: no read back of the norm (on a GPU the host
            # would wait for the backward); a coefficient clamped at 1 leaves the gradients as they are
            sq = torch.linalg.vector_norm(self._grad).square().reshape(1)
            self.comm.all_reduce(sq)
            self._grad_norm = sq.sqrt()
            self._grad.mul_(torch.clamp(self.grad_clip / (self._grad_norm + 1e-6), max=1.0))
        # at stages 1-2 the master shard is a chunk of the buffer an unfinished gather (a step with
        # no forward since the last) may still write: let it land before the update
        self.synchronize()
        self._await_shard_readers()
        lr_scale = self.optimizer.schedule.scale(self.step_count)
        for hyper, views in self._groups:
            states = {name: views[name] for name in self._state}
            self.optimizer.update(views["params"], views["grads"], states, hyper, self.step_count + 1, lr_scale)
        self.step_count += 1
        if host_copy:
            started = time.perf_counter()
            snapshot, copied = self.host_shard_state()
            self._host_copy = (snapshot, copied, time.perf_counter() - started)
        if self.stage in (1, 2):
            for unit in self.units:
                self._launch_gather(unit)
        return True

    def _await_shard_readers(self) -> None:
        """Order every write of the shard after the host copies of it that are still running (on
        the device's stream: the host does not wait)."""
        for event in self._shard_readers:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._shard_readers.clear()

    def zero_grad(self) -> None:
        self._grad.zero_()
        for unit in self.units:
            unit.zero_grads(self.stage)

    def discard_partial_step(self) -> None:
        """After a failed collective: forget the work in flight and the gradients of the lost step."""
        self.forget_work_in_flight()
        self._interrupted = False
        if self._grad is not None:  # (None: its state was released for a recovery)
            self._grad.zero_()
        for unit in self.units:
            unit.start_backward()
            unit.zero_grads(self.stage)

    def forget_work_in_flight(self) -> None:
        """Drop the handles of the collectives in flight, never to wait for them: their group was
        aborted. A gather dropped leaves its unit's full buffer unknown (the shard is intact): only
        reconfigure() or load_shard_state() makes the engine train again."""
        self._pending_reduces = []
        for unit in self.units:
            unit.gather_handle = None

    def close(self) -> None:
        """Finish pending work, remove the hooks and let go of the process group, so that it can be
        destroyed now rather than during interpreter shutdown (where gloo's threads may abort). Not
        needed at the end of a program: an engine still open then is closed by exit_guard.py."""
        exit_guard.untrack(self)
        if self.comm is None:
            return
        self.synchronize()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.comm = None

    def synchronize(self) -> None:
        """Wait until every parameter buffer that is allocated holds the current parameters."""
        for unit in self.units:
            unit.wait_gathered()

    def _after_bind(self, unit: UnitBuffer) -> None:
        if self.stage == 1:
            unit.attach_grad_views()  # after binding: gradients take the parameters' dtype
        if self.stage == 3:
            unit.free()
