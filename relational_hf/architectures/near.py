"""Families close to a supported one that no adapter models yet, and the feature of their forward pass that is
missing: the one-line refusal names it instead of only saying that no adapter matches."""

from __future__ import annotations

from torch import nn

#: class-name prefix -> what the family computes that no adapter (and no relational option) holds
NEAR_FAMILIES: dict[str, str] = {
    "Granite": "embedding, residual and attention multipliers and logits_scaling are not modelled",
    "Olmo2": "norms after attention and MLP (post-norms) and a QK-norm over the whole projection are not modelled",
    "Cohere": "attention and MLP in parallel from one LayerNorm, interleaved rotary pairs and logit_scale are not "
    "modelled",
    "StableLm": "LayerNorm with biases, partial rotary, per-head QK LayerNorm and the parallel residual are not "
    "modelled",
}


def missing_feature(model: nn.Module) -> str | None:
    """What keeps `model`'s family from an adapter, when it is one of `NEAR_FAMILIES`; None otherwise."""
    name = type(model).__name__
    for prefix, feature in NEAR_FAMILIES.items():
        if name.startswith(prefix):
            return feature
    return None
