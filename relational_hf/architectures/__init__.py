"""Architecture adapters: map a model family's modules to abstract roles.

Every tool (symmetry groups, canonicalisation, projection, conversion, directional hooks, trainer) reaches a
model through an adapter, never through ``isinstance`` chains of its own. Supporting a new family means adding one
small file to this folder and registering it in ``ADAPTERS`` below.

Roles (DESIGN.md section 2.1): embedding, per layer a pre-attention norm, a QK pair with its positional scheme,
a VO pair, a pre-MLP norm, MLP in/out with its gating; a final norm and an output head.
"""

from __future__ import annotations

from torch import nn

from .base import (
    ArchitectureAdapter,
    AttentionSlots,
    AttentionWeights,
    LayerRoles,
    MLPSlots,
    NormSlots,
    TensorSlot,
    UnsupportedModelError,
)
from .gemma3 import Gemma3Adapter
from .gpt2 import GPT2Adapter
from .gpt_neox import GPTNeoXAdapter
from .llama import LlamaFamilyAdapter
from .near import missing_feature
from .phi3 import Phi3Adapter
from .relational import RelationalAdapter
from .smollm3 import SmolLM3Adapter

# Tried in order; the first whose `matches` accepts the model wins.
ADAPTERS: list[type[ArchitectureAdapter]] = [
    RelationalAdapter,
    LlamaFamilyAdapter,
    GPT2Adapter,
    SmolLM3Adapter,
    Phi3Adapter,
    GPTNeoXAdapter,
    Gemma3Adapter,
]


def get_adapter(model: nn.Module) -> ArchitectureAdapter:
    """The adapter for `model` (a CausalLM, a base model or a PEFT-wrapped one); raises UnsupportedModelError."""
    base = model
    if hasattr(base, "get_base_model") and callable(base.get_base_model):  # PEFT wrapper
        base = base.get_base_model()
    for adapter_cls in ADAPTERS:
        if adapter_cls.matches(base):
            return adapter_cls(base)
    feature = missing_feature(base)
    reason = "no architecture adapter matches it" + ("" if feature is None else f": {feature}")
    raise UnsupportedModelError(f"unsupported: {type(base).__name__} ({reason})")


__all__ = [
    "ADAPTERS",
    "ArchitectureAdapter",
    "AttentionSlots",
    "AttentionWeights",
    "LayerRoles",
    "MLPSlots",
    "NormSlots",
    "TensorSlot",
    "UnsupportedModelError",
    "get_adapter",
]
