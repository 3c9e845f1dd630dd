"""Tiny models of every supported family, shared by the symmetry and conversion tests (imported as a module), and
the property that each of them is recognised by an adapter and runs."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from relational_hf.architectures import get_adapter

VOCAB = 128
# d = 32, d_ff = 64, 2 layers, 4 query heads of width 8, 2 key/value heads (GQA g = 2) unless said otherwise
LLAMA_KW = dict(vocab_size=VOCAB, intermediate_size=64, num_key_value_heads=2)
REL_KW = dict(vocab_size=VOCAB, intermediate_size=64)

#: name -> (family, config overrides) of the tiny models (tests/tiny_models.py) this file runs on
VARIANTS = {
    "llama": ("llama", dict(LLAMA_KW, tie_word_embeddings=False)),
    "llama_tied_bias": ("llama", dict(LLAMA_KW, tie_word_embeddings=True, attention_bias=True)),
    "mistral": ("mistral", dict(LLAMA_KW, sliding_window=None)),
    "qwen2": ("qwen2", dict(LLAMA_KW, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(LLAMA_KW, head_dim=8, attention_bias=True, tie_word_embeddings=False)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB)),
    "relational_free": ("relational", dict(REL_KW, num_key_value_heads=2, gauge="free")),
    "relational_free_none_vpr": (
        "relational",
        dict(
            REL_KW,
            gauge="free",
            position_encoding="none",
            value_parallel_removal=True,
            attention_bias=True,
            attention_output_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "relational_pivot": ("relational", dict(REL_KW, num_key_value_heads=2)),
    "relational_pivot_vpr": ("relational", dict(REL_KW, value_parallel_removal=True)),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised tiny model of the named kind, in eval mode, fp32."""
    family, overrides = VARIANTS[name]
    return tiny_model(family, seed=seed, **overrides).eval()


ALL = [
    "llama",
    "llama_tied_bias",
    "mistral",
    "qwen2",
    "qwen3",
    "gpt2",
    "relational_free",
    "relational_free_none_vpr",
    "relational_pivot",
    "relational_pivot_vpr",
]
LINEAR = [n for n in ALL if not n.startswith("relational_pivot")]


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.2) -> torch.nn.Module:
    """Make biases and per-layer norm gains non-trivial (random), leaving the final-norm and QK-norm gains at their
    initial ones so that every group of the family is present."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        keep = name.endswith(("norm.weight", "ln_f.weight")) and not name.endswith(("layernorm.weight",))
        if p.ndim == 1 and not keep:
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def token_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ALL)
def test_every_zoo_model_has_an_adapter_and_runs(name):
    model = build(name)
    adapter = get_adapter(model)
    assert len(adapter.layers()) == 2
    logits = model(token_ids()).logits
    assert logits.shape == (2, 12, VOCAB) and torch.isfinite(logits).all()
