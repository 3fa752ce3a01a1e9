"""A small Llama from Hugging Face transformers, built from a config in code (no download), and a
loss that also reports next-token accuracy."""

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


def build(vocab_size: int = 256, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          seq_len: int = 64) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=seq_len, attn_implementation="eager")
    return LlamaForCausalLM(config)


def loss_with_accuracy(model, batch):
    """Mean next-token cross entropy over the micro batch, and the share of targets predicted right
    (a metric: averaged over the global batch like the loss, reported in the events and summary)."""
    logits = model(input_ids=batch["input_ids"]).logits.float()
    targets = batch["targets"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    with torch.no_grad():
        real = targets != -100  # padding, when the data has ragged samples
        accuracy = (logits.argmax(-1) == targets)[real].float().mean()
    return {"loss": loss, "accuracy": accuracy}
