"""The flat buffers of one unit on one rank: full parameters, full gradients, and their lifecycle.

The full parameter buffer holds N equal chunks (N = world size); the unit's parameters are views
into it. Stage 3 frees it by shrinking its storage to zero bytes and refills it by growing the
storage again, so the views (and any autograd saved for backward) stay valid across the gap.
"""

from __future__ import annotations

import torch
from torch import nn

from elastic_zero.plan.layout import ParamSlot, UnitSpan
from elastic_zero.plan.partition import Partition


class UnitBuffer:
    def __init__(
        self,
        index: int,
        span: UnitSpan,
        module: nn.Module | None,
        members: list[tuple[nn.Parameter, ParamSlot]],
        partition: Partition,
        rank: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        allocated: bool = True,
    ) -> None:
        self.index = index
        self.span = span
        self.module = module  # None for the root unit
        self.members = members
        self._slot_of = {id(p): slot for p, slot in members}
        self.chunk = partition.chunks[index]
        self.padded = self.chunk * partition.world_size
        self.own_slice = slice(rank * self.chunk, (rank + 1) * self.chunk)
        self.full = torch.zeros(self.padded, dtype=compute_dtype, device=device) if allocated else \
            torch.empty(self.padded, dtype=compute_dtype, device=device)
        if not allocated:  # shaped, holding no bytes until allocate()
            self.full.untyped_storage().resize_(0)
        self.grad_full: torch.Tensor | None = None  # stage 1 only
        self.gather_handle = None
        self._allocated = allocated
        self._arrived = 0
        self.grads_done = False  # reduced (or skipped) in the current backward
        self.grads_seen = False  # some gradient arrived in the current backward

    def _flat(self, t: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        start = slot.offset - self.span.offset
        return t[start : start + slot.numel]

    # ---- parameters ---------------------------------------------------------------------------

    def initial_values(self, values_of=None) -> torch.Tensor:
        """The parameters' current values (or those `values_of(names)` gives by name), flattened
        into a padded fp32 buffer."""
        full32 = torch.zeros(self.padded, dtype=torch.float32, device=self.full.device)
        given = values_of([slot.name for _, slot in self.members]) if values_of is not None else None
        for p, slot in self.members:
            source = given[slot.name] if given is not None else p.detach()
            self._flat(full32, slot).copy_(source.reshape(-1))
        return full32

    def own_initial_values(self, read_flat) -> torch.Tensor:
        """This rank's chunk of the padded fp32 buffer, each parameter's part of it read by
        `read_flat(name, lo, hi)` (elements [lo, hi) of the flattened parameter): nothing else is read."""
        own = torch.zeros(self.chunk, dtype=torch.float32, device=self.full.device)
        first, last = self.own_slice.start, self.own_slice.stop
        for _, slot in self.members:
            start = slot.offset - self.span.offset
            lo, hi = max(first, start), min(last, start + slot.numel)
            if lo < hi:
                own[lo - first : hi - first].copy_(read_flat(slot.name, lo - start, hi - start))
        return own

    def take_values(self, full32: torch.Tensor) -> None:
        """Fill the buffer from `full32` and make the parameters views into it."""
        self.allocate()
        self.full.copy_(full32)
        self.bind_params()

    def bind_params(self) -> None:
        """Make the parameters views into this buffer (their values are the buffer's). A view is
        made over allocated bytes only, so a free buffer is allocated for the moment (untouched: on
        CPU it costs no memory, on CUDA the caching allocator keeps it for the next unit)."""
        was_free = self.is_free
        self.allocate()
        for p, slot in self.members:
            p.data = self._flat(self.full, slot).view(slot.shape)
        if was_free:
            self.free()

    def own(self) -> torch.Tensor:
        return self.full[self.own_slice]

    @property
    def is_free(self) -> bool:
        return not self._allocated

    def allocate(self) -> None:
        if not self._allocated:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
            self._allocated = True

    def free(self) -> None:
        if self._allocated:
            self.wait_gathered()
            self.full.untyped_storage().resize_(0)
            self._allocated = False

    def wait_gathered(self) -> None:
        if self.gather_handle is not None:
            handle, self.gather_handle = self.gather_handle, None
            handle.wait()

    # ---- gradients ----------------------------------------------------------------------------

    def attach_grad_views(self) -> None:
        """Stage 1: persistent full gradients; autograd accumulates into views of one buffer."""
        self.grad_full = torch.zeros(self.padded, dtype=self.full.dtype, device=self.full.device)
        for p, slot in self.members:
            p.grad = self._flat(self.grad_full, slot).view(slot.shape)

    def grad_arrived(self, p: nn.Parameter, stage: int, reduce_dtype: torch.dtype) -> bool:
        """Take the gradient of `p`; True once every parameter of the unit has one.

        Stages 2-3 leave each gradient where autograd put it until the unit's last one arrives, and
        only then make the unit's bucket (take_grad_bucket): a bucket made at the first would be held
        from then on, and the root unit's gradients arrive at both ends of the backward (a tied LM
        head first, its embedding last): with GPT-2 medium's shape at ZeRO-3 that bucket (206 MB)
        was held through the whole backward, and the worker peaked 0.29 GiB higher."""
        slot = self._slot_of[id(p)]
        self.grads_seen = True
        if stage == 1:
            view = self._flat(self.grad_full, slot)
            if p.grad.data_ptr() != view.data_ptr():  # someone replaced .grad: fold it back in
                view.copy_(p.grad.reshape(-1))
                p.grad = view.view(slot.shape)
        self._arrived += 1
        return self._arrived == len(self.members)

    def take_grad_bucket(self, stage: int, reduce_dtype: torch.dtype, sync: bool) -> torch.Tensor | None:
        """The padded gradients to reduce-scatter now (a buffer the collective may overwrite), or None.
        Stages 2-3: made from the gradients autograd left on the unit's parameters (zeros where a
        parameter got none), each let go as it is copied."""
        self.grads_done = True
        if stage == 1:
            return self.grad_full.to(reduce_dtype, copy=True) if sync else None
        bucket = torch.zeros(self.padded, dtype=reduce_dtype, device=self.full.device)
        for p, slot in self.members:
            if p.grad is not None:
                self._flat(bucket, slot).copy_(p.grad.reshape(-1))
                p.grad = None
        return bucket

    def start_backward(self) -> None:
        self._arrived = 0
        self.grads_done = False
        self.grads_seen = False

    def zero_grads(self, stage: int) -> None:
        if stage == 1 and self.grad_full is not None:  # (a hollow engine's have none yet)
            self.grad_full.zero_()
            for p, slot in self.members:
                view = self._flat(self.grad_full, slot)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view.view(slot.shape)
        else:
            for p, _ in self.members:
                p.grad = None
