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

import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterator

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
from transformers.utils import TransformersKwargs, can_return_tuple, logging
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
    norm and remove its direction from the others. The residual norms are downdated (|x_i|^2 - sum_j (x_i.u_j)^2
    over the orthonormal directions u_j removed so far), so each step reads w once and writes nothing of its size.
    Returns a long tensor (..., rank), each row distinct.
    """
    x = w.detach().double()
    norms = x.pow(2).sum(-1)  # (..., n)
    basis = x.new_zeros(*x.shape[:-2], rank, x.shape[-1])  # (..., rank, r) directions removed so far
    picked = []
    taken = torch.zeros(norms.shape, dtype=torch.bool, device=w.device)
    for k in range(rank):
        idx = norms.masked_fill(taken, -1.0).argmax(-1)  # (...)
        picked.append(idx)
        taken.scatter_(-1, idx.unsqueeze(-1), True)
        row = torch.gather(x, -2, idx[..., None, None].expand(*idx.shape, 1, x.shape[-1]))  # (..., 1, r)
        if k:
            q = basis[..., :k, :]
            for _ in range(2):  # Gram-Schmidt, twice for orthogonality to rounding
                row = row - (row @ q.transpose(-1, -2)) @ q
        unit = row / row.norm(dim=-1, keepdim=True).clamp_min(1e-300)  # (..., 1, r)
        basis[..., k : k + 1, :] = unit
        coeff = (x @ unit.transpose(-1, -2)).squeeze(-1)  # (..., n)
        norms = norms - coeff * coeff
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


# Buffers that record a gauge layout. Only `pivots` (the pivot positions, a small integer tensor) is saved with the
# weights; the index and value tensors the forward map uses are derived from it. Checkpoints written before the
# compact layout stored the derived tensors themselves (LEGACY_LAYOUT_BUFFERS, int64); they still load.
# A compressed layer also saves which rotary pairs each key head keeps (`rope_pair_index`).
GAUGE_LAYOUT_BUFFERS = ("pivots", "fixed_index", "free_index", "fixed_value", "rope_pair_index")
LEGACY_LAYOUT_BUFFERS = ("fixed_index", "free_index", "fixed_value")


def _position_dtype(n: int) -> torch.dtype:
    """int32 for the pivot positions 0..n-1: small on disk, and a dtype every collective backend broadcasts (DDP
    syncs buffers at start-up; gloo refuses int16, "Invalid scalar type")."""
    if n > torch.iinfo(torch.int32).max:
        raise ValueError(f"in_features {n} does not fit int32 pivot positions")
    return torch.int32


class GaugeFixedLinear(nn.Module):
    """A linear map whose weight W (out x in) has, in every output row, m entries fixed by a gauge choice.

    Forward map (free parameters -> weight): W[o, fixed_index[o]] = fixed_value[o], W[o, free_index[o]] = weight[o]
    (free entries in increasing column order). Only `weight` (out x (in - m)) is a parameter.

    The layout follows one of two canonical patterns, fixed at construction:
    - ``"block"``: output rows come in blocks of m consecutive rows (one head of width m, or one row when m = 1) that
      share m pivot columns P; row j of a block has W[j, P_i] = c delta_ij: W_K[P] = c I_r, W_V[P] = c I_{d_h}, the
      SwiGLU pivot W_up[k, p_k] = c;
    - ``"rotary"`` (m = 1, heads of `block` = r rows): rows j and j + r/2 of a head (a rotary pair) share one pivot
      column p_j with W[j, p_j] = c and W[j + r/2, p_j] = 0 (the RoPE commutant fixed per frequency pair).
    The checkpoint stores only the persistent buffer `pivots` (int32): (out/m, m)
    pivot columns for "block", (out/2, 1) for "rotary"; c is `scale` (the config's pivot_scale). `fixed_index`,
    `free_index` (int64) and `fixed_value` are non-persistent buffers derived from `pivots`, rebuilt whenever `pivots`
    is replaced or written (loading, `load_state_dict`, `to_empty`).

    `set_layout` also accepts a non-canonical layout (any m columns per row, any fixed values, e.g. after merging a
    LoRA update into W): the module then computes with it, and `state_dict()` carries it exactly as the extra entries
    `fixed_index` and `fixed_value` (which `load_state_dict` reads back). `save_pretrained` first moves such modules
    back to the canonical gauge (same function), so checkpoints always hold the compact form.

    The setters write with a plain in-place copy, so they also act on a model loaded with `from_pretrained` (whose
    tensors Transformers flags as initialised). The assembled weight is recomputed at every call except inside
    `weight_cache()` (used by `generate`), so edits by any route (optimizer steps, `.data`, `copy_`) are always seen.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fixed_per_row: int,
        bias: bool = False,
        *,
        pattern: str = "block",
        block: int | None = None,
        scale: float = 1.0,
    ) -> None:
        super().__init__()
        if pattern not in ("block", "rotary"):
            raise ValueError(f"`pattern` must be 'block' or 'rotary', got {pattern!r}")
        if pattern == "rotary":
            if fixed_per_row != 1 or block is None or block % 2 or out_features % block:
                raise ValueError(
                    f"the rotary layout needs fixed_per_row=1 and an even head width `block` dividing out_features, "
                    f"got fixed_per_row={fixed_per_row}, block={block}, out_features={out_features}"
                )
        elif out_features % fixed_per_row:
            raise ValueError(f"out_features ({out_features}) must be a multiple of fixed_per_row ({fixed_per_row})")
        if not 0 < fixed_per_row <= in_features:
            raise ValueError(f"fixed_per_row must be in [1, in_features={in_features}], got {fixed_per_row}")
        self.in_features, self.out_features, self.fixed_per_row = in_features, out_features, fixed_per_row
        self.pattern, self.block, self.scale = pattern, (block if pattern == "rotary" else fixed_per_row), float(scale)
        self.weight = nn.Parameter(torch.empty(out_features, in_features - fixed_per_row))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        rows = out_features // 2 if pattern == "rotary" else out_features // fixed_per_row
        pivots = torch.arange(fixed_per_row, dtype=_position_dtype(in_features)).expand(rows, fixed_per_row)
        self.register_buffer("pivots", pivots.contiguous())
        self.register_buffer("fixed_index", torch.empty(0, dtype=torch.long), persistent=False)
        self.register_buffer("free_index", torch.empty(0, dtype=torch.long), persistent=False)
        self.register_buffer("fixed_value", torch.empty(0), persistent=False)
        self._custom_layout = False
        self._layout_key: tuple | None = None
        self._layout_version = 0
        self._cache_assembled = False
        self._sync_layout()

    # ---- layout: pivots <-> (fixed_index, fixed_value) ----

    def _canonical(self, pivots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fixed_index (out x m) int64, fixed_value (out x m) float32) of the canonical layout with these pivots."""
        m, device = self.fixed_per_row, pivots.device
        if self.pattern == "block":
            index = pivots.long().repeat_interleave(m, dim=0)
            value = self.scale * torch.eye(m, dtype=torch.float32, device=device).repeat(self.out_features // m, 1)
            return index, value
        half = self.block // 2
        p = pivots.long().view(-1, half)  # (heads, r/2)
        index = torch.cat([p, p], dim=-1).reshape(-1, 1)
        value = torch.zeros(p.shape[0], self.block, dtype=torch.float32, device=device)
        value[:, :half] = self.scale
        return index, value.reshape(-1, 1)

    def _encode(self, fixed_index: torch.Tensor, fixed_value: torch.Tensor) -> torch.Tensor | None:
        """The pivots of a layout if it is canonical (positions shared as the pattern says, values c / 0), else None."""
        m = self.fixed_per_row
        if self.pattern == "block":
            grouped = fixed_index.view(-1, m, m)
            pivots = grouped[:, 0, :]
            shared = bool((grouped == pivots.unsqueeze(1)).all())
        else:
            half = self.block // 2
            grouped = fixed_index.view(-1, 2, half)
            pivots = grouped[:, 0, :].reshape(-1, 1)
            shared = bool((grouped[:, 0] == grouped[:, 1]).all())
        if not shared:
            return None
        _, canonical = self._canonical(pivots)
        tol = torch.finfo(fixed_value.dtype).eps * abs(self.scale) if fixed_value.is_floating_point() else 0.0
        if not bool(((fixed_value.float() - canonical).abs() <= tol).all()):
            return None
        return pivots.to(self.pivots.dtype)

    def _pivots_key(self) -> tuple:
        return (self.pivots.data_ptr(), self.pivots._version, self.pivots.device, tuple(self.pivots.shape))

    @torch.no_grad()
    def _install(self, fixed_index: torch.Tensor, fixed_value: torch.Tensor) -> None:
        """Set the derived buffers to a layout (fixed_index, fixed_value) (out x m); free_index is the rest, in order."""
        n, m = self.in_features, self.fixed_per_row
        fixed_index = fixed_index.to(torch.long).reshape(self.out_features, m)
        if fixed_index.device.type != "meta":
            low, high = int(fixed_index.min()), int(fixed_index.max())
            if low < 0 or high >= n:
                raise ValueError(f"{self!r}: pivot positions must be in [0, {n}), got {low if low < 0 else high}")
            if m > 1 and bool((fixed_index.sort(dim=1).values.diff(dim=1) == 0).any()):
                raise ValueError(f"{self!r}: the {m} pivot positions of a row must be distinct")
        # the k-th free column of a row is k + #{fixed columns s_i with s_i - i <= k} (s sorted, i = 0..m-1)
        shifted = fixed_index.sort(dim=1).values - torch.arange(m, device=fixed_index.device)
        k = torch.arange(n - m, device=fixed_index.device).expand(self.out_features, n - m)
        if m == 1:
            free = k + (k >= shifted).long()
        else:
            free = k + torch.searchsorted(shifted.contiguous(), k.contiguous(), right=True)
        self.fixed_index = fixed_index.contiguous()
        self.free_index = free.contiguous()
        self.fixed_value = fixed_value.reshape(self.out_features, m).to(torch.float32).contiguous()
        self._layout_version += 1

    @torch.no_grad()
    def _sync_layout(self) -> None:
        """Rebuild the derived buffers from `pivots` (the canonical layout)."""
        self._install(*self._canonical(self.pivots))
        self._custom_layout = False
        self._layout_key = self._pivots_key()

    def _ensure_layout(self) -> None:
        # a canonical layout follows `pivots` (replaced on loading, written in place); a non-canonical one is changed
        # only by set_layout / load_state_dict (moving the module to another device keeps it)
        if not self._custom_layout and self._layout_key != self._pivots_key():
            self._sync_layout()

    @property
    def is_canonical(self) -> bool:
        """True when the layout is the canonical pattern with pivot value `scale` (what a checkpoint stores)."""
        self._ensure_layout()
        return not self._custom_layout

    @torch.no_grad()
    def set_layout(self, fixed_index: torch.Tensor, fixed_value: torch.Tensor) -> None:
        """Install a new gauge layout: fixed_index, fixed_value (out x m); the free indices are the rest. Canonical
        layouts are stored as `pivots`; any other layout is kept as is (see the class docstring)."""
        device = self.pivots.device
        fixed_index = fixed_index.to(device, torch.long).reshape(self.out_features, self.fixed_per_row)
        fixed_value = fixed_value.to(device).reshape(self.out_features, self.fixed_per_row)
        self._install(fixed_index, fixed_value)
        pivots = self._encode(self.fixed_index, fixed_value)
        if pivots is not None:
            self.pivots.copy_(pivots)
        self._custom_layout = pivots is None
        self._layout_key = self._pivots_key()

    # ---- forward map ----

    def full_weight(self) -> torch.Tensor:
        """The full (out x in) weight W assembled from the free entries and the fixed pivot entries."""
        if torch.compiler.is_compiling():
            base = torch.zeros(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
            base = base.scatter(1, self.fixed_index, self.fixed_value.to(self.weight.dtype))
            return base.scatter(1, self.free_index, self.weight)
        self._ensure_layout()
        if not self._cache_assembled or (torch.is_grad_enabled() and self.weight.requires_grad):
            return self._assemble()
        key = (self.weight._version, self.weight.data_ptr(), self.weight.dtype, self._layout_version)
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
        key = (self.weight.dtype, self.weight.device, self._layout_version, self.fixed_index.data_ptr())
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

    def _drop_caches(self) -> None:
        self.__dict__.pop("_weight_cache", None)

    @torch.no_grad()
    def set_full_weight(self, w: torch.Tensor, check: bool = True) -> None:
        """Store the free entries of a full weight w that is already in this module's gauge."""
        self._ensure_layout()
        if check:
            fixed = torch.gather(w.float(), 1, self.fixed_index)
            err = (fixed - self.fixed_value.float()).abs().max().item() if fixed.numel() else 0.0
            if err > 1e-4 * max(1.0, self.fixed_value.abs().max().item()):
                raise ValueError(f"weight is not in this module's pivot gauge (pivot entries off by {err:.3g})")
        self.weight.copy_(torch.gather(w, 1, self.free_index).to(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.full_weight(), self.bias)

    # ---- state dict: compact pivots; a non-canonical layout travels exactly; legacy keys load ----

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.is_canonical:
            return
        destination[prefix + "fixed_index"] = self.fixed_index if keep_vars else self.fixed_index.detach()
        destination[prefix + "fixed_value"] = self.fixed_value if keep_vars else self.fixed_value.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        layout = {name: state_dict.pop(prefix + name) for name in LEGACY_LAYOUT_BUFFERS if prefix + name in state_dict}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if "fixed_index" in layout and "fixed_value" in layout:
            if prefix + "pivots" in missing_keys:
                missing_keys.remove(prefix + "pivots")
            self.set_layout(layout["fixed_index"], layout["fixed_value"])
        elif layout:
            error_msgs.append(f"{prefix}: a layout needs both fixed_index and fixed_value, got only {sorted(layout)}")
        elif prefix + "pivots" in state_dict:
            self._sync_layout()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fixed_per_row={self.fixed_per_row}, "
            f"pattern={self.pattern}"
        )


