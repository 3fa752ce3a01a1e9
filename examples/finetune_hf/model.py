"""The fine-tune example's models: a Hugging Face Llama rebuilt from a model directory's config (its
weights come from `model.init_from`), the same with LoRA adapters, and the merge of trained adapters
back into plain Llama weights for `from_pretrained`.

LoRA (Hu et al., 2021): each targeted linear layer keeps its pretrained weight W, frozen, and learns
a low-rank update B @ A (A: rank x in, B: out x rank, B zero at the start so the model begins as the
pretrained one); its output is x W^T + (alpha / rank) x A^T B^T. W keeps its name (`...q_proj.weight`),
so the pretrained directory loads into it as it is; the adapters are `...q_proj.lora_A` and
`...q_proj.lora_B`, which the directory does not hold: the job names them in `model.new_params`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention projections, as the LoRA paper does
LORA_PARAMS = ["*.lora_A", "*.lora_B"]  # model.new_params of a LoRA job


def llama_config(hidden_size: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 seq_len: int = 128) -> LlamaConfig:
    """A small Llama over bytes (vocabulary 256): the stand-in for a downloaded checkpoint's config."""
    return LlamaConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=seq_len, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                       attn_implementation="eager")


def from_directory(path: str) -> LlamaForCausalLM:
    """The architecture of the model directory `path` (its config.json), with fresh weights: the job's
    `model.init_from` then loads the directory's own."""
    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "eager"  # the same maths on every worker and in the oracle
    return LlamaForCausalLM(config)


class LoRALinear(nn.Module):
    """A frozen nn.Linear's weight (and bias) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(base.weight.detach(), requires_grad=False)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach(), requires_grad=False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, rank))
        self.reset_parameters()
        self.scaling = alpha / rank

    def reset_parameters(self) -> None:
        """The adapters' start (a model built on the meta device runs it too, unit by unit): A as
        nn.Linear's own weight (and PEFT) start, B zero so the model begins as the pretrained one."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def with_lora(path: str, rank: int = 8, alpha: float = 16.0, targets: tuple | list = LORA_TARGETS,
              on_meta: bool = False) -> LlamaForCausalLM:
    """from_directory(path) with every parameter frozen but the LoRA adapters of the `targets`.
    `on_meta`: its parameters built on the meta device (a model too large for one process to build):
    the engine gives the pretrained ones init_from's values and the adapters their reset_parameters()."""
    if on_meta:
        from elastic_zero import meta_init

        with meta_init():
            return with_lora(path, rank, alpha, targets)
    model = from_directory(path)
    for p in model.parameters():
        p.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
    return model


def merge_lora(state: dict[str, torch.Tensor], rank: int = 8, alpha: float = 16.0) -> dict[str, torch.Tensor]:
    """Plain Llama weights from a LoRA model's: W + (alpha / rank) B @ A for every adapted layer, the
    adapters dropped. Give it the rank and alpha the job trained with."""
    merged = {k: v for k, v in state.items() if not k.endswith((".lora_A", ".lora_B"))}
    for name in state:
        if name.endswith(".lora_A"):
            layer = name[: -len(".lora_A")]
            a, b = state[name].float(), state[f"{layer}.lora_B"].float()
            if a.shape[0] != rank:
                raise ValueError(f"{name}: rank {a.shape[0]}, but merge_lora was given rank {rank}")
            merged[f"{layer}.weight"] = state[f"{layer}.weight"].float() + (alpha / rank) * (b @ a)
    return merged
