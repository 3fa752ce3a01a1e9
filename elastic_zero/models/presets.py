"""The named model presets and the GPT's configuration: plain data, no torch, so that a job spec is
checked (model.preset) in a driver that never imports torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 4096
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    tied_head: bool = False
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


PRESETS: dict[str, GPTConfig] = {
    # 4 layers, d_model 256, 4 heads, vocab 4096, seq 128: 5,289,472 parameters (untied head)
    "gpt-small": GPTConfig(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, d_model=256),
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64),
}
