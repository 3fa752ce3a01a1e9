"""Models for tests, benchmarks and examples, and the named presets (presets.py, torch-free)."""

from __future__ import annotations

from elastic_zero.models.presets import PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "MLP", "PRESETS", "build_preset", "lm_loss"]


def build_preset(name: str, seed: int = 0, **overrides):
    """A freshly initialised preset model (a torch.nn.Module); the same seed gives the same weights."""
    import torch

    from elastic_zero.models.gpt import GPT

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(sorted(PRESETS))}")
    cfg = PRESETS[name]
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    torch.manual_seed(seed)
    return GPT(cfg)


# the modules (and torch) on first use: a driver that checks model.preset needs only the presets
_HOMES = {"GPT": "gpt", "lm_loss": "gpt", "MLP": "mlp"}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"elastic_zero.models.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'elastic_zero.models' has no attribute {name!r}")
