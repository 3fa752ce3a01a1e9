"""Models built on the meta device: parameters without memory, given values one unit at a time.

A factory may build its model's parameters on the meta device, so that no process ever holds the
whole model: `meta_init()` below does it for the parameters only (as accelerate's
init_empty_weights does). Buffers must stay real: one computed in __init__ (a rotary embedding's
frequencies, a causal mask) would have no value after the fact, so a model with meta buffers (a
`torch.device("meta")` context puts them there too) is refused with its first buffer's name.

The engine (engine.py) then takes each unit's values in turn from a UnitInitializer: from the
weights to start from (`init_from`), or from the model's own initialization, run on a copy of the
meta model in which only that unit's parameters are real (a meta copy costs no memory): Hugging
Face's `_init_weights` over every module, else each owner module's `reset_parameters()`. Both at
once where the weights lack some parameters on purpose (`own_init`: `model.new_params`, an adapter
or a new head): those take the model's own initialization. The values go straight into the unit's
flat buffer, so the peak while starting is a few units, not the model.
"""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Callable, Collection, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


@contextlib.contextmanager
def meta_init():
    """Within it, modules create their parameters on the meta device (buffers stay real), and the
    initializers that would fill a meta tensor are skipped (_SkipMetaFills)."""
    register = nn.Module.register_parameter
    # one parameter registered in several modules (shared) stays one on meta; the original is kept
    # so that its id is not reused for another while building
    on_meta: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            if id(param) not in on_meta:
                on_meta[id(param)] = (param, nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))
            module._parameters[name] = on_meta[id(param)][1]

    nn.Module.register_parameter = register_on_meta
    try:
        with _SkipMetaFills():
            yield
    finally:
        nn.Module.register_parameter = register


# what fills a tensor with values (torch.nn.init's and the tensor's own in-place fills): on a meta
# tensor it sets nothing, and torch runs some (normal_, uniform_) through its reference
# implementations, whose first use imports torch's compiler: 1.1 s of a worker's start here
_FILLS = frozenset({
    "normal_", "uniform_", "trunc_normal_", "zero_", "zeros_", "ones_", "fill_", "constant_", "copy_",
    "random_", "exponential_", "log_normal_", "cauchy_", "geometric_", "bernoulli_", "erfinv_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_", "eye_", "dirac_",
})


class _SkipMetaFills(TorchFunctionMode):
    """A fill (_FILLS) whose tensor is on the meta device returns it as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _FILLS:
            # torch.nn.init's functions are called with the tensor as a keyword
            target = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if target is not None and target.device.type == "meta":
                return target
        return func(*args, **kwargs)


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def placed(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` on `device`: all of it, or for a meta model its buffers (its parameters stay on meta
    until the engine gives them values)."""
    if not has_meta_parameters(model):
        return model.to(device)
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device.type != "meta":
                module._buffers[name] = b.to(device)
    return model


def check_buffers(model: nn.Module) -> None:
    """Raise ValueError naming the first buffer on the meta device."""
    for name, b in model.named_buffers():
        if b.device.type == "meta":
            raise ValueError(f"model: buffer {name!r} is on the meta device, so its value is lost; build only the "
                             f"parameters there (with elastic_zero.meta_init(), not a torch.device('meta') context)")


def replace_parameters(model: nn.Module, make: Callable[[nn.Parameter], nn.Parameter]) -> dict[int, nn.Parameter]:
    """Swap every meta parameter for make(it) in every module that holds it (a parameter tied between
    modules stays one parameter); returns {id of the old: the new}."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in new:
                    new[id(p)] = make(p)
                module._parameters[name] = new[id(p)]
    return new


def storage_less(device: torch.device) -> Callable[[nn.Parameter], nn.Parameter]:
    """A real parameter of the same shape, dtype and requires_grad whose storage holds no bytes: it
    has a place for the engine to bind it to its unit's buffer, and never costs memory itself."""
    def make(p: nn.Parameter) -> nn.Parameter:
        t = torch.empty(p.shape, dtype=p.dtype, device=device)
        t.untyped_storage().resize_(0)
        return nn.Parameter(t, requires_grad=p.requires_grad)

    return make


