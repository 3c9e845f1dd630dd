"""Tiny models and a learnable toy dataset shared by the training, PEFT and dynamics tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM

VOCAB = 48
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


def tiny_relational(gauge: str = "free", seed: int | None = None, **overrides) -> RelationalForCausalLM:
    """d = 32, 2 layers, 4 heads, vocabulary 48; `seed` re-seeds torch first (else the test's seed applies)."""
    if seed is not None:
        torch.manual_seed(seed)
    return RelationalForCausalLM(RelationalConfig(gauge=gauge, **(TINY | overrides)))


def tiny_llama() -> LlamaForCausalLM:
    """Transformers' Llama at the tiny size, GQA with 2 key/value heads."""
    return LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2))


def periodic_data(n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """Learnable sequences: a period-7 cycle at random offsets (token ids 3..9)."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(n):
        ids = (torch.arange(length) + torch.randint(0, 7, (1,), generator=g)) % 7 + 3
        rows.append({"input_ids": ids, "labels": ids})
    return rows
