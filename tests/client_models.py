"""Tiny checkpoints for the tests of standard clients and attention backends (tests/test_clients.py,
tests/test_attention_kwargs.py): a random Llama with the byte-level tokenizer, its exact relational conversion, and
that conversion compressed with per-layer widths (QK, value and SwiGLU widths that differ from layer to layer)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf.convert import to_relational
from relational_hf.jobs import compress_model
from relational_hf.lm.data import byte_level_tokenizer
from relational_hf.modeling import RelationalForCausalLM

#: the byte-level tokenizer's vocabulary: ids 0-2 <pad>, <s>, </s>, then the 256 bytes
VOCAB = 259

LLAMA = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


@torch.no_grad()
def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """The source: Transformers' Llama (GQA, tied head), weights scaled up from their initialisation so that the
    logits are well separated (greedy choices that rounding cannot flip)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    for p in model.parameters():
        if p.ndim == 2:
            p.mul_(10.0)
    return model


@torch.no_grad()
def tiny_compressed(exact: RelationalForCausalLM) -> RelationalForCausalLM:
    """`exact` compressed by `compress_model` (30% of the stored parameters removed) after one layer's MLP and the
    other's attention output were made heavier, so that the plan gives the two layers different widths."""
    source = copy.deepcopy(exact)
    source.model.layers[1].mlp.down_proj.weight.mul_(4.0)
    source.model.layers[0].self_attn.o_proj.weight.mul_(4.0)
    calibration = torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    out, _ = compress_model(
        source.eval(), remove=0.3, calibration=calibration, progress=False, plan_windows=2, mlp_step=8
    )
    return out.eval()


def per_layer_widths(model: RelationalForCausalLM) -> list[tuple[int, int, int]]:
    """(QK width, value width, SwiGLU width) of every layer."""
    c = model.config
    return [
        (c.layer_qk_rank(i), c.layer_value_rank(i), c.layer_intermediate_size(i)) for i in range(c.num_hidden_layers)
    ]


def build_checkpoints(folder: Path) -> dict:
    """Write the Llama source, its exact conversion and the compressed conversion under `folder` ("llama",
    "exact", "compressed"), each with the byte-level tokenizer; returns their paths and the in-memory models."""
    tokenizer = byte_level_tokenizer()
    llama = tiny_llama()
    exact = to_relational(llama).eval()
    compressed = tiny_compressed(exact)
    paths = {}
    for name, model in (("llama", llama), ("exact", exact), ("compressed", compressed)):
        paths[name] = folder / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return {"paths": paths, "models": {"llama": llama, "exact": exact, "compressed": compressed}}
