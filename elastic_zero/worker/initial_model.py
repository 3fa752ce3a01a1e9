"""A worker's model as the job begins: built from the spec (its initial weights a function of the
seed), with `model.init_from`'s weights where given, and what the engine and export need of it. A
worker builds it once at its start, and again when the job restarts from its initial weights
(nothing in memory or in a checkpoint held a trained step).

A worker that joins a running job (a replacement, a scale-up) takes its shard from a handover or a
checkpoint, never from its own initial weights, so it builds a skeleton: the parameters on the meta
device (`meta_init`), their initialization and `init_from`'s values never computed or read (GPT-2
355M's shape: 3.1 s of one core's initialization, then its copy to the device). A model whose
parameters are not all trained (a frozen one takes its values from the build or `init_from`, and
no shard holds it), whose factory fails on the meta device, that leaves a buffer or another tensor
there, or that draws from torch's generator beside its parameters' initializations (a random
buffer: the skeleton's initializations draw nothing, so its draws would differ), is built for real
instead. The skeleton never gives values: the worker builds the model for real before an
engine would take its starting values from it (worker_model.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from elastic_zero.checkpoint import load_initial_weights, load_into
from elastic_zero.checkpoint.export import model_extra
from elastic_zero.checkpoint.interop import check_fits, new_parameter_names
from elastic_zero.job.build import build_model, unit_classes
from elastic_zero.job.spec import JobSpec
from elastic_zero.worker.faults import named
from elastic_zero.zero.meta import has_meta_parameters, meta_init, placed


@dataclass
class InitialModel:
    model: nn.Module
    wrap: list  # the module classes model.wrap names: the engine's units
    init_values: dict | None  # a meta model's weights to start from (init_from), until its engine takes them
    extra: dict  # what export needs beyond the layout
    own_init: frozenset = frozenset()  # a meta model's parameters init_values lacks (model.new_params): its own init
    skeleton: bool = False  # parameters built on meta for a joiner: no values to start from (see above)


def initial_model(spec: JobSpec, device: torch.device, skeleton: bool = False) -> InitialModel:
    """Raises with the field to blame in its message (named()): a worker tells it as its start error.
    `skeleton`: a joiner's, where the model allows (see above)."""
    model = _skeleton(spec) if skeleton else None
    skeleton = model is not None
    model = named("model", lambda: placed(model if skeleton else build_model(spec), device))
    wrap = unit_classes(spec, model)
    init_values, own_init = None, frozenset()
    if spec.model.init_from:  # every worker: the same buffers everywhere, a bad file a start error
        weights = named("model.init_from", lambda: load_initial_weights(spec.model.init_from))
        new_params = spec.model.new_params
        if has_meta_parameters(model):  # the engine takes the parameters unit by unit
            named("model.init_from", lambda: check_fits(model, weights, new_params=new_params))
            buffers = {name for name, _ in model.named_buffers()}
            model.load_state_dict({k: weights[k] for k in buffers if k in weights}, strict=False)
            init_values = weights
            # the new ones the weights lack take the model's own initialization, unit by unit
            own_init = frozenset(n for n in new_parameter_names((n for n, _ in model.named_parameters()), new_params)
                                 if n not in weights)
        else:
            named("model.init_from", lambda: load_into(model, weights, new_params=new_params))
    return InitialModel(model, wrap, init_values, model_extra(model), own_init, skeleton)


def _skeleton(spec: JobSpec) -> nn.Module | None:
    """The model with its parameters on the meta device, or None where that would lose a value
    (see above). A factory that builds on meta itself gives its own model. A refused skeleton has
    run the factory once for nothing: cheap for a model built from its config, a second read for
    one whose factory loads its weights itself (model.init_from reads them once, and not at all
    for a joiner)."""
    try:
        with meta_init():
            model = build_model(spec)
    except Exception:  # noqa: BLE001 - its own build, next, names the error if there is one
        return None
    if any(p.device.type != "meta" or not p.requires_grad for p in model.parameters()) \
            or any(b.device.type == "meta" for b in model.buffers()) or _meta_attribute(model):
        return None
    # the build seeds torch's generator (build_model); the real one's initializations draw from it,
    # the skeleton's do not, so anything else drawn from it (a random buffer) would differ
    if not torch.equal(torch.random.get_rng_state(), torch.Generator().manual_seed(spec.train.seed).get_state()):
        return None
    return model


def _meta_attribute(model: nn.Module) -> bool:
    """Whether a module keeps a tensor on the meta device outside its parameters (a value computed
    from them as it was built: a real build's would be real)."""
    for module in model.modules():
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in values):
                return True
    return False
