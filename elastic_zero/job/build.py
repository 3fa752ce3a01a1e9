"""From a JobSpec to the objects a worker trains with: model, units, optimizer, loss, data."""

from __future__ import annotations

import torch
from torch import nn

from elastic_zero.losses import next_token_loss
from elastic_zero.models import build_preset
from elastic_zero.job.sealed import opened
from elastic_zero.job.spec import DEFAULT_PRESET, JobSpec
from elastic_zero.job.user_code import UserCodeError, resolve
from elastic_zero.zero import SGD, AdamW, Constant, WarmupCosine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(spec: JobSpec) -> nn.Module:
    """The model with its initial weights, a function of the seed only (init_from is loaded by the
    worker that builds it)."""
    m = spec.model
    kwargs = opened("model.kwargs", m.kwargs)
    if m.factory is None:
        return build_preset(m.preset or DEFAULT_PRESET, seed=spec.train.seed, **kwargs)
    factory = resolve("model.factory", m.factory)
    torch.manual_seed(spec.train.seed)
    try:
        model = factory(**kwargs)
    except Exception as exc:
        raise UserCodeError(f"model.factory: raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"model.factory: must return a torch.nn.Module, got {type(model).__name__}")
    return model


def unit_classes(spec: JobSpec, model: nn.Module) -> list[type]:
    """The module classes `model.wrap` names, found in the model (a name it lacks is an error)."""
    by_name = {type(mod).__name__: type(mod) for mod in model.modules()}
    out = []
    for name in spec.model.wrap:
        if name not in by_name:
            have = sorted(n for n in by_name if n not in ("ModuleList", "ModuleDict", "Sequential"))
            raise UserCodeError(f"model.wrap: the model has no module of class {name!r} (it has: {', '.join(have[:12])})")
        out.append(by_name[name])
    return out


def model_limits(model: nn.Module) -> tuple[int | None, int | None]:
    """(vocabulary size, longest sequence) where the model says: our presets' .cfg, a Hugging Face .config."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    seq = next((getattr(cfg, k) for k in ("seq_len", "max_position_embeddings", "n_positions")
                if isinstance(getattr(cfg, k, None), int)), None)
    return (vocab if isinstance(vocab, int) else None), seq


def build_optimizer(spec: JobSpec):
    o = spec.optimizer
    schedule = Constant()
    if o.schedule == "warmup_cosine":
        schedule = WarmupCosine(warmup_steps=o.warmup_steps, total_steps=max(spec.train.steps, o.warmup_steps, 1))
    if o.name == "adamw":
        return AdamW(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, schedule=schedule)
    return SGD(lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, schedule=schedule)


def build_loss(spec: JobSpec):
    return next_token_loss if spec.train.loss is None else resolve("train.loss", spec.train.loss)


def build_source(spec: JobSpec, model: nn.Module, evaluation: bool = False):
    """The training data, or (`evaluation`) the eval data: eval.source read with data's column,
    collate and lengths."""
    import dataclasses

    from elastic_zero.data.source import open_source

    vocab, seq = model_limits(model)
    collate = resolve("data.collate", spec.data.collate) if spec.data.collate is not None else None
    if not evaluation:
        return open_source(spec.data, spec.train.seed, vocab, seq, collate)
    try:
        return open_source(dataclasses.replace(spec.data, source=spec.eval.source), spec.train.seed, vocab, seq,
                           collate, held_out=True)
    except ValueError as exc:  # the data section's reader names its own field
        raise ValueError(str(exc).replace("data.source:", "eval.source:", 1)) from None


def build_eval_loss(spec: JobSpec):
    return build_loss(spec) if spec.eval.loss is None else resolve("eval.loss", spec.eval.loss)
