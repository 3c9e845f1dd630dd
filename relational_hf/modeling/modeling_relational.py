"""The relational transformer: a Llama-like decoder written in invariant, gauge-fixed parameters.

Notation (DESIGN.md): row vectors, residual stream X (n x d), H query heads of value width d_h, H_kv key/value
heads, per head a QK bilinear form G_QK = W_Q W_K^T of rank r = ``qk_rank`` and a VO map G_VO = W_V W_O.
Weights are kept in ``nn.Linear`` layout (out x in), i.e. ``k_proj.weight`` holds W_K^T for every head.

With ``config.gauge == "pivot"`` the key, value and SwiGLU-up maps store only their free entries (`GaugeFixedLinear`,
in `modeling_gauge.py`, which says what is fixed); norm gains are absent (gain-free RMS normalisation). The residual
rotation O(d) is left free (its canonical form is the principal gauge of the symmetry toolkit).

The file reads like Transformers' Llama: norm, rotary embedding, attention, MLP, decoder layer, PreTrainedModel,
Model, ForCausalLM, ForSequenceClassification. It travels to the Hub (``trust_remote_code``) with its siblings
`configuration_relational.py`, `modeling_gauge.py`, `modeling_directional.py`, `modeling_checkpoint.py`,
`modeling_rotary.py`, `modeling_blocks.py` (the plain MLP and learned positions of converted LayerNorm families) and
`modeling_windows.py` (per-layer full and sliding-window attention) (Transformers copies a modeling file's relative
imports with it); it imports only torch, transformers and those siblings.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_relational import RelationalConfig
from .modeling_blocks import RelationalPlainMLP, embed_input, position_table
from .modeling_checkpoint import check_checkpoint_dir, raise_on_key_differences
from .modeling_directional import parallel_component
from .modeling_gauge import (
    GaugeFixedLinear,
    full_weight,
    mlp_to_pivot_gauge,
    qk_to_pivot_gauge,
    regauge_noncanonical,
    vo_to_pivot_gauge,
    weight_cache,
    write_full_weight,
)
from .modeling_rotary import (  # noqa: F401  (re-exported: the compression toolkit imports them from here)
    apply_partial_rotary,
    apply_rotary,
    apply_rotary_pair_subset,
    apply_rotary_pos_emb,
    rotary_layout,
    rotate_half,
)
from .modeling_windows import create_masks_for_generate, layer_masks

logger = logging.get_logger(__name__)


class RelationalRMSNorm(nn.Module):
    """RMS normalisation x / sqrt(mean(x^2) + eps), gain-free by default: the gains of a standard RMSNorm in front of
    linear readers are pure gauge. `hidden_size` adds a gain vector (initialised to ones) for the one place where
    it is not: the final norm in front of a head tied to the embedding (`RelationalConfig.final_norm_gain`)."""

    def __init__(self, eps: float = 1e-6, hidden_size: int | None = None, bias_size: int | None = None) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size)) if hidden_size is not None else None
        self.bias = nn.Parameter(torch.zeros(bias_size)) if bias_size is not None else None  # `final_norm_bias`

    def normalize(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The gain-free part: x / sqrt(mean(x^2) + eps), computed in fp32, returned in the input dtype (torch's
        fused kernel: one operator instead of six on a decoding step's few rows)."""
        h = F.rms_norm(hidden_states.float(), hidden_states.shape[-1:], eps=self.variance_epsilon)
        return h.to(hidden_states.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.normalize(hidden_states)
        h = h if self.weight is None else self.weight * h
        return h if self.bias is None else h + self.bias

    def extra_repr(self) -> str:
        gain = f"{self.weight.shape[0]}, " if self.weight is not None else ""
        return f"{gain}eps={self.variance_epsilon}"


class RelationalRotaryEmbedding(nn.Module):
    """Rotary angles for the r = qk_rank query/key coordinates, any Transformers rope type (`rope_parameters`: another
    table than the config's, e.g. its `sliding_rope_parameters`)."""

    def __init__(self, config: RelationalConfig, rope_parameters: dict | None = None) -> None:
        super().__init__()
        rope_config = copy.copy(config)
        rope_config.head_dim = config.qk_rank  # the rotary dimension is the QK width
        if rope_parameters is not None:
            rope_config.rope_parameters = copy.deepcopy(rope_parameters)
        self.config = rope_config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = rope_config.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self._compute(rope_config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def _compute(self, config, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            base = config.rope_parameters.get("rope_theta", 10000.0)
            dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))  # partial rotary
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
            return inv_freq, 1.0
        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"`rope_parameters['rope_type']` {self.rope_type!r} is not a Transformers rope type.")
        return ROPE_INIT_FUNCTIONS[self.rope_type](config, device, seq_len)

    @torch.no_grad()
    def reset_inv_freq(self) -> None:
        inv_freq, self.attention_scaling = self._compute(self.config, self.inv_freq.device)
        init.copy_(self.inv_freq, inv_freq)
        init.copy_(self.original_inv_freq, inv_freq)

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # (B, T, r/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, r)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, e) -> (B, H_kv * n_rep, T, e), each key/value head repeated for the query heads of its group."""
    if n_rep == 1:
        return hidden_states
    b, h_kv, t, e = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h_kv, n_rep, t, e).reshape(b, h_kv * n_rep, t, e)


