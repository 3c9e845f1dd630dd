"""Tiny models of every supported family, shared by the symmetry and conversion tests (imported as a module), and
the property that each of them is recognised by an adapter and runs."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.architectures import get_adapter

VOCAB = 128
# d = 32, d_ff = 64, 2 layers, 4 query heads of width 8, 2 key/value heads (GQA g = 2) unless said otherwise
LLAMA_KW = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised tiny model of the named kind, in eval mode, fp32."""
    torch.manual_seed(seed)
    rel = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    models = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_KW, tie_word_embeddings=False)),
        "llama_tied_bias": lambda: LlamaForCausalLM(
            LlamaConfig(**LLAMA_KW, tie_word_embeddings=True, attention_bias=True)
        ),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**LLAMA_KW, sliding_window=None)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA_KW, tie_word_embeddings=True)),
        "qwen3": lambda: Qwen3ForCausalLM(
            Qwen3Config(**LLAMA_KW, head_dim=8, attention_bias=True, tie_word_embeddings=False)
        ),
        "gpt2": lambda: GPT2LMHeadModel(
            GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
        ),
        "relational_free": lambda: RelationalForCausalLM(RelationalConfig(**rel, num_key_value_heads=2, gauge="free")),
        "relational_free_none_vpr": lambda: RelationalForCausalLM(
            RelationalConfig(
                **rel,
                gauge="free",
                position_encoding="none",
                value_parallel_removal=True,
                attention_bias=True,
                attention_output_bias=True,
                tie_word_embeddings=False,
            )
        ),
        "relational_pivot": lambda: RelationalForCausalLM(RelationalConfig(**rel, num_key_value_heads=2)),
        "relational_pivot_vpr": lambda: RelationalForCausalLM(RelationalConfig(**rel, value_parallel_removal=True)),
    }
    return models[name]().eval()


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
