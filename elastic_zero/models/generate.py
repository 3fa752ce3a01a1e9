"""Text from a byte-level language model: one sampled byte at a time, each from the logits of the
last `context` bytes (the model's window). What `elastic-zero demo` shows its GPT learned."""

from __future__ import annotations

import torch


@torch.no_grad()
def generate_bytes(model: torch.nn.Module, prompt: bytes, new: int, context: int,
                   temperature: float = 0.8, seed: int = 0) -> bytes:
    """`prompt` followed by `new` bytes the model samples, each from softmax(logits / temperature)
    over the 256 byte values (temperature 0: the most likely byte). `model(ids)` gives logits of
    shape (1, time, >= 256) for ids of shape (1, time <= context)."""
    if not prompt:
        raise ValueError("prompt: at least one byte")
    if new < 0 or context < 1 or temperature < 0:
        raise ValueError(f"new >= 0, context >= 1 and temperature >= 0, got {new}, {context}, {temperature}")
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    out = list(prompt)
    try:
        for _ in range(new):
            ids = torch.tensor([out[-context:]], dtype=torch.long)
            logits = model(ids)[0, -1, :256].float()
            if temperature == 0:
                out.append(int(logits.argmax()))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                out.append(int(torch.multinomial(probs, 1, generator=generator)))
    finally:
        model.train(was_training)
    return bytes(out)
