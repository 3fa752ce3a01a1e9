"""The flat layout of a model's parameters: where each parameter lives in one flat vector.

Parameters are grouped into units (a transformer block, or the root for what is left); each
unit is a contiguous segment of the flat vector so that it can be gathered or reduced as one.
Offsets are aligned so that every parameter starts on an `align`-element boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    unit: str  # the unit's name ("" for the root unit)


@dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int
    unit: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class UnitSpan:
    name: str
    offset: int
    numel: int  # including the alignment padding after its last parameter

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    units: tuple[UnitSpan, ...]
    align: int

    @property
    def total(self) -> int:
        return self.units[-1].end if self.units else 0

    @property
    def param_numel(self) -> int:
        """Elements that belong to parameters (the total less padding)."""
        return sum(s.numel for s in self.slots)

    def slot(self, name: str) -> ParamSlot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"no parameter named {name!r} in the layout")

    def unit_slots(self, unit: int) -> tuple[ParamSlot, ...]:
        return tuple(s for s in self.slots if s.unit == unit)

    def to_dict(self) -> dict:
        return {
            "align": self.align,
            "units": [{"name": u.name, "offset": u.offset, "numel": u.numel} for u in self.units],
            "slots": [
                {
                    "name": s.name,
                    "shape": list(s.shape),
                    "dtype": s.dtype,
                    "offset": s.offset,
                    "numel": s.numel,
                    "unit": s.unit,
                }
                for s in self.slots
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "FlatLayout":
        try:
            units = tuple(UnitSpan(str(u["name"]), int(u["offset"]), int(u["numel"])) for u in data["units"])
            slots = tuple(
                ParamSlot(
                    str(s["name"]),
                    tuple(int(d) for d in s["shape"]),
                    str(s["dtype"]),
                    int(s["offset"]),
                    int(s["numel"]),
                    int(s["unit"]),
                )
                for s in data["slots"]
            )
            layout = cls(slots=slots, units=units, align=int(data["align"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"layout dict is malformed: {exc!r}") from None
        layout.validate()
        return layout

    def validate(self) -> None:
        """Raise ValueError unless units tile [0, total) and slots sit inside their units without overlap."""
        if self.align < 1:
            raise ValueError(f"layout align must be >= 1, got {self.align}")
        cursor = 0
        for i, u in enumerate(self.units):
            if u.offset != cursor or u.numel < 0:
                raise ValueError(f"layout unit {i} ({u.name!r}) does not start where unit {i - 1} ends")
            cursor = u.end
        last_end = 0
        for s in self.slots:
            if s.numel != math.prod(s.shape):
                raise ValueError(f"layout slot {s.name!r}: numel {s.numel} != prod(shape {s.shape})")
            if not 0 <= s.unit < len(self.units):
                raise ValueError(f"layout slot {s.name!r}: unit {s.unit} out of range")
            unit = self.units[s.unit]
            if s.offset < max(last_end, unit.offset) or s.end > unit.end or s.offset % self.align:
                raise ValueError(f"layout slot {s.name!r} overlaps, leaves its unit or is misaligned")
            last_end = s.end

    def describe_mismatch(self, other: "FlatLayout", limit: int = 3) -> str:
        """A one-line account of how `other` differs from this layout ('' when they are equal)."""
        if self == other:
            return ""
        mine = {s.name: s.shape for s in self.slots}
        theirs = {s.name: s.shape for s in other.slots}
        diffs = []
        for name in list(mine) + [n for n in theirs if n not in mine]:
            a, b = mine.get(name), theirs.get(name)
            if a != b:
                diffs.append(f"{name}: {_fmt(a)} vs {_fmt(b)}")
        if not diffs:
            order = [s.name for s in self.slots] != [s.name for s in other.slots]
            what = "parameter order" if order else "units, offsets or alignment"
            return f"same parameters and shapes but different {what}"
        more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
        return "; ".join(diffs[:limit]) + more


def _fmt(shape: tuple[int, ...] | None) -> str:
    return "missing" if shape is None else "(" + ",".join(str(d) for d in shape) + ")"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_layout(params: Sequence[ParamSpec], align: int = 1) -> FlatLayout:
    """Lay parameters out unit by unit, in the order units first appear, each aligned to `align`."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if not params:
        raise ValueError("the model has no parameters to lay out")
    seen: set[str] = set()
    unit_order: list[str] = []
    by_unit: dict[str, list[ParamSpec]] = {}
    for p in params:
        if p.name in seen:
            raise ValueError(f"parameter name {p.name!r} appears twice")
        if p.dtype not in _DTYPES:
            raise ValueError(f"parameter {p.name!r} has dtype {p.dtype!r}; allowed: {', '.join(_DTYPES)}")
        if any(d < 0 for d in p.shape):
            raise ValueError(f"parameter {p.name!r} has a negative dimension in {p.shape}")
        seen.add(p.name)
        if p.unit not in by_unit:
            unit_order.append(p.unit)
            by_unit[p.unit] = []
        by_unit[p.unit].append(p)
    slots: list[ParamSlot] = []
    units: list[UnitSpan] = []
    cursor = 0
    for ui, uname in enumerate(unit_order):
        start = cursor
        for p in by_unit[uname]:
            numel = math.prod(p.shape)
            slots.append(ParamSlot(p.name, tuple(p.shape), p.dtype, cursor, numel, ui))
            cursor = _round_up(cursor + numel, align)
        units.append(UnitSpan(uname, start, cursor - start))
    layout = FlatLayout(slots=tuple(slots), units=tuple(units), align=align)
    layout.validate()
    return layout
