"""Gauge-fixed linear maps: the pivot gauge of the relational transformer's factors (DESIGN.md, section 2).

Notation: row vectors; weights in ``nn.Linear`` layout (out x in), so ``k_proj.weight`` holds W_K^T for every head.
When ``config.gauge == "pivot"`` these groups keep no redundant coordinate:
- QK, no rotary: W_K[P] = c I_r on r pivot rows P per key head (GL(r), r^2 per key head);
- QK, rotary: per frequency pair one pivot 2-vector normalised to (c, 0) (the RoPE commutant, r per key head);
- VO: W_V[P] = c I_{d_h} (GL(d_h), d_h^2 per key/value head), unless value-space parallel removal is on;
- SwiGLU: one pivot entry per hidden unit of W_up equal to c (d_ff per layer).

This file holds the module that stores only the free entries (`GaugeFixedLinear`), the pivot layouts, the moves of
full factors into the pivot gauge (same function) and `weight_cache`. It travels to the Hub with the model file
(``trust_remote_code``) and imports only torch and transformers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)


def max_volume_rows(w: torch.Tensor, rank: int) -> torch.Tensor:
    """Indices of `rank` well-conditioned pivot rows of each matrix in a batch w (..., n, r).

    Greedy column-pivoted QR of w^T (max-volume heuristic): repeatedly take the row with the largest residual
    norm and remove its direction from the others. The residual norms are downdated (|x_i|^2 - sum_j (x_i.u_j)^2
    over the orthonormal directions u_j removed so far), so each step reads w once and writes nothing of its size.
    Returns a long tensor (..., rank), each row distinct.
    """
    # float64, w^T contiguous as (b, r, n): each step's n dot products are one (1 x r) by (r x n) product that reads
    # the rows in memory order (the (n x r) matrix-vector product of the other layout is several times slower)
    xt = w.detach().double().transpose(-1, -2).reshape(-1, w.shape[-1], w.shape[-2]).contiguous()  # (b, r, n)
    norms = torch.linalg.vector_norm(xt, dim=-2).square_()  # (b, n), without a temporary of x's size
    basis = xt.new_zeros(xt.shape[0], rank, xt.shape[-2])  # (b, rank, r) directions removed so far
    picked = torch.empty(xt.shape[0], rank, dtype=torch.long, device=w.device)
    heads = torch.arange(xt.shape[0], device=w.device)
    for k in range(rank):
        idx = norms.argmax(-1)  # (b,); rows already taken hold -1 or less, below every residual norm
        picked[:, k] = idx
        row = xt[heads, :, idx].unsqueeze(1)  # (b, 1, r)
        if k:
            q = basis[:, :k, :]
            for _ in range(2):  # Gram-Schmidt, twice for orthogonality to rounding
                row = row - (row @ q.transpose(-1, -2)) @ q
        unit = row / row.norm(dim=-1, keepdim=True).clamp_min(1e-300)  # (b, 1, r)
        basis[:, k : k + 1, :] = unit
        coeff = torch.bmm(unit, xt).squeeze(1)  # (b, n)
        norms.sub_(coeff * coeff)
        norms[heads, idx] = -1.0
    return picked.view(*w.shape[:-2], rank)


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
    z_j = c / w_j[p_j] (float64) that makes that entry (c, 0). Returns (pivots (..., r/2), z (..., r/2) complex)."""
    half = w.shape[-2] // 2
    re, im = w[..., :half, :], w[..., half:, :]
    pivots = (re * re + im * im).argmax(-1)  # (..., r/2): the largest modulus, without forming complex rows
    at = pivots.unsqueeze(-1)
    at_pivot = torch.complex(torch.gather(re, -1, at).double(), torch.gather(im, -1, at).double()).squeeze(-1)
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


