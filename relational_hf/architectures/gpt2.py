"""GPT-2 adapter: fused Conv1D c_attn, LayerNorm with bias, absolute positions, GELU MLP."""

from __future__ import annotations

import torch
from torch import nn

from .base import ArchitectureAdapter, AttentionSlots, LayerRoles, MLPSlots, TensorSlot


class GPT2Adapter(ArchitectureAdapter):
    family = "gpt2"
    #: converts exactly (`relational_hf.convert.layernorm`): LayerNorms folded, learned positions, plain GELU MLP
    relational_obstruction = None

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

    def rope_inv_freq(self) -> torch.Tensor | None:
        return None

    def attention_slots(self, layer: LayerRoles) -> AttentionSlots:
        # Conv1D stores (in, out): c_attn.weight is (d, 3d) with columns [q | k | v]; the views transpose to (out, in).
        attn, d = layer.attention, self.config.n_embd
        w, b = attn.c_attn.weight, attn.c_attn.bias
        return AttentionSlots(
            q=TensorSlot(w, _columns(0, d)),
            k=TensorSlot(w, _columns(d, d)),
            v=TensorSlot(w, _columns(2 * d, d)),
            o=TensorSlot(attn.c_proj.weight, _transpose),
            q_bias=TensorSlot(b, _entries(0, d)),
            k_bias=TensorSlot(b, _entries(d, d)),
            v_bias=TensorSlot(b, _entries(2 * d, d)),
            o_bias=TensorSlot(attn.c_proj.bias),
            num_heads=self.num_heads(),
            num_kv_heads=self.num_kv_heads(),
            qk_dim=self.head_dim(),
            head_dim=self.head_dim(),
            rotary_dim=0,
        )

    def mlp_slots(self, layer: LayerRoles) -> MLPSlots:
        mlp = layer.mlp
        return MLPSlots(
            up=TensorSlot(mlp.c_fc.weight, _transpose),
            down=TensorSlot(mlp.c_proj.weight, _transpose),
            up_bias=TensorSlot(mlp.c_fc.bias),
            down_bias=TensorSlot(mlp.c_proj.bias),
            gated=False,
        )

    def embedding_slots(self) -> list[TensorSlot]:
        base = self.base_model()
        return [TensorSlot(base.wte.weight), TensorSlot(base.wpe.weight)]


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t()


class _columns:
    """View of columns [start, start + width) of a Conv1D weight, transposed to Linear layout."""

    def __init__(self, start: int, width: int) -> None:
        self.start, self.width = start, width

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(1, self.start, self.width).t()


class _entries:
    """View of entries [start, start + width) of a fused bias."""

    def __init__(self, start: int, width: int) -> None:
        self.start, self.width = start, width

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, self.start, self.width)
