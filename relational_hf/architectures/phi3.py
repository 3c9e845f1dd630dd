"""Phi-3 adapter: the Llama layout with a fused `qkv_proj` (rows [q | k | v]) and a fused `gate_up_proj` (rows
[gate | up]); the roles are row views of the fused weights, so every tool reads and writes them in place."""

from __future__ import annotations

import torch
from torch import nn

from .base import ArchitectureAdapter, AttentionSlots, LayerRoles, LlamaLayoutMixin, MLPSlots, TensorSlot


class Phi3Adapter(LlamaLayoutMixin, ArchitectureAdapter):
    family = "phi3"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        base = getattr(model, "model", model)
        return type(base).__name__ == "Phi3Model" and hasattr(base, "layers")

    def rotary_dim(self) -> int:
        rope = getattr(self.config, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", 1.0)) or 1.0
        return int(self.head_dim() * factor)

    def attention_slots(self, layer: LayerRoles) -> AttentionSlots:
        attn = layer.attention
        q_rows, kv_rows = self.num_heads() * self.head_dim(), self.num_kv_heads() * self.head_dim()
        w, o = attn.qkv_proj.weight, attn.o_proj
        return AttentionSlots(
            q=TensorSlot(w, _Rows(0, q_rows)),
            k=TensorSlot(w, _Rows(q_rows, kv_rows)),
            v=TensorSlot(w, _Rows(q_rows + kv_rows, kv_rows)),
            o=TensorSlot(o.weight),
            o_bias=None if o.bias is None else TensorSlot(o.bias),
            num_heads=self.num_heads(),
            num_kv_heads=self.num_kv_heads(),
            qk_dim=self.head_dim(),
            head_dim=self.head_dim(),
            rotary_dim=self.rotary_dim(),
        )

    def mlp_slots(self, layer: LayerRoles) -> MLPSlots:
        mlp = layer.mlp
        f = mlp.down_proj.weight.shape[1]
        fused = mlp.gate_up_proj.weight
        return MLPSlots(
            up=TensorSlot(fused, _Rows(f, f)),
            down=TensorSlot(mlp.down_proj.weight),
            gate=TensorSlot(fused, _Rows(0, f)),
            gated=True,
        )


class _Rows:
    """View of rows [start, start + width) of a fused Linear weight (already in Linear layout)."""

    def __init__(self, start: int, width: int) -> None:
        self.start, self.width = start, width

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, self.start, self.width)
