"""The job spec: its sections (sections.py) put together, loaded from TOML (or a dict), with
`--set section.key=value`.

Every wrong field raises SpecError naming the field and what is allowed; the CLI turns it into
exit code 2 and one line.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any

from elastic_zero.job.sections import (
    DEFAULT_PRESET, DEFAULT_STEPS, HEARTBEAT_EVERY_S, HANG_ACTIONS, KILL_ACTIONS, WATCH_SOURCES, CheckpointSpec, DataSpec,
    ElasticSpec, EvalSpec, FaultSpec, TrackingSpec, ModelSpec, OptimizerSpec, PreemptionSpec, SpecError, TrainSpec, ZeroSpec, _fail,
)

# the sections are part of this module's API: `from elastic_zero.job.spec import FaultSpec` and the like
__all__ = ["JobSpec", "spec_from_dict", "load_spec", "apply_override", "SpecError", "ModelSpec", "DataSpec",
           "EvalSpec", "TrackingSpec", "TrainSpec", "OptimizerSpec", "ZeroSpec", "ElasticSpec", "CheckpointSpec", "PreemptionSpec", "FaultSpec",
           "DEFAULT_PRESET", "DEFAULT_STEPS", "HEARTBEAT_EVERY_S", "HANG_ACTIONS", "KILL_ACTIONS", "WATCH_SOURCES"]


@dataclass(frozen=True)
class JobSpec:
    name: str = "elastic-zero"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    zero: ZeroSpec = field(default_factory=ZeroSpec)
    elastic: ElasticSpec = field(default_factory=ElasticSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    preemption: PreemptionSpec = field(default_factory=PreemptionSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    faults: tuple = ()

    def __post_init__(self) -> None:
        """From Python, a section may be given as a table (dict), the model as a callable, a
        preset name or "module:function", and the data as a path: made the dataclasses here."""
        for section, cls in _SECTIONS.items():
            value = getattr(self, section)
            if section == "model" and (callable(value) or isinstance(value, str)):
                # a name without ":" is a preset (a typo is then named as one)
                as_preset = isinstance(value, str) and ":" not in value
                value = ModelSpec(preset=value) if as_preset else ModelSpec(factory=value)
            elif section in ("data", "eval") and isinstance(value, str):
                value = cls(source=value)
            elif isinstance(value, dict):
                value = _build(cls, value, section)
            if not isinstance(value, cls):
                _fail(section, f"must be a {cls.__name__} or a table, got {type(value).__name__}")
            object.__setattr__(self, section, value)
        faults = tuple(_build(FaultSpec, f, f"faults[{i}]") if isinstance(f, dict) else f
                       for i, f in enumerate(self.faults))
        object.__setattr__(self, "faults", faults)
        if self.train.steps is None and self.train.epochs is None:
            object.__setattr__(self, "train", dataclasses.replace(self.train, steps=DEFAULT_STEPS))

    def validate(self) -> "JobSpec":
        if not self.name or any(c in self.name for c in "/\\ "):
            _fail("name", f"must be non-empty without spaces or slashes, got {self.name!r}")
        for section in _SECTIONS:
            getattr(self, section).validate()
        if self.elastic.max_workers > self.train.global_batch:
            _fail("elastic.max_workers", f"must be <= train.global_batch ({self.train.global_batch}): every "
                                         f"worker needs a sample of each step, got {self.elastic.max_workers}")
        for i, fault in enumerate(self.faults):
            fault.validate(f"faults[{i}]")
            if self.train.steps is not None and fault.at_step >= self.train.steps:
                _fail(f"faults[{i}].at_step", f"must be < train.steps ({self.train.steps}), got {fault.at_step}")
            if fault.action == "kill_in_eval" and self.eval.source is None:
                _fail(f"faults[{i}].action", "'kill_in_eval' needs an [eval] section (eval.source)")
            if fault.action == "kill_in_eval" and fault.at_step % self.eval.every:
                _fail(f"faults[{i}].at_step", f"'kill_in_eval' fires as an evaluation begins: must be a multiple of "
                                              f"eval.every ({self.eval.every}), got {fault.at_step}")
            if fault.workers is not None and not self.elastic.min_workers <= fault.workers <= self.elastic.max_workers:
                _fail(f"faults[{i}].workers", f"must lie in [{self.elastic.min_workers}, {self.elastic.max_workers}]")
        return self

    def to_dict(self) -> dict:
        """The spec as tables, one level deep: the values themselves (a factory's kwargs may hold the
        user's own objects, a config dataclass say) are passed on as they are, not taken apart."""
        out: dict = {"name": self.name, "faults": [_table(f) for f in self.faults]}
        for section in _SECTIONS:
            out[section] = _table(getattr(self, section))
        return out

    def user_functions(self) -> tuple[tuple[str, Any], ...]:
        """(field, value) of every field that names a function of the user's: a 'pkg.module:fn'
        string, a callable, or None (the default)."""
        return (("model.factory", self.model.factory), ("train.loss", self.train.loss),
                ("data.collate", self.data.collate), ("eval.loss", self.eval.loss))

    def normalized(self) -> "JobSpec":
        """The spec as TOML would give it: every field's type checked (a spec built in Python
        skips the checks a table goes through), tuples as lists."""
        return spec_from_dict(self.to_dict())

    def with_steps(self, steps: int) -> "JobSpec":
        """The job with its step count settled (from train.epochs and the dataset's size)."""
        return dataclasses.replace(self, train=dataclasses.replace(self.train, steps=steps, epochs=None)).validate()


def _table(section) -> dict:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


_SECTIONS = {
    "model": ModelSpec, "data": DataSpec, "eval": EvalSpec, "train": TrainSpec, "optimizer": OptimizerSpec,
    "zero": ZeroSpec, "elastic": ElasticSpec, "checkpoint": CheckpointSpec, "preemption": PreemptionSpec,
    "tracking": TrackingSpec,
}


def _typed(where: str, value: Any, annotation) -> Any:
    hint = annotation
    optional = False
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if any(typing.get_origin(a) is not None and typing.get_origin(a).__name__ == "Callable" for a in args):
            if value is None or callable(value) or isinstance(value, str):
                return value  # a Ref: its form is checked by validate()
            _fail(where, f"must be 'package.module:function' or a callable, got {value!r}")
        if set(args) == {int, str}:  # a number or a word (elastic.replicate_every: "auto"): validate() tells which
            if value is None and optional or isinstance(value, str) or isinstance(value, int) and not isinstance(value, bool):
                return value
            _fail(where, f"must be an integer or a string, got {value!r}")
        hint = args[0]
    if value is None:
        if optional:
            return None
        _fail(where, "must not be empty")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool) or hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        _fail(where, f"must be {'true or false' if hint is bool else 'an integer'}, got {value!r}")
    if hint is list and isinstance(value, tuple):
        value = list(value)
    if hint in (float, str, dict, list) and not isinstance(value, hint):
        kind = {float: "a number", str: "a string", dict: "a table", list: "a list"}[hint]
        _fail(where, f"must be {kind}, got {value!r}")
    return value


