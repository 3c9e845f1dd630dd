"""Adapter for relational-transformer models (this project's architecture)."""

from __future__ import annotations

from torch import nn

from ..modeling import GaugeFixedLinear, RelationalConfig
from .base import ArchitectureAdapter, AttentionSlots, LayerRoles, LlamaLayoutMixin, MLPSlots, TensorSlot


class RelationalAdapter(LlamaLayoutMixin, ArchitectureAdapter):
    family = "relational"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return isinstance(getattr(model, "config", None), RelationalConfig) or (
            getattr(getattr(model, "config", None), "model_type", None) == RelationalConfig.model_type
        )

    def layers(self) -> list[LayerRoles]:
        roles = super().layers()
        for role in roles:  # GPT-NeoX's parallel residual: attention and MLP both read the layer input
            role.parallel = bool(self.config.parallel_residual)
            # Gemma 3's sandwich norms (None without): the sublayers' updates are their outputs
            role.attention_post_norm, role.mlp_post_norm = role.block.attention_output_norm, role.block.mlp_output_norm
        return roles

    def embedding_slots(self) -> list[TensorSlot]:
        positions = self.base_model().embed_positions  # learned absolute positions, rotated with the stream
        return [TensorSlot(self.embedding().weight)] + ([] if positions is None else [TensorSlot(positions.weight)])

    def input_centring(self) -> bool:
        return self.config.embedding_centring

    def qk_dim(self) -> int:
        return self.config.qk_rank

    def rotary_dim(self) -> int:
        return self.config.rotary_dim

    def attention_slots(self, layer: LayerRoles) -> AttentionSlots:
        # a compressed model's widths differ from layer to layer (config.layer_qk_ranks, layer_value_ranks): each
        # layer's own module holds them
        attn, c = layer.attention, self.config
        qk_dim, head_dim = attn.qk_rank, attn.head_dim
        return AttentionSlots(
            q=_slot(attn.q_proj),
            k=_slot(attn.k_proj),
            v=_slot(attn.v_proj),
            o=_slot(attn.o_proj),
            q_bias=_bias(attn.q_proj),
            k_bias=_bias(attn.k_proj),
            v_bias=_bias(attn.v_proj),
            o_bias=_bias(attn.o_proj),
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            qk_dim=qk_dim,
            head_dim=head_dim,
            rotary_dim=attn.rotary_dim if attn.rotary_dim < c.qk_rank else (qk_dim if attn.rope else 0),
            qk_gauge_fixed=isinstance(attn.k_proj, GaugeFixedLinear),
            vo_gauge_fixed=isinstance(attn.v_proj, GaugeFixedLinear),
            value_parallel_removal=c.value_parallel_removal,
            q_norm=None if attn.q_norm is None else TensorSlot(attn.q_norm.weight),
            k_norm=None if attn.k_norm is None else TensorSlot(attn.k_norm.weight),
        )

    def mlp_slots(self, layer: LayerRoles) -> MLPSlots:
        mlp = layer.mlp
        if not self.config.mlp_gated:  # a plain MLP (converted GPT-2): no scale gauge, biases with mlp_bias
            return MLPSlots(
                up=_slot(mlp.up_proj),
                down=_slot(mlp.down_proj),
                up_bias=_bias(mlp.up_proj),
                down_bias=_bias(mlp.down_proj),
                gated=False,
            )
        return MLPSlots(
            up=_slot(mlp.up_proj),
            down=_slot(mlp.down_proj),
            gate=_slot(mlp.gate_proj),
            gated=True,
            scale_fixed=isinstance(mlp.up_proj, GaugeFixedLinear),
        )


def _slot(module: nn.Module) -> TensorSlot | None:
    """The weight of an nn.Linear; None for a GaugeFixedLinear (its free entries are not a full factor)."""
    return None if isinstance(module, GaugeFixedLinear) else TensorSlot(module.weight)


def _bias(module: nn.Module) -> TensorSlot | None:
    return None if module.bias is None else TensorSlot(module.bias)
