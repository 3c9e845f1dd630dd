"""The adapter interface shared by all model families."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """Raised for a model no adapter knows ("unsupported: <class>")."""


@dataclass
class LayerRoles:
    """The modules of one decoder layer by role. `attention` returns (output after W_O, weights); `mlp` returns the
    MLP output; `block` maps the layer input to the layer output; norms are None where the family has none."""

    index: int
    block: nn.Module
    attention: nn.Module
    mlp: nn.Module
    attention_norm: nn.Module | None
    mlp_norm: nn.Module | None
    #: the attention and the MLP both read the layer input and their updates are summed (GPT-NeoX, GPT-J)
    parallel: bool = False
    #: norms applied to the sublayer's output before it is added to the stream (Gemma 2/3's sandwich norms); the
    #: residual update is then their output
    attention_post_norm: nn.Module | None = None
    mlp_post_norm: nn.Module | None = None


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

    def roles(self) -> dict[str, torch.Tensor | None]:
        """The maps and biases by role name (q, k, v, o, q_bias, ..., o_bias), the tensors themselves (no copy)."""
        names = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias")
        return {name: getattr(self, name) for name in names}


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class TensorSlot:
    """One role's tensor: a parameter and the view that presents it in nn.Linear layout (out x in).

    `view` maps any tensor shaped like `param` (the parameter itself, an update, a gradient) to a writable view in
    the layout the role expects, e.g. the query block of GPT-2's fused Conv1D ``c_attn`` transposed to (H d_h, d)."""

    param: nn.Parameter
    view: Callable[[torch.Tensor], torch.Tensor] = _identity
    #: the view is per head, (H, w, d) for a weight or (H, w) for a bias, because the role's rows interleave with
    #: other roles' rows in a fused tensor (GPT-NeoX's query_key_value: q, k, v of head 0, then of head 1, ...):
    #: `get` merges the heads into the Linear layout (a copy), and writers reshape to the view
    per_head: bool = False

    def get(self, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """The view of `tensor` (default: the parameter itself, detached) in Linear layout (out x in)."""
        view = self.view(self.param.detach() if tensor is None else tensor)
        return view.flatten(0, 1) if self.per_head else view


@dataclass
class AttentionSlots:
    """One layer's attention tensors (Linear layout, row-vector convention of DESIGN.md 2.1) and the facts that decide
    which head-space groups survive. q: (H r, d), k: (H_kv r, d), v: (H_kv d_h, d), o: (d, H d_h); biases (out,).

    A slot is None where the tensor does not exist or is stored in a gauge-fixed form (relational pivot gauge):
    then `qk_gauge_fixed` / `vo_gauge_fixed` say the group has been removed by construction."""

    q: TensorSlot | None
    k: TensorSlot | None
    v: TensorSlot | None
    o: TensorSlot | None
    q_bias: TensorSlot | None = None
    k_bias: TensorSlot | None = None
    v_bias: TensorSlot | None = None
    o_bias: TensorSlot | None = None
    num_heads: int = 1
    num_kv_heads: int = 1
    qk_dim: int = 1
    head_dim: int = 1
    rotary_dim: int = 0
    qk_gauge_fixed: bool = False
    vo_gauge_fixed: bool = False
    value_parallel_removal: bool = False
    #: per-dimension gains of a QK-norm applied per head before RoPE (Qwen3): (r,) each, shared by all heads
    q_norm: TensorSlot | None = None
    k_norm: TensorSlot | None = None
    #: the QK-norm multiplies by gain + offset (Gemma 3: 1 + w)
    qk_norm_offset: float = 0.0


@dataclass
class MLPSlots:
    """One layer's MLP tensors in Linear layout: readers of the residual (gate, up: (d_ff, d)), writer down (d, d_ff).
    `gated`: SwiGLU-type product act(x W_gate) * (x W_up), whose W_up/W_down scales are a symmetry;
    `scale_fixed`: that scaling gauge is already fixed in storage (relational pivot gauge; `up` is then None)."""

    up: TensorSlot | None
    down: TensorSlot
    gate: TensorSlot | None = None
    up_bias: TensorSlot | None = None
    gate_bias: TensorSlot | None = None
    down_bias: TensorSlot | None = None
    gated: bool = False
    scale_fixed: bool = False

    def readers(self) -> list[tuple[TensorSlot, TensorSlot | None]]:
        """(weight, bias) of every map that reads the normalised residual stream."""
        pairs = [(self.gate, self.gate_bias), (self.up, self.up_bias)]
        return [(w, b) for w, b in pairs if w is not None]


@dataclass
class NormSlots:
    """A normalisation's parameters: per-dimension gain and bias (None where absent: gain-free RMS norm).
    `centring`: the norm subtracts the mean over the hidden dimension (LayerNorm); `offset`: see below."""

    gain: TensorSlot | None = None
    bias: TensorSlot | None = None
    centring: bool = False
    #: the norm multiplies by gain + offset (Gemma stores w and scales by 1 + w: offset 1)
    offset: float = 0.0


class ArchitectureAdapter:
    """Maps one model family onto the roles above. Subclasses implement `matches` and the role accessors."""

    #: human-readable family name
    family: str = "abstract"
    #: the features of the family's forward pass that the relational architecture cannot hold yet (None: none); the
    #: converter refuses the family in one line naming them
    relational_obstruction: str | None = None

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

    def rope_inv_freq(self) -> torch.Tensor | None:
        """Inverse frequencies of the rotary pairs (rotary_dim / 2,), or None without rotary positions."""
        rotary = getattr(self.base_model(), "rotary_emb", None)
        return None if rotary is None else rotary.inv_freq.detach()

    # --- weight accessors (the symmetry toolkit and the converter reach tensors only through these) ------------
    def attention_slots(self, layer: LayerRoles) -> AttentionSlots:
        """The attention tensors of `layer` by role, in Linear layout."""
        raise NotImplementedError

    def mlp_slots(self, layer: LayerRoles) -> MLPSlots:
        """The MLP tensors of `layer` by role, in Linear layout."""
        raise NotImplementedError

    def norm_slots(self, norm: nn.Module | None) -> NormSlots:
        """Gain and bias of a normalisation module (None entries for a gain-free norm or no norm)."""
        if norm is None:
            return NormSlots()
        gain, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
        return NormSlots(
            gain=TensorSlot(gain) if isinstance(gain, nn.Parameter) else None,
            bias=TensorSlot(bias) if isinstance(bias, nn.Parameter) else None,
            centring=isinstance(norm, nn.LayerNorm),
        )

    def embedding_slots(self) -> list[TensorSlot]:
        """Tensors whose rows live in residual coordinates and are written into the stream: token embedding
        (V, d) and, where the family has them, absolute position embeddings (P, d)."""
        return [TensorSlot(self.embedding().weight)]

    def input_centring(self) -> bool:
        """True when the model centres its embedded input (a parameter-free projection onto the mean-free subspace):
        residual rotations must then fix the all-ones direction."""
        return False

    def head_slot(self) -> TensorSlot | None:
        """The output head's weight (V, d), reading the final norm's output."""
        head = self.output_head()
        return None if head is None else TensorSlot(head.weight)

    def head_tied(self) -> bool:
        """True when the output head shares its weight with the token embedding."""
        head = self.output_head()
        return head is not None and head.weight is self.embedding().weight

    def attention_weights(self, layer: LayerRoles) -> AttentionWeights:
        """The full q/k/v/o factors of `layer` (Linear layout, detached), whatever gauge they are stored in."""
        slots = self.attention_slots(layer)
        full = getattr(layer.attention, "full_weights", None)
        if callable(full):  # a module that stores gauge-fixed factors assembles them itself
            w = {key: t.detach() for key, t in full().items()}
            return AttentionWeights(
                w["q"], w["k"], w["v"], w["o"], w.get("q_bias"), w.get("k_bias"), w.get("v_bias"), w.get("o_bias")
            )

        def get(slot: TensorSlot | None) -> torch.Tensor | None:
            return None if slot is None else slot.get()

        return AttentionWeights(
            get(slots.q),
            get(slots.k),
            get(slots.v),
            get(slots.o),
            get(slots.q_bias),
            get(slots.k_bias),
            get(slots.v_bias),
            get(slots.o_bias),
        )


class LlamaLayoutMixin:
    """Structure shared by Llama-like stacks: `model.model.layers[i]` with `self_attn`, `mlp`, `input_layernorm`,
    `post_attention_layernorm`, and `embed_tokens` / `norm` on the base model."""

    model: nn.Module

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
