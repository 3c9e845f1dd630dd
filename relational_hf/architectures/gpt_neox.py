"""GPT-NeoX adapter (Pythia): fused query_key_value laid out per head, LayerNorm with biases, partial rotary
(`rotary_pct`), parallel attention and MLP, non-gated GELU MLP with biases, untied head."""

from __future__ import annotations

import torch
from torch import nn

from .base import ArchitectureAdapter, AttentionSlots, LayerRoles, MLPSlots, TensorSlot


class GPTNeoXAdapter(ArchitectureAdapter):
    family = "gpt_neox"
    #: converts exactly (`relational_hf.convert.layernorm`): LayerNorms folded, partial rotary, parallel residual
    relational_obstruction = None

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        base = getattr(model, "gpt_neox", model)
        return type(base).__name__ == "GPTNeoXModel"

    def base_model(self) -> nn.Module:
        return getattr(self.model, "gpt_neox", self.model)

    def layers(self) -> list[LayerRoles]:
        parallel = bool(self.config.use_parallel_residual)
        return [
            LayerRoles(i, blk, blk.attention, blk.mlp, blk.input_layernorm, blk.post_attention_layernorm, parallel)
            for i, blk in enumerate(self.base_model().layers)
        ]

    def embedding(self) -> nn.Embedding:
        return self.base_model().embed_in

    def final_norm(self) -> nn.Module | None:
        return self.base_model().final_layer_norm

    def num_kv_heads(self) -> int:
        return self.num_heads()

    def head_dim(self) -> int:
        return self.config.hidden_size // self.num_heads()

    def rotary_dim(self) -> int:
        rope = getattr(self.config, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(self.config, "rotary_pct", 1.0))
        return int(self.head_dim() * (1.0 if factor is None else factor))

    def attention_slots(self, layer: LayerRoles) -> AttentionSlots:
        # query_key_value.weight (3 H d_h, d): per head h the rows [q_h | k_h | v_h], d_h each
        attn, h, dh = layer.attention, self.num_heads(), self.head_dim()
        w, b = attn.query_key_value.weight, attn.query_key_value.bias

        def part(param, k: int) -> TensorSlot | None:
            return None if param is None else TensorSlot(param, _HeadPart(h, dh, k), per_head=True)

        dense = attn.dense
        return AttentionSlots(
            q=part(w, 0),
            k=part(w, 1),
            v=part(w, 2),
            o=TensorSlot(dense.weight),
            q_bias=part(b, 0),
            k_bias=part(b, 1),
            v_bias=part(b, 2),
            o_bias=None if dense.bias is None else TensorSlot(dense.bias),
            num_heads=h,
            num_kv_heads=h,
            qk_dim=dh,
            head_dim=dh,
            rotary_dim=self.rotary_dim(),
        )

    def mlp_slots(self, layer: LayerRoles) -> MLPSlots:
        up, down = layer.mlp.dense_h_to_4h, layer.mlp.dense_4h_to_h
        return MLPSlots(
            up=TensorSlot(up.weight),
            down=TensorSlot(down.weight),
            up_bias=None if up.bias is None else TensorSlot(up.bias),
            down_bias=None if down.bias is None else TensorSlot(down.bias),
            gated=False,
        )


class _HeadPart:
    """View of part k (0 query, 1 key, 2 value) of every head of a per-head fused tensor: (H, d_h, d) of a weight
    (3 H d_h, d), (H, d_h) of a bias (3 H d_h,)."""

    def __init__(self, heads: int, width: int, part: int) -> None:
        self.heads, self.width, self.part = heads, width, part

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        fused = t.view(self.heads, 3 * self.width, *t.shape[1:])
        return fused.narrow(1, self.part * self.width, self.width)
