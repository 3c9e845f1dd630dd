"""The tiny Gemma 3 (text) models of the Gemma 3 tests, built from Transformers' own Gemma3TextConfig and
Gemma3ForCausalLM (no download): d = 32, 2 layers (one sliding-window layer, window 4, and one full layer), 4 query
heads of width 8 sharing 2 key/value heads, GELU-tanh MLP of 64 units, tied head. Norm gains are random (never at
their initial w = 0, where 1 + w would all be equal and hide a folding mistake). The module-scoped fixtures built on
`convertible` (the model, its checkpoint, its conversion) are `gemma3_source`, `gemma3_checkpoint` and
`gemma3_converted` in conftest.py."""

from __future__ import annotations

import torch
from family_checks import randomize_gains_and_biases
from family_helpers import TOKENS, VOCAB, token_ids
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

V, D, L, H, HKV, DH, F = 64, 32, 2, 4, 2, 8, 64


def config(**overrides) -> Gemma3TextConfig:
    sizes = dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=HKV, head_dim=DH,
        intermediate_size=F, max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=6,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    return Gemma3TextConfig(**(sizes | overrides))


def tiny(random_gains: bool = True, seed: int = 0, **overrides) -> Gemma3ForCausalLM:
    """The model on a vocabulary of V = 64, at the initial weight scale (for the symmetry counts)."""
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config(**overrides)).eval()
    return randomize_gains_and_biases(model) if random_gains else model


@torch.no_grad()
def convertible(seed: int = 0, random_gains: bool = True, **overrides) -> Gemma3ForCausalLM:
    """The tiny model on the byte-level vocabulary (the commands' texts), one sliding layer (window 4) and one full
    layer; norm gains w = 0.3 N(0, 1) (so 1 + w differ), weight matrices at 20 x the initial scale (logits of a few
    units)."""
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config(vocab_size=VOCAB, max_position_embeddings=128, **TOKENS, **overrides))
    if random_gains:
        randomize_gains_and_biases(model, seed=seed + 1)
    for p in model.parameters():
        if p.ndim == 2:
            p.mul_(20.0)
    return model.float().eval()


def longer_than_the_window(batch: int = 3, length: int = 24, seed: int = 9) -> torch.Tensor:
    """Token ids (batch, length) of the byte-level vocabulary, longer than the sliding window of 4."""
    return token_ids(batch=batch, length=length, seed=seed)
