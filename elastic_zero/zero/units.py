"""Which parameters travel together: the wrapped units of a model.

A unit is gathered (stage 3) and reduced (stages 2 and 3) as one flat buffer. By default every
child of a ModuleList is a unit (the blocks of a transformer); `wrap` names module classes instead.
Parameters outside every unit, and parameters shared between units, belong to the root unit "".
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from elastic_zero.plan.layout import ParamSpec

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


def find_units(model: nn.Module, wrap: type | Sequence[type] | None = None) -> list[tuple[str, nn.Module]]:
    """The outermost modules that form units, as (qualified name, module), in registration order."""
    wrap_types = tuple(wrap) if isinstance(wrap, (list, tuple)) else ((wrap,) if wrap else ())
    units: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}{name}"
            is_unit = isinstance(child, wrap_types) if wrap_types else isinstance(module, nn.ModuleList)
            if is_unit:
                units.append((qual, child))
            else:
                visit(qual + ".", child)

    visit("", model)
    return units


def param_specs(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[ParamSpec, nn.Parameter]]:
    """One spec per distinct trainable parameter, in named_parameters order, with its unit."""
    unit_names = [name for name, _ in units]
    homes: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        homes.setdefault(id(p), set()).add(_unit_of(name, unit_names))
    specs = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dtype not in _DTYPE_NAMES:
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; the engine trains floating point only")
        where = homes[id(p)]
        unit = next(iter(where)) if len(where) == 1 else ""  # shared across units: keep it at the root
        specs.append((ParamSpec(name, tuple(p.shape), _DTYPE_NAMES[p.dtype], unit), p))
    if not specs:
        raise ValueError(f"the model ({type(model).__name__}) has no trainable parameters")
    return specs


def _unit_of(param_name: str, unit_names: list[str]) -> str:
    for unit in unit_names:
        if param_name.startswith(unit + "."):
            return unit
    return ""
