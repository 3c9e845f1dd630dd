"""Llama-family adapter: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (QK-norm) and look-alikes."""

from __future__ import annotations

from torch import nn

from .base import ArchitectureAdapter, AttentionSlots, LayerRoles, LlamaLayoutMixin, MLPSlots, TensorSlot

_CLASS_PREFIXES = ("Llama", "Mistral", "Qwen2", "Qwen3")


class LlamaFamilyAdapter(LlamaLayoutMixin, ArchitectureAdapter):
    family = "llama"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        name = type(model).__name__
        if not name.startswith(_CLASS_PREFIXES) or name.startswith(("Qwen2Moe", "Qwen3Moe", "Qwen2VL", "Qwen2_5")):
            return False
        base = getattr(model, "model", model)
        return hasattr(base, "layers") and hasattr(base, "embed_tokens")

    def rotary_dim(self) -> int:
        rope = getattr(self.config, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", 1.0)) or 1.0
        return int(self.head_dim() * factor)

    def attention_slots(self, layer: LayerRoles) -> AttentionSlots:
        attn = layer.attention
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
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
            q_norm=None if q_norm is None else _slot(q_norm.weight),
            k_norm=None if k_norm is None else _slot(k_norm.weight),
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