def _working_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the gauge maps multiply weights in: theirs, at least float32 (a bf16 / fp16 weight is multiplied in
    float32 and rounded once to its dtype)."""
    return torch.promote_types(x.dtype, torch.float32)


def complex_pair_scale(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Rows (..., r, d) in Linear layout with each rotary pair (w_j + i w_{j+r/2}) multiplied by z_j (..., r/2): the
    map w^T -> w^T M of `complex_pair_matrix` as a few elementwise passes instead of an r x r product, in
    `_working_dtype(w)` with z rounded to it, returned in w's dtype. A complex product is well conditioned: each pair
    comes out within a few roundings of the exact product."""
    half, dtype = w.shape[-2] // 2, _working_dtype(w)
    re, im = w[..., :half, :].to(dtype), w[..., half:, :].to(dtype)
    a, b = z.real.to(dtype).unsqueeze(-1), z.imag.to(dtype).unsqueeze(-1)
    out = torch.empty(w.shape, dtype=dtype, device=w.device)  # both halves written in place: one new tensor
    torch.mul(re, a, out=out[..., :half, :]).addcmul_(im, b, value=-1)
    torch.mul(re, b, out=out[..., half:, :]).addcmul_(im, a)
    return out.to(w.dtype)


def rope_pivot_layout(pivots: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed entries of the rotary pivot gauge: for each pair j, W[p_j, j] = c and W[p_j, j + r/2] = 0.
    Returns (fixed_index, fixed_value), each (..., r, 1)."""
    fixed_index = torch.cat([pivots, pivots], dim=-1).unsqueeze(-1)
    value = torch.zeros(fixed_index.shape, dtype=torch.float32, device=pivots.device)
    value[..., : pivots.shape[-1], :] = scale
    return fixed_index, value


# Buffers that record a gauge layout. Only `pivots` (the pivot positions, a small integer tensor) is saved with the
# weights; the index and value tensors the forward map uses are derived from it. A compressed layer also saves which
# rotary pairs each key head keeps (`rope_pair_index`).
GAUGE_LAYOUT_BUFFERS = ("pivots", "fixed_index", "free_index", "fixed_value", "rope_pair_index")
# The entries with which an in-memory state dict carries a non-canonical layout exactly (GaugeFixedLinear)
CUSTOM_LAYOUT_ENTRIES = ("fixed_index", "fixed_value")


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
    pivot columns for "block", (out/2, 1) for "rotary"; c is `scale` (the config's pivot_scale). A new module holds
    `initial_pivots()`, a layout derived from its shape. `fixed_index`,
    `free_index` (int64) and `fixed_value` are non-persistent buffers derived from `pivots`, rebuilt whenever `pivots`
    is replaced or written (loading, `load_state_dict`, `to_empty`).

    `set_layout` also accepts a non-canonical layout (any m columns per row, any fixed values, e.g. after merging a
    LoRA update into W): the module then computes with it, and `state_dict()` carries it exactly as the extra entries
    `fixed_index` and `fixed_value` (which `load_state_dict` reads back). `save_pretrained` first moves such modules
    back to the canonical gauge (same function), so checkpoints always hold the compact form.

    The setters write with a plain in-place copy, so they also act on a model loaded with `from_pretrained` (whose
    tensors Transformers flags as initialised).

    Assembled weight. `full_weight()` assembles W afresh at every call (except inside `weight_cache()`), and so does
    the forward pass by default: every forward sees the parameter as it is now, whatever wrote it (PyTorch's
    parametrizations behave the same way outside their `cached()` context). Inside `weight_cache()` (which
    `generate` and the project's perplexity loops enter) the assembled W is kept between calls, like the weight of a
    plain Linear; `keep_assembled = True` on a module (an opt-in, off by default) keeps it for every forward without
    autograd in eval mode too. A kept W is rebuilt when the parameter changes through PyTorch's in-place operations
    (optimizer steps that bump its version counter, `copy_`, `load_state_dict`), when it moves (`to`), when the
    layout changes, and it is dropped whenever a forward pass with gradients runs (a training step may follow), when
    the module switches between train and eval mode, and by `clear_weight_caches`; writes that bypass the version
    counter (through `.data`) are seen only after one of those events, which is why keeping outside
    `weight_cache()` is opt-in. A forward pass with gradients always assembles W afresh. The kept W costs the memory
    of W; a model that Accelerate offloads keeps nothing, inside `weight_cache()` too (its hooks bring each offloaded
    layer in for one call, and kept copies would hold them all in memory again).
    """

    keep_assembled: bool = False  # opt-in: keep the assembled weight in eval-mode inference outside weight_cache()

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
        self.register_buffer("pivots", self.initial_pivots())
        self.register_buffer("fixed_index", torch.empty(0, dtype=torch.long), persistent=False)
        self.register_buffer("free_index", torch.empty(0, dtype=torch.long), persistent=False)
        self.register_buffer("fixed_value", torch.empty(0), persistent=False)
        self._custom_layout = False
        self._layout_key: tuple | None = None
        self._layout_version = 0
        self._cache_assembled = False
        self._offloaded = False  # set by the model when Accelerate offloads it: nothing is kept, weight_cache included
        self._sync_layout()

    # ---- initialisation: a layout derived from the shape, factors drawn in it ----

    def initial_pivots(self) -> torch.Tensor:
        """The layout a new module starts from, derived from its shape alone (so re-initialising reproduces it):
        pivot positions spread over the input coordinates in row order, wrapping around: block g of m rows pivots on
        columns g*m .. g*m + m - 1, rotary pair i on column i (all mod in_features). Different heads of a layer thus
        use different residual coordinates while there are enough of them. Conversion instead chooses the pivots
        from the weights (`set_layout`)."""
        rows = self.out_features // 2 if self.pattern == "rotary" else self.out_features // self.fixed_per_row
        m = 1 if self.pattern == "rotary" else self.fixed_per_row
        positions = torch.arange(rows * m, device=self.weight.device).view(rows, m) % self.in_features
        return positions.to(_position_dtype(self.in_features))

    def init_stds(self, std: float) -> tuple[float, float]:
        """(std of the free entries, std of the partner factor) for drawing both in this gauge so that every entry of
        the invariant product (W_K with W_Q, W_V with W_O, W_up with W_down) has the second moment it has when both
        factors are N(0, std^2), at pivot rows and elsewhere. With m the width of the identity block the gauge fixes
        (m for "block"; 2 for "rotary", where (c, 0) is the 2 x 2 block c I of a complex scalar): free entries
        N(0, c^2 / m), partner N(0, m std^4 / c^2). Nothing is inverted, so the stored entries stay Gaussian."""
        m = 2 if self.pattern == "rotary" else self.fixed_per_row
        c = abs(self.scale)
        return c / math.sqrt(m), math.sqrt(m) * std**2 / c

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
        # the k-th free column of a row is k + #{fixed columns s_i with s_i - i <= k} (s sorted, i = 0..m-1); rows
        # of a block that share their fixed columns (the block pattern) are computed once; the int64 free indices are
        # written into the previous buffer when it has their shape (no new allocation of out x in entries)
        shape = (self.out_features, n - m)
        free = self.free_index
        if tuple(free.shape) != shape or free.device != fixed_index.device or free.dtype != torch.long:
            free = torch.empty(shape, dtype=torch.long, device=fixed_index.device)
        rows = fixed_index
        blocks = fixed_index.view(-1, m, m)
        if m > 1 and fixed_index.device.type != "meta" and bool((blocks == blocks[:, :1]).all()):
            rows = fixed_index[::m]  # one row per block
        shifted = rows.sort(dim=1).values - torch.arange(m, device=fixed_index.device)
        k = torch.arange(n - m, device=fixed_index.device).expand(rows.shape[0], n - m)
        if m == 1:
            torch.ge(k, shifted, out=free).add_(k)  # (k >= s) + k, without a mixed-dtype sum (several times slower)
        elif rows is fixed_index:
            torch.add(k, torch.searchsorted(shifted.contiguous(), k.contiguous(), right=True), out=free)
        else:
            per_block = k + torch.searchsorted(shifted.contiguous(), k.contiguous(), right=True)
            free.view(rows.shape[0], m, n - m).copy_(per_block.unsqueeze(1))
        self.fixed_index = fixed_index.contiguous()
        self.free_index = free
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
        """The full (out x in) weight W assembled from the free entries and the fixed pivot entries (a new tensor,
        except inside `weight_cache()` without autograd, where it is the kept one)."""
        if torch.compiler.is_compiling():
            base = torch.zeros(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
            base = base.scatter(1, self.fixed_index, self.fixed_value.to(self.weight.dtype))
            return base.scatter(1, self.free_index, self.weight)
        self._ensure_layout()
        if not self._cache_assembled or self._offloaded or (torch.is_grad_enabled() and self.weight.requires_grad):
            return self._assemble()
        return self._kept_weight()

    def _kept_key(self) -> tuple:
        w, p = self._parameters["weight"], self._buffers["pivots"]
        return (w._version, w.data_ptr(), w.dtype, w.device, p._version, p.data_ptr(), p.device, p.shape,
                self._layout_version)  # fmt: skip

    def _kept_weight(self) -> torch.Tensor:
        """The assembled weight kept between calls, rebuilt when the parameter's version, storage, dtype or the
        layout changed (`pivots` edited or replaced included: one comparison of keys a call when nothing did)."""
        cached = self.__dict__.get("_weight_cache")
        if cached is not None and cached[0] == self._kept_key():
            return cached[1]
        self._ensure_layout()
        self.__dict__.pop("_weight_cache", None)  # the old one is not needed to build the new one
        cached = (self._kept_key(), self._assemble().detach())
        self.__dict__["_weight_cache"] = cached
        return cached[1]

    def _assemble(self) -> torch.Tensor:
        # with autograd: one out-of-place scatter of the free entries into a constant holding the pivots (cached per
        # layout); its backward is a single gather, the constant needs none
        w = self.weight
        if torch.is_grad_enabled() and w.requires_grad:
            return self._pivot_base().scatter(1, self.free_index, w)
        # without: fixed and free entries partition each row, so one new tensor and two in-place scatters
        full = torch.empty(self.out_features, self.in_features, dtype=w.dtype, device=w.device)
        full.scatter_(1, self.free_index, w.detach())
        return full.scatter_(1, self.fixed_index, self.fixed_value.to(w.dtype))

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

    def train(self, mode: bool = True) -> GaugeFixedLinear:
        """`nn.Module.train`; a change of mode drops the kept assembled weight (see the class docstring)."""
        if mode != self.training:
            self._drop_caches()
        return super().train(mode)

    @torch.no_grad()
    def set_full_weight(self, w: torch.Tensor, check: bool = True) -> None:
        """Store the free entries of a full weight w that is already in this module's gauge."""
        self._ensure_layout()
        if check:
            fixed = torch.gather(w.float(), 1, self.fixed_index)
            err = (fixed - self.fixed_value.float()).abs().max().item() if fixed.numel() else 0.0
            if err > 1e-4 * max(1.0, self.fixed_value.abs().max().item()):
                raise ValueError(f"weight is not in this module's pivot gauge (pivot entries off by {err:.3g})")
        if w.dtype == self.weight.dtype and w.device == self.weight.device:
            torch.gather(w, 1, self.free_index, out=self.weight)  # straight into the parameter (no temporary)
        else:
            self.weight.copy_(torch.gather(w, 1, self.free_index).to(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return F.linear(x, self.full_weight(), self.bias)
        if torch.is_grad_enabled() and self.weight.requires_grad:
            self._drop_caches()  # an optimiser step may follow, possibly one that does not bump the version counter
            weight = self.full_weight()
        elif not self._offloaded and (
            self._cache_assembled or (self.keep_assembled and not (self.training or torch.is_grad_enabled()))
        ):
            weight = self._kept_weight()  # inference: assembled once, like a plain Linear's weight
        else:
            weight = self.full_weight()
        return F.linear(x, weight, self.bias)

    # ---- state dict: compact pivots; a non-canonical layout travels exactly ----

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.is_canonical:
            return
        destination[prefix + "fixed_index"] = self.fixed_index if keep_vars else self.fixed_index.detach()
        destination[prefix + "fixed_value"] = self.fixed_value if keep_vars else self.fixed_value.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        layout = {name: state_dict.pop(prefix + name) for name in CUSTOM_LAYOUT_ENTRIES if prefix + name in state_dict}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._drop_caches()
        if len(layout) == 2:
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
    through `.data` inside the context are not seen. `generate` enters it. On leaving, the assembled weights are
    dropped, except those of modules that keep them for inference anyway (`keep_assembled`), so successive
    `generate` calls of such a model assemble nothing again."""
    modules = [m for m in model.modules() if isinstance(m, GaugeFixedLinear)]
    previous = [m._cache_assembled for m in modules]
    for m in modules:
        m._cache_assembled = True
    try:
        yield
    finally:
        for m, was in zip(modules, previous):
            m._cache_assembled = was
            if not (was or m.keep_assembled):  # a module that keeps its weight for inference keeps it past the context
                m._drop_caches()


def clear_weight_caches(model: nn.Module) -> int:
    """Drop the assembled weight every GaugeFixedLinear of `model` keeps for inference (needed only after writes
    through `.data` between two inference calls); returns the number of modules."""
    modules = [m for m in model.modules() if isinstance(m, GaugeFixedLinear)]
    for m in modules:
        m._drop_caches()
    return len(modules)


def full_weight(module: nn.Module) -> torch.Tensor:
    """The full (out x in) weight of an nn.Linear or a GaugeFixedLinear."""
    return module.full_weight() if isinstance(module, GaugeFixedLinear) else module.weight


@torch.no_grad()
def write_full_weight(module: nn.Module, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Store a full (out x in) weight, already in the module's gauge, into an nn.Linear or a GaugeFixedLinear, and
    the bias if the module has one (zeros when `bias` is None)."""
    if isinstance(module, GaugeFixedLinear):
        module.set_full_weight(w)
    else:
        module.weight.copy_(w.to(module.weight))
    if module.bias is not None:
        module.bias.copy_((bias if bias is not None else torch.zeros_like(module.bias)).to(module.bias))


def _times_inverse_block(b: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """b^T x for the float64 gauge blocks b (..., r, r) = c W[P]^-1 and weights x (..., r, d), taken in float64 and
    rounded once to `dtype`: the entries of an inverse may be large and cancel in the sum."""
    return (b.transpose(-1, -2) @ x.double()).to(dtype)


def _times_pivot_block(block: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """(block / c) x for pivot blocks block (..., r, r) (float64, entries of the source weights) and weights x, in
    `_working_dtype(x)`, returned in x's dtype: no inverse, so no more cancellation than in the layer's own
    products."""
    dtype = _working_dtype(x)
    return ((block / scale).to(dtype) @ x.to(dtype)).to(x.dtype)


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
    b_K -> b_K A, b_Q -> b_Q A^-T. Returns (wq, wk, bq, bk, fixed_index, fixed_value) with wk in the gauge, the
    weights in the dtype of wq, wk.

    A is computed in float64 (r x r per head). With RoPE, A multiplies each rotary pair by a complex scalar z_j and
    A^-T by 1 / conj(z_j): elementwise maps in the weights' dtype (`complex_pair_scale`). Without, A = c W_K[P]^-1:
    W_K A in float64 (an inverse), W_Q A^-T = W_Q W_K[P]^T / c in the weights' dtype. Biases in float64.
    """
    d = wk.shape[-1]
    g = wq.shape[0] // (rank * num_kv_heads)
    k = wk.view(num_kv_heads, rank, d)  # (H_kv, r, d) = W_K^T per head
    q = wq.view(num_kv_heads, g, rank, d)
    if rope:
        pivots, z = complex_pair_gauge(k, scale)
        k_new = complex_pair_scale(k, z)  # (W_K A)^T
        q_new = complex_pair_scale(q, (1 / z.conj()).unsqueeze(1))  # (W_Q A^-T)^T
        a = complex_pair_matrix(z)  # (H_kv, r, r), for the biases
        fixed_index, fixed_value = rope_pivot_layout(pivots, scale)
    else:
        pivots = max_volume_rows(k.transpose(1, 2), rank)  # rows of W_K (d x r)
        block = torch.gather(k, 2, pivots.unsqueeze(1).expand(num_kv_heads, rank, rank)).double()  # W_K[P]^T
        a = scale * torch.linalg.inv(block.transpose(1, 2))  # A = c W_K[P]^-1
        k_new = _times_inverse_block(a, k, k.dtype)  # (W_K A)^T = A^T W_K^T
        q_new = _times_pivot_block(block.transpose(1, 2).unsqueeze(1), q, scale)  # (W_Q A^-T)^T = A^-1 W_Q^T
        fixed_index, fixed_value = identity_pivot_layout(pivots, scale)
    a_inv_t = torch.linalg.inv(a).transpose(1, 2)  # A^-T
    bk_new = bq_new = None
    if bk is not None:
        bk_new = (bk.double().view(num_kv_heads, 1, rank) @ a).reshape(-1).to(bk.dtype)
    if bq is not None:
        bq_new = (bq.double().view(num_kv_heads, g, 1, rank) @ a_inv_t.unsqueeze(1)).reshape(-1).to(bq.dtype)
    return (
        q_new.reshape(-1, d),
        k_new.reshape(-1, d),
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
    W_O -> B^-1 W_O = W_V[P] W_O / c for each query head of the group, b_V -> b_V B. Returns (wv, wo, bv,
    fixed_index, fixed_value), the weights in the dtypes of wv, wo. B in float64 (d_h x d_h per head); W_V B in
    float64 (an inverse), W_V[P] W_O / c in the dtype of wo.
    """
    d = wv.shape[-1]
    g = wo.shape[1] // (head_dim * num_kv_heads)
    v = wv.view(num_kv_heads, head_dim, d)  # W_V^T per head
    v64 = v.double()  # one float64 copy for the pivot search and the product
    pivots = max_volume_rows(v64.transpose(1, 2), head_dim)
    block = torch.gather(v64, 2, pivots.unsqueeze(1).expand(num_kv_heads, head_dim, head_dim))  # W_V[P]^T
    b = scale * torch.linalg.inv(block.transpose(1, 2))  # (H_kv, d_h, d_h)
    v_new = _times_inverse_block(b, v64, wv.dtype)  # (W_V B)^T = B^T W_V^T
    del v64
    o = wo.view(d, num_kv_heads, g, head_dim).permute(1, 2, 3, 0)  # W_O per head (H_kv, g, d_h, d)
    o_new = _times_pivot_block(block.transpose(1, 2).unsqueeze(1), o, scale)  # B^-1 W_O
    o_new = o_new.permute(3, 0, 1, 2).reshape(d, -1)
    bv_new = None if bv is None else (bv.double().view(num_kv_heads, 1, head_dim) @ b).reshape(-1).to(bv.dtype)
    fixed_index, fixed_value = identity_pivot_layout(pivots, scale)
    return (
        v_new.reshape(-1, d),
        o_new,
        bv_new,
        fixed_index.reshape(num_kv_heads * head_dim, -1),
        fixed_value.reshape(num_kv_heads * head_dim, -1),
    )


def _largest_magnitude(w: torch.Tensor) -> torch.Tensor:
    """Index (..., 1) of the first entry of largest |w| along the last dimension, as `w.abs().argmax(-1)` gives it,
    from the largest and the smallest entry (two reductions, no |w| of w's size)."""
    high, low = w.argmax(-1, keepdim=True), w.argmin(-1, keepdim=True)
    a, b = torch.gather(w, -1, high).abs(), torch.gather(w, -1, low).abs()
    return torch.where((a > b) | ((a == b) & (high < low)), high, low)


def mlp_to_pivot_gauge(
    w_up: torch.Tensor, w_down: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fix the SwiGLU scaling gauge: hidden unit k gets W_up[k, p_k] = c (p_k its largest entry), W_down[:, k] / c_k.

    w_up: (d_ff, d), w_down: (d, d_ff) in Linear layout. Returns (w_up, w_down, fixed_index, fixed_value). The scales
    c_k are float64, rounded to `_working_dtype` for the products (each entry within two roundings of the exact
    product), the results in the weights' dtypes."""
    pivots = _largest_magnitude(w_up)  # (d_ff, 1)
    c = scale / torch.gather(w_up, 1, pivots).double()  # (d_ff, 1)
    up_dtype, down_dtype = _working_dtype(w_up), _working_dtype(w_down)
    up_new = (w_up.to(up_dtype) * c.to(up_dtype)).to(w_up.dtype)
    down_new = (w_down.to(down_dtype) * (1 / c.T).to(down_dtype)).to(w_down.dtype)
    return up_new, down_new, pivots, torch.full(pivots.shape, float(scale))


@torch.no_grad()
def regauge_noncanonical(model: nn.Module) -> int:
    """Move every module holding a GaugeFixedLinear whose layout is not canonical (e.g. pivot values written by a LoRA
    merge, or a `config.pivot_scale` edited after the model was built) back into the canonical pivot gauge of the
    config's pivot value, with the same function, through its `full_weights` / `set_full_weights` pair (the attention
    and MLP modules). Returns how many moved."""
    count = 0
    for module in model.modules():
        gauge_fixed = [c for c in module.children() if isinstance(c, GaugeFixedLinear)]
        if not gauge_fixed or not hasattr(module, "set_full_weights"):
            continue
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
