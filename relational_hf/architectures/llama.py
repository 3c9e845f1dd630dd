"""Llama-family adapter: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (QK-norm) and look-alikes."""

from __future__ import annotations

from torch import nn

from .base import ArchitectureAdapter, LayerRoles

_CLASS_PREFIXES = ("Llama", "Mistral", "Qwen2", "Qwen3")


class LlamaFamilyAdapter(ArchitectureAdapter):
    family = "llama"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        name = type(model).__name__
        if not name.startswith(_CLASS_PREFIXES) or name.startswith(("Qwen2Moe", "Qwen3Moe", "Qwen2VL", "Qwen2_5")):
            return False
        base = getattr(model, "model", model)
        return hasattr(base, "layers") and hasattr(base, "embed_tokens")

    def base_model(self) -> nn.Module:
        return getattr(self.model, "model", self.model)

    def layers(self) -> list[LayerRoles]:
        return [
            LayerRoles(i, layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
            for i, layer in enumerate(self.base_model().layers)
        ]

    def embedding(self) -> nn.Embedding:
        return self.base_model().embed_tokens

    def final_norm(self) -> nn.Module | None:
        return self.base_model().norm

    def rotary_dim(self) -> int:
        rope = getattr(self.config, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", 1.0)) or 1.0
        return int(self.head_dim() * factor)
