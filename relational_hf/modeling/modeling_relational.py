"""The relational transformer: a Llama-like decoder written in invariant, gauge-fixed parameters.

Notation (DESIGN.md): row vectors, residual stream X (n x d), H query heads of value width d_h, H_kv key/value
heads, per head a QK bilinear form G_QK = W_Q W_K^T of rank r = ``qk_rank`` and a VO map G_VO = W_V W_O.
Weights are kept in ``nn.Linear`` layout (out x in), i.e. ``k_proj.weight`` holds W_K^T for every head.

What is gauge-fixed when ``config.gauge == "pivot"`` (no redundant coordinate left for these groups):
- QK, no rotary: W_K[P] = c I_r on r pivot rows P per key head (GL(r), r^2 per key head);
- QK, rotary: per frequency pair one pivot 2-vector normalised to (c, 0) (the RoPE commutant, r per key head);
- VO: W_V[P] = c I_{d_h} (GL(d_h), d_h^2 per key/value head), unless value-space parallel removal is on;
- SwiGLU: one pivot entry per hidden unit of W_up equal to c (d_ff per layer);
- norm gains: absent (gain-free RMS normalisation).
The residual rotation O(d) is left free (its canonical form is the principal gauge of the symmetry toolkit).

This file travels to the Hub (``trust_remote_code``): it imports only torch, transformers and its sibling.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_relational import RelationalConfig

logger = logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Geometry shared by the model, the trainer and the analysis tools (one home for each formula)
# ----------------------------------------------------------------------------------------------------------------


def parallel_coefficient(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """alpha = y.z / |z|^2 over the last dimension (computed in fp32, 0 where z = 0). Shape: y.shape[:-1] + (1,)."""
    yf, zf = y.float(), z.float()
    denom = (zf * zf).sum(-1, keepdim=True)
    return (yf * zf).sum(-1, keepdim=True) / denom.clamp_min(torch.finfo(torch.float32).tiny)


def parallel_component(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """y_par = (y.z / |z|^2) z, the part of y along the reference z (last dimension); y_perp = y - y_par."""
    return (parallel_coefficient(y, z) * z.float()).to(y.dtype)


def scale_parallel(y: torch.Tensor, z: torch.Tensor, parallel: float = 1.0, perpendicular: float = 1.0) -> torch.Tensor:
    """The component edit y~ = s_par y_par + s_perp y_perp with respect to the reference z."""
    y_par = parallel_component(y, z)
    return parallel * y_par + perpendicular * (y - y_par)


def max_volume_rows(w: torch.Tensor, rank: int) -> torch.Tensor:
    """Indices of `rank` well-conditioned pivot rows of each matrix in a batch w (..., n, r).

    Greedy column-pivoted QR of w^T (max-volume heuristic): repeatedly take the row with the largest residual
    norm and remove its direction from the others. Returns a long tensor (..., rank), each row distinct.
    """
    residual = w.detach().double().clone()
    picked = []
    taken = torch.zeros(residual.shape[:-1], dtype=torch.bool, device=w.device)
    for _ in range(rank):
        norms = residual.pow(2).sum(-1).masked_fill(taken, -1.0)
        idx = norms.argmax(-1)  # (...)
        picked.append(idx)
        taken.scatter_(-1, idx.unsqueeze(-1), True)
        pivot = torch.gather(residual, -2, idx[..., None, None].expand(*idx.shape, 1, residual.shape[-1]))
        unit = pivot / pivot.norm(dim=-1, keepdim=True).clamp_min(1e-300)  # (..., 1, r)
        residual = residual - (residual * unit).sum(-1, keepdim=True) * unit
    return torch.stack(picked, dim=-1)


def identity_pivot_layout(pivots: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed entries of a block gauge W[P] = c I: for heads (..., r) of pivot rows, output coordinate j of a head
    has the r fixed entries W[P_i, j] = c delta_ij. Returns (fixed_index, fixed_value), each (..., r, r)."""
    r = pivots.shape[-1]
    fixed_index = pivots.unsqueeze(-2).expand(*pivots.shape[:-1], r, r)
    fixed_value = scale * torch.eye(r, dtype=torch.float32, device=pivots.device).expand(*pivots.shape[:-1], r, r)
    return fixed_index.contiguous(), fixed_value.contiguous()