def pad_head_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (..., e) with zeros appended up to (..., width) (x itself when e == width)."""
    extra = width - x.shape[-1]
    return x if extra == 0 else F.pad(x, (0, extra))


def eager_attention_parts(query, key, value, attention_mask, scaling, dropout=0.0, training=False):
    """The eager attention kernel, the one home of its operations (the directional toolkit edits its output):
    A = softmax(q k^T * scaling + mask), o = A v for q (B, H, T, r), k (B, H_kv, S, r), v (B, H_kv, S, d_h), the
    key/value heads repeated for the query heads of their group. Returns (A (B, H, T, S), the repeated values
    (B, H, S, d_h), o (B, H, T, d_h))."""
    groups = query.shape[1] // key.shape[1]
    key_states = repeat_kv(key, groups)
    value_states = repeat_kv(value, groups)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=training)
    return attn_weights, value_states, torch.matmul(attn_weights, value_states)


def grouped_decode_attention(query, key, value, attention_mask, scaling):
    """softmax(q k^T * scaling + mask) v at one query position, for q (B, H, 1, r), k (B, H_kv, S, r),
    v (B, H_kv, S, d_h) of any widths r and d_h: the query heads of a group are the rows of one product with their
    key head (no repeated keys, no head-width padding), the softmax in float32. `attention_mask` as SDPA takes it:
    None, boolean (True attends) or additive, (B or 1, 1, 1, S). Returns (B, 1, H, d_h)."""
    b, h, t, r = query.shape
    if t != 1:
        raise ValueError(f"grouped_decode_attention takes one query position, got {t}")
    h_kv = key.shape[1]
    scores = torch.matmul(query.reshape(b, h_kv, h // h_kv, r), key.transpose(2, 3)) * scaling  # (B, H_kv, g, S)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(weights, value).reshape(b, 1, h, -1)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(q k^T * scaling + mask) v for q (B, H, T, r), k (B, H_kv, S, r), v (B, H_kv, S, d_h)."""
    attn_weights, _, attn_output = eager_attention_parts(
        query, key, value, attention_mask, scaling, dropout, module.training
    )
    return attn_output.transpose(1, 2).contiguous(), attn_weights  # (B, T, H, d_h), (B, H, T, S)


