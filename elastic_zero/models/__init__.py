"""Models for tests, benchmarks and examples, and the named presets."""

from __future__ import annotations

import torch
from torch import nn

from elastic_zero.models.gpt import GPT, GPTConfig, lm_loss
from elastic_zero.models.mlp import MLP

PRESETS: dict[str, GPTConfig] = {
    # 4 layers, d_model 256, 4 heads, vocab 4096, seq 128: 5,289,472 parameters (untied head)
    "gpt-small": GPTConfig(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, d_model=256),
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64),
}


def build_preset(name: str, seed: int = 0, **overrides) -> nn.Module:
    """A freshly initialised preset model; the same seed gives the same weights."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(sorted(PRESETS))}")
    cfg = PRESETS[name]
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    torch.manual_seed(seed)
    return GPT(cfg)


__all__ = ["GPT", "GPTConfig", "MLP", "PRESETS", "build_preset", "lm_loss"]
