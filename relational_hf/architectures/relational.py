"""Adapter for relational-transformer models (this project's architecture)."""

from __future__ import annotations

from torch import nn

from ..modeling import RelationalConfig
from .base import ArchitectureAdapter, LayerRoles


class RelationalAdapter(ArchitectureAdapter):
    family = "relational"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(getattr(model, "config", None), RelationalConfig) or (
            getattr(getattr(model, "config", None), "model_type", None) == RelationalConfig.model_type
        )

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

    def qk_dim(self) -> int:
        return self.config.qk_rank

    def rotary_dim(self) -> int:
        return self.config.qk_rank if self.config.position_encoding == "rope" else 0
