"""The adapter interface shared by all model families."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """Raised for a model no adapter knows ("unsupported: <class>")."""


@dataclass
class LayerRoles:
    """The modules of one decoder layer by role. `attention` returns (output after W_O, weights); `mlp` returns the
    MLP update; `block` maps the layer input to the layer output; norms are None where the family has none."""

    index: int
    block: nn.Module
    attention: nn.Module
    mlp: nn.Module
    attention_norm: nn.Module | None
    mlp_norm: nn.Module | None


@dataclass
class AttentionWeights:
    """One layer's attention factors in nn.Linear layout (out x in), row-vector convention of DESIGN.md:
    q: (H r, d) holds W_Q^T per head, k: (H_kv r, d), v: (H_kv d_h, d), o: (d, H d_h) holds W_O^T.
    Biases are (out,) or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


class ArchitectureAdapter:
    """Maps one model family onto the roles above. Subclasses implement `matches` and the role accessors."""

    #: human-readable family name
    family: str = "abstract"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @classmethod
    def matches(cls, model: nn.Module) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    # --- structure ---------------------------------------------------------------------------------------------
    def base_model(self) -> nn.Module:
        """The module that holds embeddings and layers (e.g. `LlamaModel`)."""
        raise NotImplementedError

    def layers(self) -> list[LayerRoles]:
        raise NotImplementedError

    def embedding(self) -> nn.Embedding:
        raise NotImplementedError

    def final_norm(self) -> nn.Module | None:
        raise NotImplementedError

    def output_head(self) -> nn.Module | None:
        """The LM head (None for a base model without one)."""
        return getattr(self.model, "lm_head", None)

    # --- geometry facts ----------------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    def num_heads(self) -> int:
        return self.config.num_attention_heads

    def num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.num_heads()

    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.num_heads()

    def qk_dim(self) -> int:
        """Width r of each head's query/key coordinates."""
        return self.head_dim()

    def rotary_dim(self) -> int:
        """Number of query/key coordinates rotated by RoPE (0: no rotary)."""
        return 0
