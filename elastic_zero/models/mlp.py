"""A plain MLP whose layers sit in a ModuleList, so each layer is one ZeRO unit."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, sizes: Sequence[int] = (16, 32, 32, 8), bias: bool = True) -> None:
        super().__init__()
        if len(sizes) < 2 or any(s < 1 for s in sizes):
            raise ValueError(f"MLP sizes must be two or more positive widths, got {list(sizes)}")
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return x
