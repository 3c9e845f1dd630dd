"""SmolLM3 adapter: the Llama layout with layers that attend without rotary positions (`config.no_rope_layers`:
1 = the layer applies RoPE, 0 = it does not). A layer without rotary keeps the full GL(d_h) QK gauge per key head."""

from __future__ import annotations

from torch import nn

from .base import AttentionSlots, LayerRoles
from .llama import LlamaFamilyAdapter


class SmolLM3Adapter(LlamaFamilyAdapter):
    family = "smollm3"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        base = getattr(model, "model", model)
        return type(model).__name__.startswith("SmolLM3") and hasattr(base, "layers") and hasattr(base, "embed_tokens")

    def layer_uses_rope(self, index: int) -> bool:
        """Whether decoder layer `index` rotates its queries and keys."""
        flags = getattr(self.config, "no_rope_layers", None)
        return True if flags is None else bool(flags[index])

    def attention_slots(self, layer: LayerRoles) -> AttentionSlots:
        slots = super().attention_slots(layer)
        if not self.layer_uses_rope(layer.index):
            slots.rotary_dim = 0
        return slots