@contextlib.contextmanager
def weight_cache(model: nn.Module) -> Iterator[None]:
    """Within the context, every GaugeFixedLinear of `model` keeps its assembled weight between calls without autograd
    (decoding reads one weight per step, like a plain Linear). Use it only where the weights do not change: edits made
    through `.data` inside the context are not seen. `generate` enters it."""
    modules = [m for m in model.modules() if isinstance(m, GaugeFixedLinear)]
    previous = [m._cache_assembled for m in modules]
    for m in modules:
        m._cache_assembled = True
    try:
        yield
    finally:
        for m, was in zip(modules, previous):
            m._cache_assembled = was
            if not was:
                m._drop_caches()


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
        if config.gauge == "pivot":
            self.up_proj = GaugeFixedLinear(d, f, 1, scale=config.pivot_scale)
        else:
            self.up_proj = nn.Linear(d, f, bias=False)
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
    _can_compile_fullgraph = True
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

    def __init__(self, config: RelationalConfig, *inputs, **kwargs) -> None:
        config.validate()  # fields edited after construction are checked together before anything is built
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, strict about the tensors (relational checkpoints are written only by this
        project, so a difference is a mistake, never a model to complete with random weights):

        - a local checkpoint directory is checked first: a missing, unreadable or truncated safetensors file, or a
          tensor whose shape disagrees with the config, raises one clear error that names the file and the problem;
        - a checkpoint written before the compact gauge layout (int64 `fixed_index`/`free_index`/`fixed_value`
          buffers) is converted on the fly to `pivots` (same function);
        - missing or unexpected tensors raise a ValueError naming them. Only a task head may differ, as for every
          Transformers model: a head absent from the checkpoint of another architecture is initialised (e.g.
          `score` when loading a causal-LM checkpoint for sequence classification), and an unused head is skipped.
        """
        path = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder", "") or "")
        legacy = None
        source = pretrained_model_name_or_path
        if os.path.isdir(path):
            legacy = _check_checkpoint_dir(cls, path)
            if legacy is not None:  # load the converted tensors (Transformers takes them without a model name)
                kwargs["state_dict"] = legacy[0]
                kwargs.setdefault("config", RelationalConfig.from_pretrained(path))
                source = None
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(source, *model_args, output_loading_info=True, **kwargs)
        tolerated = set()
        if any(_strip_prefix(k) == "norm.weight" for k in info.get("missing_keys", ())):
            # a config written before `final_norm_gain` existed: the gain is absent from the weights by design and
            # starts at one (the same function)
            raw, _ = RelationalConfig.get_config_dict(
                pretrained_model_name_or_path, subfolder=kwargs.get("subfolder", "")
            )
            if "final_norm_gain" not in raw:
                tolerated = {k for k in info["missing_keys"] if _strip_prefix(k) == "norm.weight"}
        _raise_on_key_differences(model, info, str(pretrained_model_name_or_path), tolerated)
        for module in model.modules():
            if isinstance(module, GaugeFixedLinear):
                module._sync_layout()
        if legacy is not None and legacy[1]:
            _install_legacy_layouts(model, legacy[1])
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
        """Normal(0, initializer_range) for every factor; in the pivot gauge the free factors are drawn as usual and
        then moved to the gauge, so the function distribution at init equals the free model's.

        The gauge layout (the pivot positions) is part of the weights, not a separate initialisation: pivots are
        chosen from the freshly drawn factors, so they are drawn here together with the factors of their attention /
        MLP module, never by a GaugeFixedLinear alone. Hence the constructor and `from_config` draw factors and layouts
        together; `from_pretrained` loads both (a checkpoint without its `pivots` is refused: a re-drawn layout would
        not match the stored free entries); a model built on the meta device holds placeholder layouts (the first
        columns) until `to_empty()` + `init_weights()` draws factors and layouts together, which gives the same model
        as the constructor with the same seed."""
        std = self.config.initializer_range
        if isinstance(module, RelationalAttention):
            if _all_initialized(module) or module.o_proj.weight.device.type == "meta":
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
            if _all_initialized(module) or module.down_proj.weight.device.type == "meta":
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


def _check_checkpoint_dir(
    cls: type[PreTrainedModel], path: str
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]] | None:
    """Validate the safetensors weights of a local checkpoint directory against its config (see from_pretrained).

    Returns None for a checkpoint in today's layout. For one in the legacy gauge layout, returns its state dict
    converted to `pivots` and, for the modules whose stored layout is not canonical, their (fixed_index, fixed_value)
    by key prefix (installed after loading, see `_install_legacy_layouts`)."""
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
        return None  # transformers reports the missing config itself
    config = RelationalConfig.from_pretrained(path)
    with torch.device("meta"), no_init_weights():
        reference = cls(config)
    expected = {_strip_prefix(k): tuple(v.shape) for k, v in reference.state_dict().items()}
    owner = os.path.join(path, files[0] if len(files) == 1 else "a shard of model.safetensors")
    for key, shape in shapes.items():
        want = expected.get(_strip_prefix(key))
        if want is not None and want != shape:
            raise ValueError(
                f"{owner}: tensor {key!r} has shape {list(shape)} but config.json implies "
                f"{list(want)}; the weights do not belong to this config"
            )
    if not any(key.rsplit(".", 1)[-1] in LEGACY_LAYOUT_BUFFERS for key in shapes):
        return None
    return _convert_legacy_layout(reference, path, files, owner)


def _convert_legacy_layout(
    reference: PreTrainedModel, path: str, files: list[str], owner: str
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The state dict of a legacy-layout checkpoint with each module's int64 layout buffers replaced by `pivots`."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    modules = {_strip_prefix(n + "."): m for n, m in reference.named_modules() if isinstance(m, GaugeFixedLinear)}
    custom: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    prefixes = {key[: -len(key.rsplit(".", 1)[-1])] for key in state if key.rsplit(".", 1)[-1] in LEGACY_LAYOUT_BUFFERS}
    for prefix in sorted(prefixes):
        module = modules.get(_strip_prefix(prefix))
        parts = {n: state.pop(prefix + n, None) for n in LEGACY_LAYOUT_BUFFERS}
        if module is None:
            raise ValueError(f"{owner}: unexpected gauge-layout tensors {prefix}*: no gauge-fixed module there")
        if parts["fixed_index"] is None or parts["fixed_value"] is None:
            missing = [prefix + n for n in ("fixed_index", "fixed_value") if parts[n] is None]
            raise ValueError(f"{owner}: gauge-layout tensors missing: {missing}")
        fixed_index, fixed_value = parts["fixed_index"].long(), parts["fixed_value"].float()
        pivots = module._encode(fixed_index, fixed_value)
        if pivots is None:
            custom[prefix] = (fixed_index, fixed_value)
            pivots = torch.arange(module.fixed_per_row).expand(module.pivots.shape)
        state[prefix + "pivots"] = pivots.to(module.pivots.dtype).contiguous()
    logger.info("%s: legacy gauge layout converted to pivot positions", path)
    return state, custom


def _module_by_prefix(model: nn.Module, prefix: str) -> nn.Module | None:
    for name, module in model.named_modules():
        if _strip_prefix(name + ".") == _strip_prefix(prefix):
            return module
    return None


@torch.no_grad()
def _install_legacy_layouts(model: nn.Module, custom: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give the modules of a loaded legacy checkpoint their stored non-canonical layouts (their free entries are
    already in place: both layouts order them by column), then move them back to the canonical gauge."""
    for prefix, (fixed_index, fixed_value) in custom.items():
        module = _module_by_prefix(model, prefix)
        module.set_layout(fixed_index, fixed_value)
    regauge_noncanonical(model)