class UnitInitializer:
    """The initial values of a meta model's parameters, a unit at a time."""

    def __init__(self, model: nn.Module, device: torch.device,
                 init_values: Mapping[str, torch.Tensor] | None = None, own_init: Collection[str] = ()) -> None:
        check_buffers(model)
        own_init = frozenset(own_init) if init_values is not None else frozenset()
        params = list(model.named_parameters())
        frozen = [name for name, p in params if p.device.type == "meta" and not p.requires_grad
                  and (init_values is None or name in own_init)]
        if frozen:  # no shard holds them: the workers could not agree on values
            raise ValueError(f"model: parameter {frozen[0]!r} is frozen (requires_grad=False) and on the meta device, "
                             f"so nothing would give every worker the same value for it: start from model.init_from"
                             + (" with it in the weights (not a model.new_params one)" if init_values is not None else ""))
        if init_values is not None:  # what the engine will ask for: its units' parameters, and frozen ones on meta
            asked = [name for name, p in params if p.requires_grad or (p.device.type == "meta" and p.numel())]
            lacking = [name for name in asked if name not in own_init and name not in init_values]
            if lacking:
                raise ValueError(f"model: parameter {lacking[0]!r} is not in the weights to start from")
        self.device = device
        self.init_values = init_values
        self.own_init = own_init
        # a parameter built for real in a meta model has its own values already (until its unit binds it)
        self.built = {name: p for name, p in params if p.device.type != "meta"}
        # the template stays on meta; the model's own parameters become storage-less real ones
        self.template = copy.deepcopy(model) if init_values is None or own_init else None
        replace_parameters(model, storage_less(device))

    def takes_own_init(self, name: str) -> bool:
        """Whether parameter `name` takes the model's own initialization (not the given weights')."""
        return self.init_values is None or name in self.own_init

    def values(self, names: list[str]) -> dict[str, torch.Tensor]:
        """{name: fp32 values} of the parameters `names` (one unit's)."""
        own = [n for n in names if self.takes_own_init(n)]
        given = {n: self.init_values[n].detach().to(self.device, torch.float32) for n in names if n not in own}
        given.update({n: self.built[n].detach().to(self.device, torch.float32) for n in own if n in self.built})
        made = [n for n in own if n not in self.built]
        return {**given, **self._own_values(made)} if made else given

    def _own_values(self, names: list[str]) -> dict[str, torch.Tensor]:
        """{name: fp32 values} of `names` by the model's own initialization."""
        model = copy.deepcopy(self.template)
        params = dict(model.named_parameters(remove_duplicate=False))
        wanted = {id(params[n]) for n in names}
        # NaN first: a parameter the initialization never touches is found, not trained from garbage
        made = replace_parameters(model, lambda p: nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype,
                                                                           device=self.device),
                                                                requires_grad=p.requires_grad)
                                  if id(p) in wanted else p)
        with torch.no_grad():
            _initialize(model, {id(p) for p in made.values() if p.device.type != "meta"})
        values = {n: made[id(params[n])].detach().float() for n in names}
        for n, v in values.items():
            if v.isnan().any():
                raise ValueError(f"model: the model's own initialization left parameter {n!r} unset on the meta "
                                 f"device; initialize it in _init_weights or reset_parameters(), or start from "
                                 f"model.init_from")
        return values

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the weights to start from's parameter `name`, flattened, in fp32: a
        range read where they are a file's (their `read_flat`), else a slice."""
        reader = getattr(self.init_values, "read_flat", None)
        if reader is not None:
            return reader(name, lo, hi).to(self.device)
        return self.init_values[name].detach().reshape(-1)[lo:hi].to(self.device, torch.float32)

    def fingerprint(self) -> str:
        """What every rank reading the given weights must see alike: their files' headers where
        they have them, else each tensor's name and shape; and the parameters they lack on purpose
        (which units are broadcast rather than read)."""
        own = getattr(self.init_values, "fingerprint", None)
        given = own() if own is not None else \
            json.dumps({name: list(t.shape) for name, t in self.init_values.items()}, sort_keys=True)
        return given + (json.dumps(sorted(self.own_init)) if self.own_init else "")

    def fill_frozen(self, model: nn.Module) -> None:
        """Values for the parameters the engine does not train (requires_grad False), from the
        weights to start from: they are not in its units, so each gets a tensor of its own."""
        for name, p in model.named_parameters():
            if not p.requires_grad and p.numel() and p.untyped_storage().nbytes() == 0:
                p.data = self.init_values[name].detach().to(self.device, p.dtype)


def _initialize(model: nn.Module, real: set[int]) -> None:
    """Run the model's own initialization; only the parameters in `real` hold memory (on the others,
    on meta, every operation is a no-op). A Hugging Face model's `_init_weights` first; then a module
    added to it (its class neither torch's nor transformers': an adapter) that has a reset_parameters()
    of its own is reset by it, the innermost first (HF's scheme does not know its start: a LoRA B is
    zero, not normal); then a module that still holds unset parameters is reset as any other
    model's are."""
    init_weights = getattr(model, "_init_weights", None)
    hugging_face = callable(init_weights) and hasattr(model, "config")
    if hugging_face:
        model.apply(init_weights)
        added = [m for m in model.modules() if m is not model and not type(m).__module__.startswith(_LIBRARIES)
                 and callable(getattr(m, "reset_parameters", None)) and any(id(p) in real for p in m.parameters())]
        for module in reversed(added):  # (modules() lists a parent before its children)
            module.reset_parameters()
    for name, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None and id(p) in real]
        if not own or (hugging_face and not any(p.isnan().any() for p in own)):
            continue
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if not callable(reset):  # (nn.MultiheadAttention has only the latter)
            raise ValueError(f"model: module {name or type(module).__name__!r} ({type(module).__name__}) has parameters "
                             f"but no reset_parameters(), so they cannot be initialized from the meta device; give it "
                             f"one, or start from model.init_from")
        reset()


_LIBRARIES = ("torch.", "transformers.")  # the modules of a Hugging Face model its _init_weights knows
