"""Gemma 3 text adapter (Gemma3ForCausalLM): RMS norms that scale by 1 + w, sandwich norms (a norm after the
attention and after the MLP, before the residual add), per-head QK-norm before RoPE, a GELU-tanh gated MLP, the
embedding scaled by sqrt(d), query_pre_attn_scalar, sliding-window layers with their own rotary base, tied head."""

from __future__ import annotations

import torch
from torch import nn

from .base import ArchitectureAdapter, AttentionSlots, LayerRoles, LlamaLayoutMixin, MLPSlots, NormSlots, TensorSlot

#: Gemma's norms multiply by 1 + w
GAIN_OFFSET = 1.0


class Gemma3Adapter(LlamaLayoutMixin, ArchitectureAdapter):
    family = "gemma3"
    #: the relational architecture holds every part of the forward pass (`relational_hf.convert.gemma`)
    relational_obstruction = None

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        base = getattr(model, "model", model)
        return type(base).__name__ == "Gemma3TextModel"

    def layers(self) -> list[LayerRoles]:
        return [
            LayerRoles(
                i,
                layer,
                layer.self_attn,
                layer.mlp,
                layer.input_layernorm,
                layer.pre_feedforward_layernorm,
                attention_post_norm=layer.post_attention_layernorm,
                mlp_post_norm=layer.post_feedforward_layernorm,
            )
            for i, layer in enumerate(self.base_model().layers)
        ]

    def rotary_dim(self) -> int:
        return self.head_dim()  # Gemma 3 rotates every query/key coordinate, in full and sliding layers alike

    def rope_inv_freq(self) -> torch.Tensor | None:
        # one table per layer type; the frequencies of either are distinct, so the full layers' table stands for both
        rotary = self.base_model().rotary_emb
        table = getattr(rotary, "full_attention_inv_freq", None)
        return None if table is None else table.detach()

    def norm_slots(self, norm: nn.Module | None) -> NormSlots:
        slots = super().norm_slots(norm)
        slots.offset = GAIN_OFFSET if slots.gain is not None else 0.0
        return slots

    def attention_slots(self, layer: LayerRoles) -> AttentionSlots:
        attn = layer.attention
        return AttentionSlots(
            q=_slot(attn.q_proj.weight),
            k=_slot(attn.k_proj.weight),
            v=_slot(attn.v_proj.weight),
            o=_slot(attn.o_proj.weight),
            q_bias=_slot(attn.q_proj.bias),
            k_bias=_slot(attn.k_proj.bias),
            v_bias=_slot(attn.v_proj.bias),
            o_bias=_slot(attn.o_proj.bias),
            num_heads=self.num_heads(),
            num_kv_heads=self.num_kv_heads(),
            qk_dim=self.head_dim(),
            head_dim=self.head_dim(),
            rotary_dim=self.rotary_dim(),
            q_norm=_slot(attn.q_norm.weight),
            k_norm=_slot(attn.k_norm.weight),
            qk_norm_offset=GAIN_OFFSET,
        )

    def mlp_slots(self, layer: LayerRoles) -> MLPSlots:
        mlp = layer.mlp
        return MLPSlots(
            up=_slot(mlp.up_proj.weight),
            down=_slot(mlp.down_proj.weight),
            gate=_slot(mlp.gate_proj.weight),
            up_bias=_slot(mlp.up_proj.bias),
            gate_bias=_slot(mlp.gate_proj.bias),
            down_bias=_slot(mlp.down_proj.bias),
            gated=True,
        )


def _slot(param: nn.Parameter | None) -> TensorSlot | None:
    return None if param is None else TensorSlot(param)