_HEAD_NAMES = ("lm_head", "score")


def _raise_on_key_differences(model: PreTrainedModel, info: dict, source: str, tolerated: set[str]) -> None:
    """ValueError naming the missing and unexpected tensors of a load, except a task head that the checkpoint's own
    architecture does not have (see RelationalPreTrainedModel.from_pretrained)."""
    same_architecture = type(model).__name__ in (model.config.architectures or [])

    def counts(key: str) -> bool:
        return key not in tolerated and (same_architecture or key.split(".", 1)[0] not in _HEAD_NAMES)

    missing = sorted(k for k in info.get("missing_keys", ()) if counts(k))
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if counts(k))
    if not missing and not unexpected:
        return

    def listing(keys: list[str]) -> str:
        shown = ", ".join(keys[:8])
        return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")

    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listing(unexpected)}")
    hint = (
        "was config.json edited (e.g. num_hidden_layers) or a weights file replaced?"
        if not any(k.rsplit(".", 1)[-1] in LEGACY_LAYOUT_BUFFERS for k in unexpected)
        else "this is a checkpoint in the legacy int64 gauge layout, which is converted when loading from a local "
        "folder: download it first (huggingface_hub.snapshot_download) and load the folder"
    )
    raise ValueError(
        f"{source}: the checkpoint does not hold exactly the tensors of the model its config.json describes; "
        + "; ".join(problems)
        + f". Relational checkpoints are written only by relational-hf: {hint}"
    )


