"""From a JobSpec to the objects a worker trains with: model, optimizer, data."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from elastic_zero.data.source import PositionedSource, open_source
from elastic_zero.models import build_preset
from elastic_zero.spec import JobSpec
from elastic_zero.zero import SGD, AdamW, Constant, WarmupCosine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(spec: JobSpec) -> nn.Module:
    """The model with its initial weights, a function of the seed only."""
    if spec.model.preset is not None:
        return build_preset(spec.model.preset, seed=spec.train.seed, **spec.model.kwargs)
    module_name, fn_name = spec.model.factory.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model.factory: cannot load {spec.model.factory!r} ({exc})") from None
    torch.manual_seed(spec.train.seed)
    return factory(**spec.model.kwargs)


def build_optimizer(spec: JobSpec):
    o = spec.optimizer
    schedule = Constant()
    if o.schedule == "warmup_cosine":
        schedule = WarmupCosine(warmup_steps=o.warmup_steps, total_steps=max(spec.train.steps, o.warmup_steps, 1))
    if o.name == "adamw":
        return AdamW(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, schedule=schedule)
    return SGD(lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, schedule=schedule)


def build_source(spec: JobSpec, model: nn.Module) -> PositionedSource:
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        raise ValueError("model: the data pipeline needs a model with a .cfg giving vocab_size and seq_len")
    return open_source(spec.data.source, spec.data.column, spec.data.branching, cfg.vocab_size, cfg.seq_len,
                       spec.train.seed)
