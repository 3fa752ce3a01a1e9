"""UnitFlow: the traffic of the units' buffers around a forward and a backward, driven by hooks.

Before a unit's forward its full parameter buffer is gathered (at stage 3 the next unit's is
prefetched, and the buffer is freed after use); as a unit's gradients complete in backward they
are reduce-scattered into this rank's gradient shard, a few reductions in flight at a time. The
engine (engine.py) owns the step; after a reconfigure it hands this flow the new group, units and
shard (cut_over): the hooks stay on the model, and name units by index."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from elastic_zero.zero.shard_buffers import ShardBuffers
from elastic_zero.zero.unit_buffer import UnitBuffer

REDUCES_IN_FLIGHT = 2  # gradient reductions a backward keeps going at once, each holding its unit's bucket


class StepInterrupted(RuntimeError):
    """interrupt() was called: the step in flight is abandoned at the next unit boundary."""


class UnitFlow:
    def __init__(self, stage: int, reduce_dtype: torch.dtype, loss_scale) -> None:
        """`loss_scale`: the engine's DynamicLossScale (fp16), or None; its scale is read at each fold."""
        self.stage, self.reduce_dtype, self.loss_scale = stage, reduce_dtype, loss_scale
        self.comm = None
        self.units: list[UnitBuffer] = []
        self.shard: ShardBuffers | None = None
        self._order: list[UnitBuffer] = []  # the units with a module, in forward order
        self._root: UnitBuffer | None = None  # the parameters of no unit module
        self._pending: list = []  # (unit, its reduced share, the reduction's handle)
        self.sync = True  # stage 1 with sync=False accumulates full gradients locally
        self._interrupted = False
        self.hooks: list = []

    def cut_over(self, comm, units: list[UnitBuffer], shard: ShardBuffers) -> None:
        """Run over `comm`'s ranks with these units and this shard from now on (none in flight)."""
        self.comm, self.units, self.shard = comm, units, shard
        self._order = [u for u in units if u.module is not None]
        self._root = next((u for u in units if u.module is None), None)

    # ---- hooks -------------------------------------------------------------------------------

    def install_hooks(self, module: nn.Module) -> None:
        # Hooks name units by index: cut_over() replaces the UnitBuffer objects.
        hooks = [module.register_forward_pre_hook(self._before_root_forward)]
        for unit in self._order:
            hooks.append(unit.module.register_forward_pre_hook(functools.partial(self._before_unit_forward, unit.index)))
            if self.stage == 3:
                hooks.append(unit.module.register_forward_hook(functools.partial(self._after_unit_forward, unit.index)))
        for unit in self.units:
            for p, _ in unit.members:
                hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, unit.index)))
        self.hooks = hooks

    def detach(self) -> None:
        """Take the hooks off the model and let go of the group (the engine is closing)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.comm = [], None

    def interrupt(self) -> None:
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
            self.launch_gather(unit)

    def _ensure_gathered(self, unit: UnitBuffer) -> None:
        if unit.is_free:
            self.launch_gather(unit)
        unit.wait_gathered()

    def launch_gather(self, unit: UnitBuffer) -> None:
        """Gather the unit's full buffer from every rank's chunk, asynchronously."""
        unit.wait_gathered()  # a gather still in flight writes this buffer: never start a second over it
        unit.allocate()
        own = unit.own()
        if not self.shard.master_is_view:
            own.copy_(self.shard.master_of(unit))
        unit.gather_handle = self.comm.all_gather(unit.full, own, async_op=True)

    def _reduce(self, unit: UnitBuffer) -> None:
        bucket = unit.take_grad_bucket(self.stage, self.reduce_dtype, self.sync)
        if bucket is None:
            return
        out = bucket[unit.own_slice]
        self._pending.append((unit, out, self.comm.reduce_scatter(out, bucket, async_op=True)))
        if self.stage == 3:
            unit.free()
        # each pending reduction holds its unit's whole gradient bucket: folding the oldest into the
        # shard as backward goes bounds them to a few units, where the whole model's would pile up
        while len(self._pending) > REDUCES_IN_FLIGHT:
            self._fold(*self._pending.pop(0))

    def _fold(self, unit: UnitBuffer, out: torch.Tensor, handle) -> None:
        """Wait for one unit's reduction and put its share into the gradient shard."""
        handle.wait()
        scale = 1.0 / self.comm.world_size
        if self.loss_scale is not None:
            scale /= self.loss_scale.scale
        shard = self.shard.grad_of(unit)
        if self.stage == 1:  # full gradients accumulate locally; the reduction replaces the shard
            shard.copy_(out)
            if scale != 1.0:
                shard.mul_(scale)
        else:
            shard.add_(out, alpha=scale)

    def backward_in_flight(self) -> bool:
        """A backward whose reductions are not all folded into the shard yet."""
        return bool(self._pending) or any(u.grads_seen for u in self.units)

    def finish_backward(self) -> None:
        for unit in self.units:
            if not unit.grads_done:
                self._reduce(unit)  # parameters that got no gradient this backward
        for pending in self._pending:
            self._fold(*pending)
        self._pending = []
        for unit in self.units:
            unit.start_backward()
            if self.stage == 3:
                unit.free()

    def forget_work_in_flight(self) -> None:
        """Drop the handles of the collectives in flight, never to wait for them (their group was aborted)."""
        self._pending = []
        for unit in self.units:
            unit.gather_handle = None

    def synchronize(self) -> None:
        """Wait until every parameter buffer that is allocated holds the current parameters."""
        for unit in self.units:
            unit.wait_gathered()