def _build(cls, data: dict, where: str, **extra):
    if not isinstance(data, dict):
        _fail(where, f"must be a table, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            _fail(f"{where}.{key}", f"unknown field; allowed: {', '.join(fields)}")
        kwargs[key] = _typed(f"{where}.{key}", value, hints[key])
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and n not in kwargs]
    if missing:
        _fail(f"{where}.{missing[0]}", "is required")
    return cls(**kwargs, **extra)


def spec_from_dict(data: dict) -> JobSpec:
    data = dict(data)
    unknown = [k for k in data if k not in (*_SECTIONS, "faults", "name")]
    if unknown:
        _fail(unknown[0], f"unknown section; allowed: name, {', '.join(_SECTIONS)}, faults")
    kwargs: dict[str, Any] = {}
    if "name" in data:
        kwargs["name"] = _typed("name", data["name"], str)
    for section, cls in _SECTIONS.items():
        if section in data:
            kwargs[section] = _build(cls, data[section], section)
    faults = data.get("faults", [])
    if not isinstance(faults, (list, tuple)):
        _fail("faults", "must be an array of tables ([[faults]])")
    kwargs["faults"] = tuple(_build(FaultSpec, f, f"faults[{i}]") for i, f in enumerate(faults))
    return JobSpec(**kwargs).validate()


_EITHER_MODEL = {"preset": "factory", "factory": "preset"}


def apply_override(data: dict, assignment: str) -> None:
    """Apply `section.key=value` (or `name=...`, `faults=[...]`) to a spec dict; the value is read
    as TOML, else taken as a plain string."""
    path, _, raw = assignment.partition("=")
    path = path.strip()
    if not _ or not path or ("." not in path and path not in ("name", "faults")):
        _fail("--set", f"expected section.key=value, got {assignment!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if "." not in path:
        data[path] = value
        return
    section, key = path.split(".", 1)
    if section not in _SECTIONS:
        _fail(f"--set {path}", f"unknown section; allowed: {', '.join(_SECTIONS)}")
    table = data.setdefault(section, {})
    if section == "model" and key in _EITHER_MODEL:  # the model set last wins over the spec's
        table.pop(_EITHER_MODEL[key], None)
    table[key] = value


def load_spec(path: str | None, overrides: list[str] = ()) -> JobSpec:
    data: dict = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise SpecError(f"{path}: no such spec file") from None
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"{path}: not valid TOML ({exc})") from None
    for assignment in overrides:
        apply_override(data, assignment)
    return spec_from_dict(data)