@torch.no_grad()
def regauge_noncanonical(model: nn.Module) -> int:
    """Move every attention / MLP module holding a GaugeFixedLinear whose layout is not canonical (e.g. pivot values
    written by a LoRA merge, or a `config.pivot_scale` edited after the model was built) back into the canonical pivot
    gauge of the config's pivot value, with the same function. Returns how many moved."""
    count = 0
    for module in model.modules():
        if not isinstance(module, (RelationalAttention, RelationalMLP)):
            continue
        gauge_fixed = [c for c in module.children() if isinstance(c, GaugeFixedLinear)]
        for child in gauge_fixed:
            if child.scale != float(module.config.pivot_scale):  # pivot_scale edited after the model was built
                child._ensure_layout()
                child.scale, child._custom_layout = float(module.config.pivot_scale), True
        if all(c.is_canonical for c in gauge_fixed):
            continue
        module.set_full_weights({key: w.detach().clone() for key, w in module.full_weights().items()})
        count += 1
    if count:
        logger.info("moved %d attention/MLP modules back into the canonical pivot gauge", count)
    return count


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
            if not torch.compiler.is_compiling():  # a data-dependent check: eager only (compiled graphs stay whole)
                _check_token_ids(input_ids, self.embed_tokens.num_embeddings)
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
    """Raise a clear ValueError for token ids outside [0, vocab_size) instead of an index error inside torch.

    `vocab_size` is the embedding's current row count, so it follows `resize_token_embeddings`. The check reads the
    ids' min and max (a device synchronisation), so the forward runs it in eager mode only: under `torch.compile` an
    out-of-range id fails inside the embedding lookup as in any Transformers model."""
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
    "GaugeFixedLinear",
    "weight_cache",
    "regauge_noncanonical",
    "register_static_names",
    "parallel_component",
    "parallel_coefficient",
    "scale_parallel",
]