def complex_pair_gauge(w: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE-commutant gauge of key factors w (..., r, d) in Linear layout, pairs (j, j + r/2) read as complex rows
    w_j = w[j] + i w[j + r/2]. Picks per pair the input coordinate p_j of largest modulus and the complex scalar
    z_j = c / w_j[p_j] that makes that entry (c, 0). Returns (pivots (..., r/2), z (..., r/2) complex)."""
    half = w.shape[-2] // 2
    wc = torch.complex(w[..., :half, :].double(), w[..., half:, :].double())  # (..., r/2, d)
    pivots = wc.abs().argmax(-1)  # (..., r/2)
    at_pivot = torch.gather(wc, -1, pivots.unsqueeze(-1)).squeeze(-1)
    return pivots, scale / at_pivot


def complex_pair_matrix(z: torch.Tensor) -> torch.Tensor:
    """Real (r x r) matrix M with k -> k M multiplying each rotary pair (k_j + i k_{j+r/2}) by z_j (row vectors)."""
    half = z.shape[-1]
    a, b = z.real, z.imag
    m = torch.zeros(*z.shape[:-1], 2 * half, 2 * half, dtype=a.dtype, device=z.device)
    j = torch.arange(half, device=z.device)
    m[..., j, j] = a
    m[..., j + half, j + half] = a
    m[..., j, j + half] = b
    m[..., j + half, j] = -b
    return m


def rope_pivot_layout(pivots: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed entries of the rotary pivot gauge: for each pair j, W[p_j, j] = c and W[p_j, j + r/2] = 0.
    Returns (fixed_index, fixed_value), each (..., r, 1)."""
    fixed_index = torch.cat([pivots, pivots], dim=-1).unsqueeze(-1)
    value = torch.zeros(fixed_index.shape, dtype=torch.float32, device=pivots.device)
    value[..., : pivots.shape[-1], :] = scale
    return fixed_index, value


# Buffers that record a gauge layout (which entries are fixed, and to what) or, after compression, which rotary
# pairs a layer keeps: saved with the weights, not parameters.
GAUGE_LAYOUT_BUFFERS = ("fixed_index", "free_index", "fixed_value", "rope_pair_index")


class GaugeFixedLinear(nn.Module):
    """A linear map whose weight W (out x in) has, in every output row, m entries fixed by a gauge choice.

    Forward map (free parameters -> weight): W[o, fixed_index[o]] = fixed_value[o], W[o, free_index[o]] = weight[o].
    Only `weight` (out x (in - m)) is stored as a parameter; the indices and fixed values are buffers saved with
    the checkpoint. `set_full_weight` is the right inverse for a W already in the gauge. The setters write with a
    plain in-place copy, so they also act on a model loaded with `from_pretrained` (whose tensors Transformers
    flags as initialised).
    """

    def __init__(self, in_features: int, out_features: int, fixed_per_row: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fixed_per_row = in_features, out_features, fixed_per_row
        self.weight = nn.Parameter(torch.empty(out_features, in_features - fixed_per_row))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        fixed = torch.arange(fixed_per_row).expand(out_features, fixed_per_row)
        free = torch.arange(fixed_per_row, in_features).expand(out_features, in_features - fixed_per_row)
        self.register_buffer("fixed_index", fixed.contiguous())
        self.register_buffer("free_index", free.contiguous())
        self.register_buffer("fixed_value", torch.zeros(out_features, fixed_per_row))

    def full_weight(self) -> torch.Tensor:
        """The full (out x in) weight W assembled from the free entries and the fixed pivot entries.

        Without autograd (inference, decoding) the assembled weight is cached until the parameter or the layout
        changes (tracked by tensor version counters), so decoding reads one weight per step like a plain Linear."""
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return self._assemble()
        key = (
            self.weight._version,
            self.weight.data_ptr(),
            self.weight.dtype,
            self.fixed_index._version,
            self.free_index._version,
            self.fixed_value._version,
            self.fixed_value.data_ptr(),
        )
        cached = self.__dict__.get("_weight_cache")
        if cached is None or cached[0] != key:
            cached = (key, self._assemble().detach())
            self.__dict__["_weight_cache"] = cached
        return cached[1]

    def _assemble(self) -> torch.Tensor:
        # one out-of-place scatter of the free entries into a constant holding the pivots (cached per layout):
        # its backward is a single gather, the constant needs none
        return self._pivot_base().scatter(1, self.free_index, self.weight)

    def _pivot_base(self) -> torch.Tensor:
        """The (out x in) constant with the fixed values at the pivots and zeros elsewhere, rebuilt when the layout,
        dtype or device changes."""
        key = (
            self.weight.dtype,
            self.weight.device,
            self.fixed_index._version,
            self.fixed_index.data_ptr(),
            self.fixed_value._version,
            self.fixed_value.data_ptr(),
        )
        cached = self.__dict__.get("_base_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                base = torch.zeros(
                    self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device
                )
                base.scatter_(1, self.fixed_index, self.fixed_value.to(self.weight.dtype))
            cached = (key, base)
            self.__dict__["_base_cache"] = cached
        return cached[1]

    @torch.no_grad()
    def set_layout(self, fixed_index: torch.Tensor, fixed_value: torch.Tensor) -> None:
        """Install a new gauge layout: fixed_index, fixed_value (out x m); the free indices are the rest."""
        fixed_index = fixed_index.to(self.fixed_index.device, torch.long).reshape(self.out_features, self.fixed_per_row)
        mask = torch.ones(self.out_features, self.in_features, dtype=torch.bool, device=fixed_index.device)
        mask.scatter_(1, fixed_index, False)
        free = torch.arange(self.in_features, device=mask.device).expand_as(mask)[mask]
        self.fixed_index.copy_(fixed_index)
        self.free_index.copy_(free.view(self.out_features, -1))
        self.fixed_value.copy_(fixed_value.reshape(self.out_features, self.fixed_per_row).to(self.fixed_value))

    @torch.no_grad()
    def set_full_weight(self, w: torch.Tensor, check: bool = True) -> None:
        """Store the free entries of a full weight w that is already in this module's gauge."""
        if check:
            fixed = torch.gather(w.float(), 1, self.fixed_index)
            err = (fixed - self.fixed_value.float()).abs().max().item() if fixed.numel() else 0.0
            if err > 1e-4 * max(1.0, self.fixed_value.abs().max().item()):
                raise ValueError(f"weight is not in this module's pivot gauge (pivot entries off by {err:.3g})")
        self.weight.copy_(torch.gather(w, 1, self.free_index).to(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.full_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fixed_per_row={self.fixed_per_row}"


def full_weight(module: nn.Module) -> torch.Tensor:
    """The full (out x in) weight of an nn.Linear or a GaugeFixedLinear."""
    return module.full_weight() if isinstance(module, GaugeFixedLinear) else module.weight


def _solve_right(w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """w A^-1 for batched square A (w: (..., m, r), A: (..., r, r))."""
    return torch.linalg.solve(a, w, left=False)


def qk_to_pivot_gauge(
    wq: torch.Tensor,
    wk: torch.Tensor,
    bq: torch.Tensor | None,
    bk: torch.Tensor | None,
    *,
    num_kv_heads: int,
    rank: int,
    rope: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Move a QK pair to the pivot gauge with the same bilinear forms G_QK = W_Q W_K^T (and rotary scores).

    wq: (H r, d), wk: (H_kv r, d) in Linear layout; biases (H r,), (H_kv r,). Each key head's gauge
    A (r x r; the RoPE commutant if `rope`) acts as W_K -> W_K A, W_Q -> W_Q A^-T for the query heads of its group,
    b_K -> b_K A, b_Q -> b_Q A^-T. Returns (wq, wk, bq, bk, fixed_index, fixed_value) with wk in the gauge.
    """
    d = wk.shape[-1]
    g = wq.shape[0] // (rank * num_kv_heads)
    dtype = wk.dtype
    k = wk.double().view(num_kv_heads, rank, d)  # (H_kv, r, d) = W_K^T per head
    if rope:
        pivots, z = complex_pair_gauge(k, scale)
        a = complex_pair_matrix(z)  # (H_kv, r, r)
        fixed_index, fixed_value = rope_pivot_layout(pivots, scale)
    else:
        pivots = max_volume_rows(k.transpose(1, 2), rank)  # rows of W_K (d x r)
        block = torch.gather(k, 2, pivots.unsqueeze(1).expand(num_kv_heads, rank, rank))  # W_K[P]^T (H_kv, r, r)
        a = scale * torch.linalg.inv(block.transpose(1, 2))  # A = c W_K[P]^-1
        fixed_index, fixed_value = identity_pivot_layout(pivots, scale)
    k_new = a.transpose(1, 2) @ k  # (W_K A)^T = A^T W_K^T
    q = wq.double().view(num_kv_heads, g, rank, d)
    a_inv_t = torch.linalg.inv(a).transpose(1, 2)  # A^-T
    q_new = a_inv_t.transpose(1, 2).unsqueeze(1) @ q  # (W_Q A^-T)^T = A^-1 W_Q^T
    bk_new = bq_new = None
    if bk is not None:
        bk_new = (bk.double().view(num_kv_heads, 1, rank) @ a).reshape(-1).to(bk.dtype)
    if bq is not None:
        bq_new = (bq.double().view(num_kv_heads, g, 1, rank) @ a_inv_t.unsqueeze(1)).reshape(-1).to(bq.dtype)
    return (
        q_new.reshape(-1, d).to(dtype),
        k_new.reshape(-1, d).to(dtype),
        bq_new,
        bk_new,
        fixed_index.reshape(num_kv_heads * rank, -1),
        fixed_value.reshape(num_kv_heads * rank, -1),
    )


def vo_to_pivot_gauge(
    wv: torch.Tensor,
    wo: torch.Tensor,
    bv: torch.Tensor | None,
    *,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Move a VO pair to the pivot gauge W_V[P] = c I with the same maps G_VO = W_V W_O.

    wv: (H_kv d_h, d), wo: (d, H d_h) in Linear layout. B = c W_V[P]^-1 per key/value head acts as W_V -> W_V B,
    W_O -> B^-1 W_O for each query head of the group, b_V -> b_V B. Returns (wv, wo, bv, fixed_index, fixed_value).
    """
    d = wv.shape[-1]
    g = wo.shape[1] // (head_dim * num_kv_heads)
    v = wv.double().view(num_kv_heads, head_dim, d)  # W_V^T per head
    pivots = max_volume_rows(v.transpose(1, 2), head_dim)
    block = torch.gather(v, 2, pivots.unsqueeze(1).expand(num_kv_heads, head_dim, head_dim))  # W_V[P]^T
    b = scale * torch.linalg.inv(block.transpose(1, 2))  # (H_kv, d_h, d_h)
    v_new = b.transpose(1, 2) @ v
    o = wo.double().view(d, num_kv_heads, g, head_dim).permute(1, 2, 3, 0)  # W_O per head (H_kv, g, d_h, d)
    o_new = _solve_right(o.transpose(-1, -2), b.unsqueeze(1).transpose(-1, -2)).transpose(-1, -2)
    # o_new = B^-1 W_O  (solve B X = W_O written through X^T B^T = W_O^T)
    o_new = o_new.permute(3, 0, 1, 2).reshape(d, -1)
    bv_new = None if bv is None else (bv.double().view(num_kv_heads, 1, head_dim) @ b).reshape(-1).to(bv.dtype)
    fixed_index, fixed_value = identity_pivot_layout(pivots, scale)
    return (
        v_new.reshape(-1, d).to(wv.dtype),
        o_new.to(wo.dtype),
        bv_new,
        fixed_index.reshape(num_kv_heads * head_dim, -1),
        fixed_value.reshape(num_kv_heads * head_dim, -1),
    )


def mlp_to_pivot_gauge(
    w_up: torch.Tensor, w_down: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fix the SwiGLU scaling gauge: hidden unit k gets W_up[k, p_k] = c (p_k its largest entry), W_down[:, k] / c_k.

    w_up: (d_ff, d), w_down: (d, d_ff) in Linear layout. Returns (w_up, w_down, fixed_index, fixed_value)."""
    pivots = w_up.abs().argmax(-1, keepdim=True)  # (d_ff, 1)
    at_pivot = torch.gather(w_up.double(), 1, pivots)  # (d_ff, 1)
    c = scale / at_pivot
    up_new = (w_up.double() * c).to(w_up.dtype)
    down_new = (w_down.double() / c.T).to(w_down.dtype)
    return up_new, down_new, pivots, torch.full(pivots.shape, float(scale))


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


class RelationalRMSNorm(nn.Module):
    """RMS normalisation x / sqrt(mean(x^2) + eps), gain-free by default: the gains of a standard RMSNorm in front of
    linear readers are pure gauge. `hidden_size` adds a gain vector (initialised to ones) for the one place where
    it is not: the final norm in front of a head tied to the embedding (`RelationalConfig.final_norm_gain`)."""

    def __init__(self, eps: float = 1e-6, hidden_size: int | None = None) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size)) if hidden_size is not None else None

    def normalize(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The gain-free part: x / sqrt(mean(x^2) + eps), computed in fp32, returned in the input dtype."""
        h = hidden_states.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(hidden_states.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.normalize(hidden_states)
        return h if self.weight is None else self.weight * h

    def extra_repr(self) -> str:
        gain = f"{self.weight.shape[0]}, " if self.weight is not None else ""
        return f"{gain}eps={self.variance_epsilon}"


class RelationalRotaryEmbedding(nn.Module):
    """Rotary angles for the r = qk_rank query/key coordinates, any Transformers rope type."""

    def __init__(self, config: RelationalConfig) -> None:
        super().__init__()
        rope_config = copy.copy(config)
        rope_config.head_dim = config.qk_rank  # the rotary dimension is the QK width
        self.config = rope_config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self._compute(rope_config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def _compute(self, config, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            base = config.rope_parameters.get("rope_theta", 10000.0)
            dim = config.head_dim
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension (pairs j, j + r/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate q (B, H, T, r) and k (B, H_kv, T, r) by the angles cos/sin (B, T, r)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def apply_rotary_pair_subset(q, k, cos, sin, pairs):
    """Rotate q (B, H, T, r) and k (B, H_kv, T, r) when key head h keeps only the rotary frequency pairs
    pairs[h] (H_kv, r/2) of the model's table cos/sin (B, T, R): coordinate j and j + r/2 of head h turn with the
    frequency of pair pairs[h, j]; each query head uses its key head's pairs."""
    half = cos.shape[-1] // 2

    def per_head(table: torch.Tensor) -> torch.Tensor:
        t = table[..., :half][..., pairs]  # (B, T, H_kv, r/2)
        return torch.cat((t, t), dim=-1).transpose(1, 2)  # (B, H_kv, T, r)

    cos_k, sin_k = per_head(cos), per_head(sin)
    g = q.shape[1] // k.shape[1]
    cos_q, sin_q = repeat_kv(cos_k, g), repeat_kv(sin_k, g)
    return q * cos_q + rotate_half(q) * sin_q, k * cos_k + rotate_half(k) * sin_k


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, e) -> (B, H_kv * n_rep, T, e), each key/value head repeated for the query heads of its group."""
    if n_rep == 1:
        return hidden_states
    b, h_kv, t, e = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h_kv, n_rep, t, e).reshape(b, h_kv * n_rep, t, e)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(q k^T * scaling + mask) v for q (B, H, T, r), k (B, H_kv, S, r), v (B, H_kv, S, d_h)."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()  # (B, T, H, d_h)
    return attn_output, attn_weights


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
        self.rope = config.position_encoding == "rope"
        self.value_parallel_removal = config.value_parallel_removal
        d, r, dh = config.hidden_size, self.qk_rank, self.head_dim
        pivot = config.gauge == "pivot"
        self.q_proj = nn.Linear(d, self.num_heads * r, bias=config.attention_bias)
        if pivot:
            self.k_proj = GaugeFixedLinear(d, self.num_kv_heads * r, 1 if self.rope else r, bias=config.attention_bias)
        else:
            self.k_proj = nn.Linear(d, self.num_kv_heads * r, bias=config.attention_bias)
        if pivot and not self.value_parallel_removal:
            self.v_proj = GaugeFixedLinear(d, self.num_kv_heads * dh, dh, bias=config.attention_bias)
        else:
            self.v_proj = nn.Linear(d, self.num_kv_heads * dh, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=config.attention_output_bias)
        if self.rope and config.layer_qk_ranks is not None:
            # which of the model's qk_rank / 2 rotary frequency pairs each key head of this layer keeps
            pairs = torch.arange(r // 2).expand(self.num_kv_heads, r // 2).contiguous()
            self.register_buffer("rope_pair_index", pairs)

    @torch.no_grad()
    def set_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full (Linear-layout) q/k/v/o weights and optional biases, moving them to this module's gauge.

        Keys: q, k, v, o and optionally q_bias, k_bias, v_bias, o_bias. The function (all G_QK, G_VO, the rotary
        scores) is unchanged; in the pivot gauge only the free entries are stored."""
        q, k, v, o = weights["q"], weights["k"], weights["v"], weights["o"]
        bq, bk, bv = weights.get("q_bias"), weights.get("k_bias"), weights.get("v_bias")
        scale = self.config.pivot_scale
        if isinstance(self.k_proj, GaugeFixedLinear):
            q, k, bq, bk, idx, val = qk_to_pivot_gauge(
                q, k, bq, bk, num_kv_heads=self.num_kv_heads, rank=self.qk_rank, rope=self.rope, scale=scale
            )
            self.k_proj.set_layout(idx, val)
        if isinstance(self.v_proj, GaugeFixedLinear):
            v, o, bv, idx, val = vo_to_pivot_gauge(
                v, o, bv, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, scale=scale
            )
            self.v_proj.set_layout(idx, val)
        for name, w, b in (
            ("q_proj", q, bq),
            ("k_proj", k, bk),
            ("v_proj", v, bv),
            ("o_proj", o, weights.get("o_bias")),
        ):
            module = getattr(self, name)
            if isinstance(module, GaugeFixedLinear):
                module.set_full_weight(w)
            else:
                module.weight.copy_(w.to(module.weight))
            if module.bias is not None:
                module.bias.copy_((b if b is not None else torch.zeros_like(module.bias)).to(module.bias))

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full (Linear-layout) q/k/v/o weights and biases this module computes with."""
        out = {}
        for key, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            module = getattr(self, name)
            out[key] = full_weight(module)
            if module.bias is not None:
                out[f"{key}_bias"] = module.bias
        return out

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
        query = self.q_proj(hidden_states).view(*input_shape, -1, self.qk_rank).transpose(1, 2)  # (B, H, T, r)
        key = self.k_proj(hidden_states).view(*input_shape, -1, self.qk_rank).transpose(1, 2)  # (B, H_kv, T, r)
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, d_h)
        if self.rope:
            cos, sin = position_embeddings
            if getattr(self, "rope_pair_index", None) is not None:
                query, key = apply_rotary_pair_subset(query, key, cos, sin, self.rope_pair_index)
            else:
                query, key = apply_rotary_pos_emb(query, key, cos, sin)
        own_value = value
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )  # (B, T, H, d_h)
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
        self.up_proj = GaugeFixedLinear(d, f, 1) if config.gauge == "pivot" else nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    @torch.no_grad()
    def set_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full gate/up/down weights (Linear layout), moving the scales to this module's gauge."""
        up, down = weights["up"], weights["down"]
        if isinstance(self.up_proj, GaugeFixedLinear):
            up, down, idx, val = mlp_to_pivot_gauge(up, down, scale=self.config.pivot_scale)
            self.up_proj.set_layout(idx, val)
            self.up_proj.set_full_weight(up)
        else:
            self.up_proj.weight.copy_(up.to(self.up_proj.weight))
        self.gate_proj.weight.copy_(weights["gate"].to(self.gate_proj.weight))
        self.down_proj.weight.copy_(down.to(self.down_proj.weight))

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full gate/up/down weights (Linear layout)."""
        return {"gate": self.gate_proj.weight, "up": full_weight(self.up_proj), "down": self.down_proj.weight}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RelationalDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: h + Attn(norm(h)), then h + MLP(norm(h)), with gain-free norms."""

    def __init__(self, config: RelationalConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = RelationalAttention(config, layer_idx)
        self.mlp = RelationalMLP(config, layer_idx)
        self.input_layernorm = RelationalRMSNorm(config.rms_norm_eps)
        self.post_attention_layernorm = RelationalRMSNorm(config.rms_norm_eps)

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
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


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
    _can_compile_fullgraph = False
    _can_record_outputs = {"hidden_states": RelationalDecoderLayer, "attentions": RelationalAttention}

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # Attention and MLP hold no parameter of their own, so the generic custom-code shortcut would skip them;
        # their factors are initialised jointly here (each partner factor absorbs the other's gauge move).
        if isinstance(module, (RelationalAttention, RelationalMLP)):
            if not getattr(module, "_is_hf_initialized", False):
                self._init_weights(module)
                module._is_hf_initialized = True
            return
        super()._initialize_weights(module, is_custom_code)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, after checking a local checkpoint directory: a missing, unreadable or
        truncated safetensors file, or a tensor whose shape disagrees with the config, raises one clear error that
        names the file and the problem."""
        path = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder", "") or "")
        if os.path.isdir(path):
            _check_checkpoint_dir(cls, path)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, initializer_range) for every factor; in the pivot gauge the free factors are drawn as usual and
        then moved to the gauge, so the function distribution at init equals the free model's."""
        std = self.config.initializer_range
        if isinstance(module, RelationalAttention):
            if _all_initialized(module):
                return
            c = self.config
            d, r, dh = c.hidden_size, module.qk_rank, module.head_dim
            weights = {
                "q": torch.randn(c.num_attention_heads * r, d) * std,
                "k": torch.randn(c.num_key_value_heads * r, d) * std,
                "v": torch.randn(c.num_key_value_heads * dh, d) * std,
                "o": torch.randn(d, c.num_attention_heads * dh) * std,
            }
            module.set_full_weights({k: w.to(module.o_proj.weight.device) for k, w in weights.items()})
        elif isinstance(module, RelationalMLP):
            if _all_initialized(module):
                return
            c = self.config
            f = module.down_proj.in_features
            weights = {
                "gate": torch.randn(f, c.hidden_size) * std,
                "up": torch.randn(f, c.hidden_size) * std,
                "down": torch.randn(c.hidden_size, f) * std,
            }
            module.set_full_weights({k: w.to(module.down_proj.weight.device) for k, w in weights.items()})
        elif isinstance(module, RelationalRotaryEmbedding):
            module.reset_inv_freq()
        elif isinstance(module, RelationalRMSNorm):
            if module.weight is not None:
                module.weight.fill_(1.0)
        elif isinstance(module, GaugeFixedLinear):
            return  # initialised with its parent (attention or MLP), which knows the partner factor
        else:
            super()._init_weights(module)


def _check_checkpoint_dir(cls: type[PreTrainedModel], path: str) -> None:
    """Validate the safetensors weights of a local checkpoint directory against its config (see from_pretrained)."""
    from safetensors import safe_open
    from transformers.initialization import no_init_weights

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            extra = (
                " (relational checkpoints are stored as safetensors only)"
                if any(f.endswith(".bin") for f in os.listdir(path))
                else ""
            )
            raise OSError(f"{file}: weights file is missing{extra}")
        try:
            with safe_open(file, framework="pt") as st:
                for key in st.keys():
                    shapes[key] = tuple(st.get_slice(key).get_shape())
        except Exception as err:  # safetensors raises its own error type for truncated or corrupt files
            raise OSError(f"{file}: not a readable safetensors file, it may be truncated or corrupt ({err})") from None
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return  # transformers reports the missing config itself
    config = RelationalConfig.from_pretrained(path)
    with torch.device("meta"), no_init_weights():
        reference = cls(config)
    expected = {_strip_prefix(k): tuple(v.shape) for k, v in reference.state_dict().items()}
    for key, shape in shapes.items():
        want = expected.get(_strip_prefix(key))
        if want is not None and want != shape:
            owner = files[0] if len(files) == 1 else "a shard of model.safetensors"
            raise ValueError(
                f"{os.path.join(path, owner)}: tensor {key!r} has shape {list(shape)} but config.json implies "
                f"{list(want)}; the weights do not belong to this config"
            )


def _strip_prefix(key: str) -> str:
    return key[len("model.") :] if key.startswith("model.") else key


def _all_initialized(module: nn.Module) -> bool:
    """True when every parameter of `module` was loaded already (Transformers flags them)."""
    return all(getattr(p, "_is_hf_initialized", False) for p in module.parameters())


class RelationalModel(RelationalPreTrainedModel):
    """Embedding, decoder layers, final norm (gain-free, or with a gain vector when `config.final_norm_gain`)."""

    def __init__(self, config: RelationalConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([RelationalDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RelationalRMSNorm(config.rms_norm_eps, config.hidden_size if config.final_norm_gain else None)
        self.rotary_emb = RelationalRotaryEmbedding(config) if config.position_encoding == "rope" else None
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
        if inputs_embeds is None:
            _check_token_ids(input_ids, self.vocab_size)
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens)[None]
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)


def _check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise a clear ValueError for token ids outside [0, vocab_size) instead of an index error inside torch."""
    if input_ids.numel() == 0:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contain token id {bad}, outside the vocabulary [0, {vocab_size}).")


class RelationalForCausalLM(RelationalPreTrainedModel, GenerationMixin):
    """Relational model with a language-modelling head (tied to the embedding by default)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RelationalConfig) -> None:
        super().__init__(config)
        self.model = RelationalModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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


class RelationalForSequenceClassification(GenericForSequenceClassification, RelationalPreTrainedModel):
    """Relational model with a linear score head on the last non-padding token."""

    def __init__(self, config: RelationalConfig) -> None:
        RelationalPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = RelationalModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


__all__ = [
    "RelationalPreTrainedModel",
    "RelationalModel",
    "RelationalForCausalLM",
    "RelationalForSequenceClassification",
    "GaugeFixedLinear",
    "parallel_component",
    "parallel_coefficient",
    "scale_parallel",
]
