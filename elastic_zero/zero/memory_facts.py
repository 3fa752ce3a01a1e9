"""The facts of a model's state that fix what a worker's engine will hold at any world size
(plan/memory.py computes it), found from the model and the job's settings before any engine exists:
the units' sizes as the engine lays them out, the compute dtype, the optimizer's vectors."""

from __future__ import annotations

import torch
from torch import nn

from elastic_zero.plan.layout import build_layout
from elastic_zero.plan.memory import ModelMemory
from elastic_zero.zero.engine import LAYOUT_ALIGN
from elastic_zero.zero.meta import has_meta_parameters
from elastic_zero.zero.units import find_units, param_specs


def model_memory(model: nn.Module, wrap, stage: int, compute_dtype: torch.dtype, optimizer) -> ModelMemory:
    layout = build_layout([spec for spec, _ in param_specs(model, find_units(model, wrap))], align=LAYOUT_ALIGN)
    return ModelMemory(tuple(u.numel for u in layout.units), stage, torch.empty(0, dtype=compute_dtype).element_size(),
                       len(optimizer.state_names))


def own_tensor_bytes(model: nn.Module) -> int:
    """What the model's own parameters and buffers hold in this process now, by their storages (none
    on the meta device; none for a joiner's, whose hollow engine left its parameters without
    storage): the engine takes them over and lets them go."""
    if has_meta_parameters(model):
        return 0
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "cpu":
            continue
        if t.layout != torch.strided:  # (a sparse buffer has no storage of its own to ask)
            total += t.nelement() * t.element_size()
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
