"""GPT-2 adapter: fused Conv1D c_attn, LayerNorm with bias, absolute positions, GELU MLP."""

from __future__ import annotations

from torch import nn

from .base import ArchitectureAdapter, LayerRoles


class GPT2Adapter(ArchitectureAdapter):
    family = "gpt2"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        base = getattr(model, "transformer", model)
        return type(base).__name__ == "GPT2Model"

    def base_model(self) -> nn.Module:
        return getattr(self.model, "transformer", self.model)

    def layers(self) -> list[LayerRoles]:
        return [LayerRoles(i, blk, blk.attn, blk.mlp, blk.ln_1, blk.ln_2) for i, blk in enumerate(self.base_model().h)]

    def embedding(self) -> nn.Embedding:
        return self.base_model().wte

    def final_norm(self) -> nn.Module | None:
        return self.base_model().ln_f

    def num_heads(self) -> int:
        return self.config.n_head

    def num_kv_heads(self) -> int:
        return self.config.n_head

    def head_dim(self) -> int:
        return self.config.n_embd // self.config.n_head