class RelationalAttention(nn.Module):
    """Multi-head attention with per-head QK forms of rank r and VO maps, stored in the configured gauge."""

    def __init__(self, config: RelationalConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = config.num_key_value_groups
        # per-layer widths (compression): value width r_v and QK width r_l; default head_dim and qk_rank
        self.head_dim, self.qk_rank = config.layer_value_rank(layer_idx), config.layer_qk_rank(layer_idx)
        self.scaling = self.qk_rank**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.rope = config.layer_rope(layer_idx)
        # partial rotary (GPT-NeoX): only the first rotary_dim coordinates turn; GL on the rest, the QK pair kept free
        self.rotary_dim = config.rotary_dim if self.rope else 0
        self.partial_rotary = 0 < self.rotary_dim < self.qk_rank
        self.value_parallel_removal = config.value_parallel_removal
        d, r, dh = config.hidden_size, self.qk_rank, self.head_dim
        pivot = config.gauge == "pivot"
        self.q_proj = nn.Linear(d, self.num_heads * r, bias=config.attention_bias)
        # per-head QK-norm (gains of r values shared by the heads): only rotations survive, W_K stays a plain map
        self.q_norm = RelationalRMSNorm(config.rms_norm_eps, r) if config.qk_norm else None
        self.k_norm = RelationalRMSNorm(config.rms_norm_eps, r) if config.qk_norm else None
        if pivot and not config.qk_norm and not self.partial_rotary:
            self.k_proj = GaugeFixedLinear(
                d,
                self.num_kv_heads * r,
                1 if self.rope else r,
                bias=config.attention_bias,
                pattern="rotary" if self.rope else "block",
                block=r,
                scale=config.pivot_scale,
            )
        else:
            self.k_proj = nn.Linear(d, self.num_kv_heads * r, bias=config.attention_bias)
        if pivot and not self.value_parallel_removal:
            self.v_proj = GaugeFixedLinear(
                d, self.num_kv_heads * dh, dh, bias=config.attention_bias, scale=config.pivot_scale
            )
        else:
            self.v_proj = nn.Linear(d, self.num_kv_heads * dh, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=config.attention_output_bias)
        if self.rope and config.layer_qk_ranks is not None:
            # which of the model's qk_rank / 2 rotary frequency pairs each key head of this layer keeps
            self.register_buffer("rope_pair_index", self.initial_rope_pairs())

    def initial_rope_pairs(self) -> torch.Tensor:
        """The rotary pairs a new compressed layer keeps: the first r_l / 2 for every key head."""
        half = self.qk_rank // 2
        return torch.arange(half, device=self.o_proj.weight.device).expand(self.num_kv_heads, half).contiguous()

    def gauge_pairs(self) -> tuple[tuple[nn.Linear, nn.Module], ...]:
        """(partner, map) for each factor pair with a gauge: (W_Q, W_K) and (W_O, W_V)."""
        return (self.q_proj, self.k_proj), (self.o_proj, self.v_proj)

    @torch.no_grad()
    def set_full_weights(self, weights: dict[str, torch.Tensor], *, fix_gauge: bool = False) -> None:
        """Load full (Linear-layout) q/k/v/o weights and optional biases, moving them to this module's gauge.

        Keys: q, k, v, o and optionally q_bias, k_bias, v_bias, o_bias. The function (all G_QK, G_VO, the rotary
        scores) is unchanged; in the pivot gauge only the free entries are stored. `fix_gauge`: in the free gauge
        too, store the pivot gauge's representative of the orbit (the full weights a pivot-gauge module computes
        with) rather than the weights as given, whose factors may be scaled arbitrarily against each other."""
        q, k, v, o = weights["q"], weights["k"], weights["v"], weights["o"]
        bq, bk, bv = weights.get("q_bias"), weights.get("k_bias"), weights.get("v_bias")
        scale = self.config.pivot_scale
        free = fix_gauge and self.config.gauge == "free"
        for key in ("q_norm", "k_norm"):  # QK-norm gains, stored as given (the QK pair then keeps its own gauge)
            if getattr(self, key) is not None:
                if key not in weights:
                    raise ValueError(f"set_full_weights: a QK-normed attention (qk_norm=True) needs the {key!r} gains")
                getattr(self, key).weight.copy_(weights[key])
        if isinstance(self.k_proj, GaugeFixedLinear) or (free and self.q_norm is None and not self.partial_rotary):
            q, k, bq, bk, idx, val = qk_to_pivot_gauge(
                q, k, bq, bk, num_kv_heads=self.num_kv_heads, rank=self.qk_rank, rope=self.rope, scale=scale
            )
            if isinstance(self.k_proj, GaugeFixedLinear):
                self.k_proj.set_layout(idx, val)
        if isinstance(self.v_proj, GaugeFixedLinear) or (free and not self.config.value_parallel_removal):
            v, o, bv, idx, val = vo_to_pivot_gauge(
                v, o, bv, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, scale=scale
            )
            if isinstance(self.v_proj, GaugeFixedLinear):
                self.v_proj.set_layout(idx, val)
        for module, w, b in ((self.q_proj, q, bq), (self.k_proj, k, bk), (self.v_proj, v, bv)):
            write_full_weight(module, w, b)
        write_full_weight(self.o_proj, o, weights.get("o_bias"))

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full (Linear-layout) q/k/v/o weights and biases this module computes with."""
        out = {}
        for key, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            module = getattr(self, name)
            out[key] = full_weight(module)
            if module.bias is not None:
                out[f"{key}_bias"] = module.bias
        if self.q_norm is not None:
            out["q_norm"], out["k_norm"] = self.q_norm.weight, self.k_norm.weight
        return out

    def rotary_layout(self, device: torch.device) -> tuple[tuple[torch.Tensor, ...], bool]:
        """(`rotary_layout` of this layer's rotary pairs on `device`, whether they are all the model's pairs in order),
        from `rope_pair_index` (all pairs in order when the layer has none); kept until the pairs are edited or
        replaced."""
        pairs = getattr(self, "rope_pair_index", None)
        key = (device,) if pairs is None else (device, pairs.data_ptr(), pairs._version)
        cached = self.__dict__.get("_rotary_layout")
        if cached is None or cached[0] != key:
            ordered = torch.arange(self.qk_rank // 2).expand(self.num_kv_heads, -1)
            plain = pairs is None or (
                2 * pairs.shape[1] == self.config.qk_rank and bool((pairs.cpu() == ordered).all())
            )
            layout = rotary_layout((ordered if pairs is None else pairs).to(device), self.num_heads)
            cached = (key, (layout, plain))
            self.__dict__["_rotary_layout"] = cached
        return cached[1]

    def kernel_width(self, implementation: str | None = None) -> int | None:
        """The common head width the fused attention kernels get, or None when q/k and v are passed as they are.

        The fused kernels (SDPA's flash and memory-efficient paths, flash-attention) need one head width for q, k and
        v; with a QK rank r different from the value width d_h (a compressed layer) SDPA falls back to its unfused
        math path (about 3x slower at 512 tokens on a CPU). Zero columns appended to q and k leave every score
        q.k unchanged (the scaling is r^-1/2, passed explicitly), zero columns appended to v give zero output
        columns, cut off again: the result is the same attention. Eager attention takes any widths, and so does
        `grouped_decode_attention`, which SDPA's decoding steps of such a layer take instead (one query position:
        no padding, no repeated keys). `implementation`: the configured attention implementation, when the caller
        has read it."""
        if self.qk_rank == self.head_dim:
            return None
        if (implementation or self.config._attn_implementation) in (None, "eager"):
            return None
        return max(self.qk_rank, self.head_dim)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]  # (B, T)
        query, key = self.q_proj(hidden_states), self.k_proj(hidden_states)  # (B, T, H r), (B, T, H_kv r)
        if self.q_norm is not None:  # per head, before the rotary embedding
            query = self.q_norm(query.unflatten(-1, (-1, self.qk_rank))).flatten(-2)
            key = self.k_norm(key.unflatten(-1, (-1, self.qk_rank))).flatten(-2)
        if self.rope:
            cos, sin = position_embeddings
            layout, plain = self.rotary_layout(cos.device)
        decode = self.rope and input_shape[-1] == 1 and not self.partial_rotary
        if decode:  # a decoding step: one flat rotation of [q | k], the fewest operators
            qk = apply_rotary(torch.cat((query, key), dim=-1), cos, sin, layout)
            query, key = qk.split((query.shape[-1], key.shape[-1]), dim=-1)
        query = query.view(*input_shape, -1, self.qk_rank).transpose(1, 2)  # (B, H, T, r)
        key = key.view(*input_shape, -1, self.qk_rank).transpose(1, 2)  # (B, H_kv, T, r)
        if self.rope and not decode:
            if self.partial_rotary:
                query, key = apply_partial_rotary(query, key, cos, sin, self.rotary_dim)
            elif plain:
                query, key = apply_rotary_pos_emb(query, key, cos, sin)
            else:
                n = key.shape[1] * self.qk_rank  # the key heads' part of the layout
                query, key = apply_rotary_pair_subset(query, key, cos, sin, layout[0][-n:], layout[2][-n:])
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, d_h)
        own_value = value
        if cache is not None:  # keys and values at their own widths: a thin-key cache stays thin
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        implementation = self.config._attn_implementation
        width = self.kernel_width(implementation)
        dropout = self.attention_dropout if self.training else 0.0
        if width is not None and query.shape[2] == 1 and not dropout and implementation == "sdpa":
            attn_output, attn_weights = grouped_decode_attention(query, key, value, attention_mask, self.scaling), None
        else:
            if width is not None:  # one head width for the fused kernels, padded for this call only
                query, key, value = (pad_head_width(x, width) for x in (query, key, value))
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                implementation, eager_attention_forward
            )
            attn_output, attn_weights = attention_interface(
                self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
            )  # (B, T, H, d_h)
            if width is not None:
                attn_output = attn_output[..., : self.head_dim]
        if self.value_parallel_removal:
            v_t = repeat_kv(own_value, self.num_key_value_groups).transpose(1, 2)  # (B, T, H, d_h)
            attn_output = attn_output - parallel_component(attn_output, v_t)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (B, T, H d_h)
        return self.o_proj(attn_output), attn_weights


class RelationalMLP(nn.Module):
    """SwiGLU: (act(x W_gate) * (x W_up)) W_down, W_up in the pivot gauge when configured (d_ff scales fixed)."""

    def __init__(self, config: RelationalConfig, layer_idx: int | None = None) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        f = config.intermediate_size if layer_idx is None else config.layer_intermediate_size(layer_idx)
        self.gate_proj = nn.Linear(d, f, bias=False)
        if config.gauge == "pivot":
            self.up_proj = GaugeFixedLinear(d, f, 1, scale=config.pivot_scale)
        else:
            self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    @torch.no_grad()
    def set_full_weights(self, weights: dict[str, torch.Tensor], *, fix_gauge: bool = False) -> None:
        """Load full gate/up/down weights (Linear layout), moving the scales to this module's gauge (`fix_gauge`: in
        the free gauge too, as the attention's)."""
        up, down = weights["up"], weights["down"]
        if isinstance(self.up_proj, GaugeFixedLinear) or (fix_gauge and self.config.gauge == "free"):
            up, down, idx, val = mlp_to_pivot_gauge(up, down, scale=self.config.pivot_scale)
            if isinstance(self.up_proj, GaugeFixedLinear):
                self.up_proj.set_layout(idx, val)
        for module, w in ((self.gate_proj, weights["gate"]), (self.up_proj, up), (self.down_proj, down)):
            write_full_weight(module, w)

    def gauge_pairs(self) -> tuple[tuple[nn.Linear, nn.Module], ...]:
        """(partner, map) for the factor pair with a gauge: (W_down, W_up)."""
        return ((self.down_proj, self.up_proj),)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full gate/up/down weights (Linear layout)."""
        return {"gate": self.gate_proj.weight, "up": full_weight(self.up_proj), "down": self.down_proj.weight}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RelationalDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: h + Attn(norm(h)), then h + MLP(norm(h)), with gain-free norms (`parallel_residual`:
    h + Attn(norm(h)) + MLP(norm'(h))). `sandwich_norms`: each sublayer's output goes through a norm with a gain
    before the add (Gemma 3), h + N_a(Attn(norm(h))), a gain the residual rotation must commute with."""

    def __init__(self, config: RelationalConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = RelationalAttention(config, layer_idx)
        self.mlp = (RelationalMLP if config.mlp_gated else RelationalPlainMLP)(config, layer_idx)
        self.input_layernorm = RelationalRMSNorm(config.rms_norm_eps)
        self.post_attention_layernorm = RelationalRMSNorm(config.rms_norm_eps)
        self.parallel_residual = config.parallel_residual
        sandwich = config.hidden_size if config.sandwich_norms else None
        self.attention_output_norm = RelationalRMSNorm(config.rms_norm_eps, sandwich) if sandwich else None
        self.mlp_output_norm = RelationalRMSNorm(config.rms_norm_eps, sandwich) if sandwich else None

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.attention_update(
            residual,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if self.parallel_residual:  # GPT-NeoX: the attention and the MLP both read the layer input
            return residual + hidden_states + self._mlp_update(residual)
        hidden_states = residual + hidden_states
        return hidden_states + self._mlp_update(hidden_states)

    def attention_update(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """What the attention adds to the stream h: Attn(norm(h)), through its sandwich norm when there is one."""
        update, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        return update if self.attention_output_norm is None else self.attention_output_norm(update)

    def _mlp_update(self, hidden_states: torch.Tensor) -> torch.Tensor:
        update = self.mlp(self.post_attention_layernorm(hidden_states))
        return update if self.mlp_output_norm is None else self.mlp_output_norm(update)


def follow_device_map(model: nn.Module) -> None:
    """Switch off the assembled weights that gauge-fixed layers keep for inference (`GaugeFixedLinear`) in a model
    that Accelerate offloads (a `hf_device_map` with "disk", or with "cpu" beside an accelerator): its hooks bring each
    offloaded layer's weights in for one call, and a kept copy per layer would hold them all in memory again. Cheap
    when the placement has not changed."""
    device_map = getattr(model, "hf_device_map", None) or {}
    places = {str(v) for v in device_map.values()}
    offloaded = "disk" in places or ("cpu" in places and len(places) > 1)
    if model.__dict__.get("_offloaded_weights", False) != offloaded:
        for module in model.modules():
            if isinstance(module, GaugeFixedLinear):
                module._offloaded = offloaded
                module._drop_caches()
        model.__dict__["_offloaded_weights"] = offloaded


class RelationalPreTrainedModel(PreTrainedModel):
    config_class = RelationalConfig
    config: RelationalConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RelationalDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": RelationalDecoderLayer, "attentions": RelationalAttention}

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # Attention and MLP hold no parameter of their own, so the generic custom-code shortcut would skip them, but
        # they draw the partner factors of their gauge-fixed maps (see _init_weights)
        done = getattr(module, "_is_hf_initialized", False)
        if isinstance(module, (RelationalAttention, RelationalMLP)) and not done:
            self._init_weights(module)
            module._is_hf_initialized = True
            return
        super()._initialize_weights(module, is_custom_code)

    def __init__(self, config: RelationalConfig, *inputs, **kwargs) -> None:
        config.validate()  # fields edited after construction are checked together before anything is built
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, strict about relational checkpoints (`modeling_checkpoint.py`): a local
        checkpoint directory whose weights file is missing, unreadable or truncated, or holds a tensor whose shape
        disagrees with the config, is one clear error naming the file. Missing or unexpected tensors are what every
        Transformers model reports: with `output_loading_info=True` the model loads, the missing tensors initialised,
        and the report (also logged as a warning) names them; without it, a checkpoint that does not hold exactly the
        tensors its config describes is refused with a ValueError naming them, never completed with random weights.
        Only a task head may differ, as for every Transformers model: a head absent from the checkpoint of another
        architecture is initialised (e.g. `score` when loading a causal-LM checkpoint for sequence classification),
        and an unused head is skipped. Tensors passed as `state_dict` without a checkpoint load as in Transformers."""
        subfolder = kwargs.get("subfolder", "") or ""
        folder = os.path.join(str(pretrained_model_name_or_path), subfolder)
        if pretrained_model_name_or_path is not None and os.path.isdir(folder):
            check_checkpoint_dir(cls, folder)
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        if not want_info and pretrained_model_name_or_path is not None:
            raise_on_key_differences(model, info, pretrained_model_name_or_path, subfolder)
        for module in model.modules():
            if isinstance(module, GaugeFixedLinear):
                module._sync_layout()
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`. A module whose pivot entries no longer hold the canonical values (e.g.
        after PEFT's `merge_and_unload`, which writes merged values there) is first moved back into the canonical
        pivot gauge with the same function (`set_full_weights(full_weights())`), so the checkpoint stores the compact
        layout only."""
        regauge_noncanonical(self)
        odd = [n for n, m in self.named_modules() if isinstance(m, GaugeFixedLinear) and not m.is_canonical]
        if odd:  # a module whose pattern its parent cannot restore: refuse rather than write what will not load
            raise ValueError(f"cannot save: gauge-fixed modules with a layout outside their canonical pattern: {odd}")
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, initializer_range) for the embedding and every plain factor, as in Llama; the pivot gauge is
        initialised in a layout derived from the config (`GaugeFixedLinear.initial_pivots`, pivots spread over the
        residual coordinates) with its free entries and their partner factors (W_Q, W_O, W_down) drawn so that every
        entry of G_QK, G_VO and of each SwiGLU unit's product has the free model's second moment
        (`GaugeFixedLinear.init_stds`). Buffers are never drawn: `init_weights()` after `to_empty()` rebuilds exactly
        the layouts the constructor builds. Each tensor is written only when it was not loaded (Transformers'
        `initialization` functions), so `from_pretrained` fills exactly the missing ones."""
        std = self.config.initializer_range
        if isinstance(module, GaugeFixedLinear):
            init.copy_(module.pivots, module.initial_pivots())
            module._sync_layout()  # the derived (non-persistent) buffers follow the pivots, loaded or not
            init.normal_(module.weight, std=module.init_stds(std)[0])
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (RelationalAttention, RelationalMLP)):
            # children come first: a partner drawn N(0, std^2) above is drawn again with the matched std
            for partner, gauge_fixed in module.gauge_pairs():
                if isinstance(gauge_fixed, GaugeFixedLinear):
                    init.normal_(partner.weight, std=gauge_fixed.init_stds(std)[1])
            if getattr(module, "rope_pair_index", None) is not None:
                init.copy_(module.rope_pair_index, module.initial_rope_pairs())
        elif isinstance(module, RelationalRotaryEmbedding):
            module.reset_inv_freq()
        elif isinstance(module, RelationalRMSNorm):
            if module.weight is not None:
                init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        else:
            super()._init_weights(module)


class RelationalModel(RelationalPreTrainedModel):
    """Embedding, decoder layers, final norm (gain-free, or with a gain vector when `config.final_norm_gain`)."""

    def __init__(self, config: RelationalConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([RelationalDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        d = config.hidden_size
        self.norm = RelationalRMSNorm(
            config.rms_norm_eps, d if config.final_norm_gain else None, *([d] if config.final_norm_bias else [])
        )
        self.embed_positions = position_table(config)  # absolute positions (position_encoding="learned")
        self.rotary_emb = RelationalRotaryEmbedding(config) if config.position_encoding == "rope" else None
        local = config.sliding_rope_parameters  # the sliding layers' own rotary table (Gemma 3's local base)
        self.sliding_rotary_emb = RelationalRotaryEmbedding(config, local) if local is not None else None
        self.gradient_checkpointing = False
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        follow_device_map(self)
        if inputs_embeds is None:
            if not torch.compiler.is_compiling():  # a data-dependent check: eager only (compiled graphs stay whole)
                _check_token_ids(input_ids, self.embed_tokens.num_embeddings)
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens)[None]
        inputs_embeds = embed_input(self.config, inputs_embeds, self.embed_positions, position_ids)
        masks = layer_masks(
            self.config, attention_mask, inputs_embeds=inputs_embeds, cache=cache, position_ids=position_ids
        )  # one per layer: full causal, or through the sliding window (`layer_types`)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        local = self.sliding_rotary_emb
        local = position_embeddings if local is None else local(hidden_states, position_ids)
        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[i],
                position_embeddings=local if self.config.layer_sliding(i) else position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


def _check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise a clear ValueError for token ids outside [0, vocab_size), or for no token at all, instead of an index or
    reshape error inside torch.

    `vocab_size` is the embedding's current row count, so it follows `resize_token_embeddings`. The check reads the
    ids' min and max (a device synchronisation), so the forward runs it in eager mode only: under `torch.compile` an
    out-of-range id fails inside the embedding lookup as in any Transformers model."""
    if input_ids.numel() == 0:
        raise ValueError(
            f"input_ids holds no token (shape {tuple(input_ids.shape)}): the model needs at least one token per "
            "sequence (for generate(), a prompt such as the BOS token)."
        )
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contain token id {bad}, outside the vocabulary [0, {vocab_size}).")


class RelationalForCausalLM(RelationalPreTrainedModel, GenerationMixin):
    """Relational model with a language-modelling head (tied to the embedding by default)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    create_masks_for_generate = staticmethod(create_masks_for_generate)  # per layer type (`layer_types`)

    def __init__(self, config: RelationalConfig) -> None:
        super().__init__(config)
        self.model = RelationalModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        follow_device_map(self)
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])  # (B, T, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, with the assembled gauge-fixed weights kept between decoding steps
        (`weight_cache`): the weights cannot change during a generation."""
        with weight_cache(self):
            return super().generate(*args, **kwargs)


class RelationalForSequenceClassification(GenericForSequenceClassification, RelationalPreTrainedModel):
    """Relational model with a linear score head on the last non-padding token."""

    def __init__(self, config: RelationalConfig) -> None:
        RelationalPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = RelationalModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


def register_static_names() -> None:
    """Add the model type to Transformers' static name tables, which decide some generic behaviour by class name (the
    Trainer shifts labels for label smoothing only for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES; pipelines check
    task support there). Run on import of this file, so a model loaded with ``trust_remote_code`` (without
    relational_hf) is treated as a causal LM too. Idempotent; existing entries are never replaced."""
    from transformers.models.auto import modeling_auto

    model_type = RelationalConfig.model_type
    modeling_auto.MODEL_MAPPING_NAMES.setdefault(model_type, RelationalModel.__name__)
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(model_type, RelationalForCausalLM.__name__)
    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.setdefault(
        model_type, RelationalForSequenceClassification.__name__
    )


register_static_names()

__all__ = [
    "RelationalPreTrainedModel",
    "RelationalModel",
    "RelationalForCausalLM",
    "RelationalForSequenceClassification",
    "register_static_names",
]
