"""Continuous symmetry groups of a model's weights as stored (DESIGN.md 2.1), built through the architecture adapter.

Each group is a small object that knows, for the live parameters of one model:
- its dimension (the orbit dimension it contributes, generic weights);
- its finite action (`act`, used for random group elements and for canonical forms) and its canonical
  representative (`canonicalize`, the dressing of DESIGN 2.2);
- its infinitesimal action xi: algebra -> parameter space (`vertical`), the adjoint xi^T (`adjoint`) and the
  exact inverse of its own Gram xi^T xi (`precondition`, the Sylvester solves of DESIGN 2.3), which the update
  projector combines across groups;
- its balance (moment map) xi^T(theta), conserved by gradient flow for linear actions.

Tensors are addressed through `TensorSlot`s (a parameter and a view in nn.Linear layout), so the same code serves
Llama's separate projections, GPT-2's fused Conv1D and tied embeddings. A parameter-space vector is a dict
``id(parameter) -> tensor shaped like the parameter`` (`ParamDict`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from ..architectures import AttentionSlots, NormSlots, TensorSlot, UnsupportedModelError, get_adapter
from .algebra import (
    DEFAULT_EPS,
    Conformal,
    Degeneracy,
    FullLinear,
    RotaryCommutant,
    Subalgebra,
    balance_complex_pairs,
    balanced_factors,
    lyapunov_apply,
    lyapunov_factor,
    principal_rotation,
    skew,
    symmetric_eigh,
)

logger = logging.getLogger(__name__)

ParamDict = dict[int, torch.Tensor]
Algebra = list[torch.Tensor]  # an element of a group's Lie algebra, as a list of tensors (float64)


def _is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def _read(slot: TensorSlot, src: ParamDict | None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The slot's view of the live parameter (src None, always a copy: later writes must not alias it) or of the
    vector `src`, in `dtype` (float64 for finite actions and canonical forms)."""
    if src is None:
        return slot.get().to(dtype, copy=True)
    return slot.view(src[id(slot.param)]).to(dtype)


def _write(slot: TensorSlot, value: torch.Tensor, out: ParamDict | None) -> None:
    """Set the live parameter's view to `value` (out None) or add `value` into the vector `out`."""
    if out is None:
        target = slot.view(slot.param.data)
        target.copy_(value.to(target.dtype))
    else:
        target = slot.view(out[id(slot.param)])
        target.add_(value.to(target.dtype))


def _add_product(slot: TensorSlot, a: torch.Tensor, b: torch.Tensor, out: ParamDict, alpha: float = 1.0) -> None:
    """Add alpha * a * b (broadcasting) into the vector `out` at the slot's view, without a temporary where the
    dtypes agree."""
    target = slot.view(out[id(slot.param)])
    if a.dtype == target.dtype and b.dtype == target.dtype:
        target.addcmul_(a, b, value=alpha)
    else:
        target.add_((alpha * a * b).to(target.dtype))


class SymmetryGroup:
    """One continuous symmetry group of the stored weights. Subclasses set `name` and implement the methods."""

    name: str = "group"
    #: False for a group that is only counted (its action on stored factors is not linear, e.g. a residual rotation
    #: of a pivot-gauge model, which must re-gauge after rotating): no vertical/adjoint/act.
    linear: bool = True
    #: True when `precondition` is the exact (eps-regularised) inverse of the group's own Gram xi^T xi, so that a
    #: projection may eliminate the group in one solve (the update projector relies on it for groups that share no
    #: tensor with one another); False for a preconditioner that only approximates it
    exact_precondition: bool = True
    #: live parameters and Gram factorisations memoised during one projection (`prepare` ... `release`)
    _cache: dict | None = None
    #: dtype of the infinitesimal computations (vertical, adjoint, precondition); set by `prepare`
    _dtype: torch.dtype = torch.float64
    #: the parameter values a projection is computed at (`prepare`'s `params`; None: the live parameters)
    _source: ParamDict | None = None

    def __init__(self, layer: int | None, key: str, description: str) -> None:
        self.layer, self.key, self.description = layer, key, description

    def dimension(self) -> int:
        raise NotImplementedError

    def slots(self) -> list[TensorSlot]:
        """Every tensor the group acts on."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.slots()[0].param.device

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        """A group element (drawn on the CPU) on the parameters' device, float64."""
        return t.to(device=self.device, dtype=torch.float64)

    # --- infinitesimal action --------------------------------------------------------------------------------
    def vertical(self, x: Algebra, out: ParamDict) -> None:
        """Add xi(X) into the parameter-space vector `out`."""
        raise NotImplementedError

    def adjoint(self, delta: ParamDict) -> Algebra:
        """xi^T(delta), projected onto the group's Lie algebra."""
        raise NotImplementedError

    def _live(self, slot: TensorSlot) -> torch.Tensor:
        """The live parameter's view (float64), memoised between `prepare` and `release` (read-only use); during a
        projection prepared with a `params` snapshot, the snapshot's view (no copy when the dtypes agree)."""
        if self._cache is None:
            return _read(slot, None, self._dtype)
        if id(slot) not in self._cache:
            self._cache[id(slot)] = _read(slot, self._source, self._dtype)
        return self._cache[id(slot)]

    def _get(self, slot: TensorSlot, src: ParamDict | None) -> torch.Tensor:
        return self._live(slot) if src is None else _read(slot, src, self._dtype)

    def _memo(self, key: str, src: ParamDict | None, build):
        """build() memoised under `key` while a projection runs (live parameters only)."""
        if src is not None or self._cache is None:
            return build()
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        """Start a projection computed in `dtype`: memoise the live parameters and cache what `precondition`
        needs (Gram factorisations, in float64). The parameters must not change until `release`.
        `params` (dict id(parameter) -> tensor shaped like it, covering every slot): compute at these values instead
        of the live parameters (read in place, never written); they must not change until `release`."""
        self._eps, self._dtype, self._source = eps, dtype, params
        self._cache = {}

    def release(self) -> None:
        """End a projection: drop the memoised parameters and factorisations."""
        self._cache = None
        self._source = None
        self._dtype = torch.float64

    def precondition(self, y: Algebra) -> Algebra:
        """(xi^T xi)^-1 y for this group alone (regularised by eps on rank-deficient directions)."""
        raise NotImplementedError

    def balance(self) -> Algebra:
        """Moment map xi^T(theta): e.g. W_Q^T W_Q - W_K^T W_K for a QK gauge, projected onto the algebra."""
        return self.adjoint({id(s.param): s.param.detach() for s in self.slots()})

    # --- finite action ---------------------------------------------------------------------------------------
    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> object:
        raise NotImplementedError

    def act(self, element: object) -> None:
        """Move the live parameters by a group element (in place, function unchanged)."""
        raise NotImplementedError

    def canonicalize(self) -> list[Degeneracy]:
        """Move the live parameters to this group's canonical representative; returns degeneracies found."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key}, dim={self.dimension()})"


# ----------------------------------------------------------------------------------------------------------------
# Head-space groups
# ----------------------------------------------------------------------------------------------------------------


def _heads_from_rows(w: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """(heads*width, d) Linear weight -> (heads, d, width) per-head factors in math layout."""
    return w.reshape(heads, width, -1).transpose(1, 2)


def _rows_from_heads(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `_heads_from_rows`."""
    return x.transpose(1, 2).reshape(-1, x.shape[1])


def _append_bias(x: torch.Tensor, bias: torch.Tensor | None, heads: int, width: int) -> torch.Tensor:
    """Augment per-head factors (heads, d, width) with the bias as an extra input row: (heads, d + 1, width)."""
    return x if bias is None else torch.cat([x, bias.reshape(heads, 1, width)], dim=1)


class QKGauge(SymmetryGroup):
    """QK gauge of one layer: per key/value head m an A_m in the subgroup with Lie algebra `algebra`, shared by the
    g query heads of its group (GQA): W_Q -> W_Q A, W_K -> W_K A^-T, b_Q -> b_Q A, b_K -> b_K A^-T.
    Invariant: G_QK = [W_Q; b_Q] [W_K; b_K]^T (and the rotary scores when A commutes with RoPE).
    With `key_bias_free` (the key bias is itself a translation symmetry, `KeyBiasShift`) b_K is left to that group."""

    name = "qk_gauge"

    def __init__(
        self, layer: int, slots: AttentionSlots, algebra: Subalgebra, description: str, key_bias_free: bool = False
    ) -> None:
        super().__init__(layer, f"layers.{layer}.{self.name}", description)
        if key_bias_free:
            slots = dataclasses.replace(slots, k_bias=None)
        self.s, self.algebra = slots, algebra
        self.h, self.hkv, self.r = slots.num_heads, slots.num_kv_heads, slots.qk_dim
        self.g = self.h // self.hkv

    def dimension(self) -> int:
        return self.hkv * self.algebra.dimension()

    def slots(self) -> list[TensorSlot]:
        return [x for x in (self.s.q, self.s.k, self.s.q_bias, self.s.k_bias) if x is not None]

    def _factors(self, src: ParamDict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Q (H_kv, g, d', r) and K (H_kv, d', r), d' = d (+1 with a bias row)."""
        return self._memo("factors", src, lambda: self._assemble(src))

    def _assemble(self, src: ParamDict | None) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        q = _heads_from_rows(self._get(s.q, src), self.h, self.r)
        q = _append_bias(q, None if s.q_bias is None else self._get(s.q_bias, src), self.h, self.r)
        k = _heads_from_rows(self._get(s.k, src), self.hkv, self.r)
        k = _append_bias(k, None if s.k_bias is None else self._get(s.k_bias, src), self.hkv, self.r)
        return q.reshape(self.hkv, self.g, *q.shape[1:]), k

    def _emit(self, q: torch.Tensor, k: torch.Tensor, out: ParamDict | None) -> None:
        s = self.s
        q = q.reshape(self.h, *q.shape[2:])
        d = s.q.get().shape[1]
        _write(s.q, _rows_from_heads(q[:, :d]), out)
        if s.q_bias is not None:
            _write(s.q_bias, q[:, d].reshape(-1), out)
        _write(s.k, _rows_from_heads(k[:, :d]), out)
        if s.k_bias is not None:
            _write(s.k_bias, k[:, d].reshape(-1), out)

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        q, k = self._factors()
        (a,) = x
        self._emit(q @ a[:, None], k @ -a.transpose(1, 2), out)  # negating the small factor: same values

    def adjoint(self, delta: ParamDict) -> Algebra:
        q, k = self._factors()
        dq, dk = self._factors(delta)
        y = (q.transpose(-1, -2) @ dq).sum(1) - dk.transpose(-1, -2) @ k
        return [self.algebra.project(y)]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        q, k = self._factors()
        self._gram = self.algebra.factor((q.transpose(-1, -2) @ q).sum(1), k.transpose(-1, -2) @ k, eps)

    def precondition(self, y: Algebra) -> Algebra:
        return [self.algebra.solve(self._gram, y[0]).to(self._dtype)]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return torch.linalg.matrix_exp(self.algebra.random((self.hkv,), generator, scale / math.sqrt(self.r)))

    def act(self, element: torch.Tensor) -> None:
        q, k = self._factors()
        a = self._on(element)
        self._emit(q @ a[:, None], k @ torch.linalg.inv(a).transpose(1, 2), None)

    def canonicalize(self) -> list[Degeneracy]:
        q, k = self._factors()
        alg = self.algebra
        if isinstance(alg, FullLinear):
            stacked = q.reshape(self.hkv, -1, self.r)  # (H_kv, g d', r)
            q_new, k_new, _, degs = balanced_factors(stacked, k)
            self._emit(q_new.reshape(q.shape), k_new, None)
            return degs
        assert isinstance(alg, RotaryCommutant)
        degs: list[Degeneracy] = []
        a = torch.eye(self.r, dtype=torch.float64, device=q.device).repeat(self.hkv, 1, 1)
        j, kk = alg._j, alg._k
        if len(j):
            stacked = q.reshape(self.hkv, -1, self.r)
            qc = torch.complex(stacked[..., j], stacked[..., kk])
            kc = torch.complex(k[..., j], k[..., kk])
            z = balance_complex_pairs(qc, kc, rotations_only=not alg.scalings)
            a = alg.from_pairs(z.real, z.imag, like=torch.zeros_like(a)) + _identity_off_pairs(alg, a)
        self.act(a)
        if alg.pass_block and alg.rotary_dim < self.r:
            q, k = self._factors()
            rot = alg.rotary_dim
            stacked = q.reshape(self.hkv, -1, self.r)
            q_pass, k_pass, _, degs = balanced_factors(stacked[..., rot:], k[..., rot:])
            stacked = stacked.clone()
            stacked[..., rot:] = q_pass
            k = k.clone()
            k[..., rot:] = k_pass
            self._emit(stacked.reshape(q.shape), k, None)
        return degs


def _identity_off_pairs(alg: RotaryCommutant, like: torch.Tensor) -> torch.Tensor:
    """Identity on every coordinate that is not in an active rotary pair, shaped and placed like `like` (b, n, n)."""
    diag = torch.ones(like.shape[-1], dtype=like.dtype, device=like.device)
    diag[alg._j.to(like.device)] = 0.0
    diag[alg._k.to(like.device)] = 0.0
    return torch.diag_embed(diag.expand(like.shape[:-1]))


class VOGauge(SymmetryGroup):
    """VO gauge of one layer: per key/value head m a B_m (GL(d_h), or CO(d_h) under value-space parallel removal),
    shared by its query heads: W_V -> W_V B, W_O^h -> B^-1 W_O^h, b_V -> b_V B. Invariant: G_VO = [W_V; b_V] W_O."""

    name = "vo_gauge"

    def __init__(self, layer: int, slots: AttentionSlots, algebra: Subalgebra, description: str) -> None:
        super().__init__(layer, f"layers.{layer}.{self.name}", description)
        self.s, self.algebra = slots, algebra
        self.h, self.hkv, self.dh = slots.num_heads, slots.num_kv_heads, slots.head_dim
        self.g = self.h // self.hkv

    def dimension(self) -> int:
        return self.hkv * self.algebra.dimension()

    def slots(self) -> list[TensorSlot]:
        return [x for x in (self.s.v, self.s.o, self.s.v_bias) if x is not None]

    def _factors(self, src: ParamDict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """V (H_kv, d', d_h) and O (H_kv, g, d_h, d) (W_O^h per query head)."""
        return self._memo("factors", src, lambda: self._assemble(src))

    def _assemble(self, src: ParamDict | None) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        v = _heads_from_rows(self._get(s.v, src), self.hkv, self.dh)
        v = _append_bias(v, None if s.v_bias is None else self._get(s.v_bias, src), self.hkv, self.dh)
        o = self._get(s.o, src)  # (d, H d_h)
        o = o.reshape(o.shape[0], self.hkv, self.g, self.dh).permute(1, 2, 3, 0)
        return v, o

    def _emit(self, v: torch.Tensor, o: torch.Tensor, out: ParamDict | None) -> None:
        s = self.s
        d = o.shape[-1]
        _write(s.v, _rows_from_heads(v[:, :d]), out)
        if s.v_bias is not None:
            _write(s.v_bias, v[:, d].reshape(-1), out)
        _write(s.o, o.permute(3, 0, 1, 2).reshape(d, -1), out)

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        v, o = self._factors()
        (b,) = x
        self._emit(v @ b, -b[:, None] @ o, out)  # negating the small factor: same values

    def adjoint(self, delta: ParamDict) -> Algebra:
        v, o = self._factors()
        dv, do = self._factors(delta)
        y = v.transpose(-1, -2) @ dv - (do @ o.transpose(-1, -2)).sum(1)
        return [self.algebra.project(y)]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        v, o = self._factors()
        self._gram = self.algebra.factor(v.transpose(-1, -2) @ v, (o @ o.transpose(-1, -2)).sum(1), eps)

    def precondition(self, y: Algebra) -> Algebra:
        return [self.algebra.solve(self._gram, y[0]).to(self._dtype)]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return torch.linalg.matrix_exp(self.algebra.random((self.hkv,), generator, scale / math.sqrt(self.dh)))

    def act(self, element: torch.Tensor) -> None:
        v, o = self._factors()
        b = self._on(element)
        self._emit(v @ b, torch.linalg.solve(b[:, None], o), None)

    def canonicalize(self) -> list[Degeneracy]:
        v, o = self._factors()
        if isinstance(self.algebra, FullLinear):
            o_rows = o.permute(0, 1, 3, 2).reshape(self.hkv, -1, self.dh)  # (H_kv, g d, d_h) = stacked W_O^T
            v_new, o_new, _, degs = balanced_factors(v, o_rows)
            o_new = o_new.reshape(self.hkv, self.g, -1, self.dh).permute(0, 1, 3, 2)
            self._emit(v_new, o_new, None)
            return degs
        # CO(d_h): balance the scale |V| = |O|, then rotate into the eigenbasis of V^T V (principal axes).
        vn, on = v.flatten(1).norm(dim=1), o.flatten(1).norm(dim=1)
        ok = (vn > 0) & (on > 0)
        scale = torch.where(ok, (on / vn.where(ok, 1.0)).sqrt(), 1.0)
        degs = []
        rots = []
        for m in range(self.hkv):
            rot, head_degs = principal_rotation(v[m].T @ v[m], v[m])
            rots.append(rot)
            degs += [Degeneracy(m, dg.indices, dg.value) for dg in head_degs]
        self.act(scale[:, None, None] * torch.stack(rots))
        return degs


class _DiagonalScaling(SymmetryGroup):
    """A group of independent positive scalings (a torus): its Gram is diagonal, so the preconditioner is its exact
    inverse, and random elements are exp of Gaussian log-scales."""

    def _set_diagonal(self, diag: torch.Tensor, eps: float) -> None:
        self._diag = diag + eps * diag.mean() + torch.finfo(diag.dtype).tiny

    def precondition(self, y: Algebra) -> Algebra:
        return [y[0] / self._diag]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return torch.exp(scale * torch.randn(self.dimension(), generator=generator, dtype=torch.float64))


class QKNormGainExchange(_DiagonalScaling):
    """QK-norm gain exchange (Qwen3): the per-dimension gains g_q, g_k (shared by all heads of a layer) act after the
    per-head normalisation and before RoPE, so g_q -> g_q c, g_k -> g_k / c with c constant on each rotary pair
    (and free on non-rotated dimensions) leaves every score unchanged. Dimension R/2 + (r - R) per layer."""

    name = "qk_norm_gain_exchange"

    def __init__(self, layer: int, q_gain: TensorSlot, k_gain: TensorSlot, rotary_dim: int) -> None:
        r = q_gain.param.shape[0]
        super().__init__(
            layer, f"layers.{layer}.{self.name}", "g_q -> g_q c, g_k -> g_k / c, c constant per rotary pair"
        )
        self.q_gain, self.k_gain, self.r, self.rot = q_gain, k_gain, r, rotary_dim
        half = rotary_dim // 2
        index = torch.cat([torch.arange(half), torch.arange(half), torch.arange(half, half + r - rotary_dim)])
        self.index = index  # coordinate -> exchange parameter
        self.n = half + r - rotary_dim

    def dimension(self) -> int:
        return self.n

    def slots(self) -> list[TensorSlot]:
        return [self.q_gain, self.k_gain]

    def _expand(self, c: torch.Tensor) -> torch.Tensor:
        return c[self.index.to(c.device)]

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.n, dtype=t.dtype, device=t.device).index_add_(0, self.index.to(t.device), t)

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        c = self._expand(x[0])
        _write(self.q_gain, self._live(self.q_gain) * c, out)
        _write(self.k_gain, -self._live(self.k_gain) * c, out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        gq, gk = self._live(self.q_gain), self._live(self.k_gain)
        return [self._reduce(gq * self._get(self.q_gain, delta) - gk * self._get(self.k_gain, delta))]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        gq, gk = self._live(self.q_gain), self._live(self.k_gain)
        diag = self._reduce(gq * gq + gk * gk)
        self._set_diagonal(diag, eps)

    def act(self, element: torch.Tensor) -> None:
        c = self._expand(self._on(element))
        _write(self.q_gain, _read(self.q_gain, None) * c, None)
        _write(self.k_gain, _read(self.k_gain, None) / c, None)

    def canonicalize(self) -> list[Degeneracy]:
        gq, gk = _read(self.q_gain, None), _read(self.k_gain, None)
        nq, nk = self._reduce(gq * gq).sqrt(), self._reduce(gk * gk).sqrt()
        ok = (nq > 0) & (nk > 0)
        c = torch.where(ok, (nk / nq.where(ok, 1.0)).sqrt(), 1.0)
        half = self.rot // 2  # the first nonzero gain of each pair decides the sign
        lead = torch.cat([torch.where(gq[:half] != 0, gq[:half], gq[half : self.rot]), gq[self.rot :]])
        c = c * torch.where(lead < 0, -1.0, 1.0)
        self.act(c)
        return []


# ----------------------------------------------------------------------------------------------------------------
# Scalings: norm gains and gated-MLP scales
# ----------------------------------------------------------------------------------------------------------------


class NormGain(_DiagonalScaling):
    """Norm gain of one normalisation: g -> g c (and a LayerNorm bias b -> b c), the d input columns of every reader
    divided by c. Invariant: the folded reader weights W diag(g)."""

    name = "norm_gain"

    def __init__(
        self, layer: int | None, key: str, norm: NormSlots, readers: Sequence[tuple[TensorSlot, TensorSlot | None]]
    ) -> None:
        super().__init__(layer, key, "g -> g c, reader columns / c (d per foldable norm)")
        assert norm.gain is not None
        self.gain, self.bias, self.readers = norm.gain, norm.bias, [w for w, _ in readers]

    def dimension(self) -> int:
        return self.gain.param.shape[0]

    def slots(self) -> list[TensorSlot]:
        return [self.gain] + ([self.bias] if self.bias is not None else []) + self.readers

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        c = x[0]
        _write(self.gain, self._live(self.gain) * c, out)
        if self.bias is not None:
            _write(self.bias, self._live(self.bias) * c, out)
        for w in self.readers:
            _add_product(w, self._live(w), c, out, -1.0)

    def adjoint(self, delta: ParamDict) -> Algebra:
        y = self._live(self.gain) * self._get(self.gain, delta)
        if self.bias is not None:
            y = y + self._live(self.bias) * self._get(self.bias, delta)
        for w in self.readers:
            y = y - (self._live(w) * self._get(w, delta)).sum(0)
        return [y]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        diag = self._live(self.gain) ** 2
        if self.bias is not None:
            diag = diag + self._live(self.bias) ** 2
        for w in self.readers:
            diag = diag + (self._live(w) ** 2).sum(0)
        self._set_diagonal(diag, eps)

    def act(self, element: torch.Tensor) -> None:
        c = self._on(element)
        _write(self.gain, _read(self.gain, None) * c, None)
        if self.bias is not None:
            _write(self.bias, _read(self.bias, None) * c, None)
        for w in self.readers:
            _write(w, _read(w, None) / c, None)

    def canonicalize(self) -> list[Degeneracy]:
        g = _read(self.gain, None)
        self.act(torch.where(g != 0, 1.0 / g.where(g != 0, 1.0), 1.0))  # fold: g -> 1
        return []


class MLPScale(_DiagonalScaling):
    """Gated-MLP scales: row k of W_up (and its bias) times c_k, column k of W_down divided by c_k (SwiGLU:
    act(x W_gate) * (x W_up) is linear in W_up). Invariant: the per-unit products. Dimension d_ff per layer."""

    name = "mlp_scale"

    def __init__(self, layer: int, up: TensorSlot, down: TensorSlot, up_bias: TensorSlot | None) -> None:
        super().__init__(layer, f"layers.{layer}.{self.name}", "W_up row k * c_k, W_down column k / c_k")
        self.up, self.down, self.up_bias = up, down, up_bias

    def dimension(self) -> int:
        return self.up.get().shape[0]

    def slots(self) -> list[TensorSlot]:
        return [self.up, self.down] + ([self.up_bias] if self.up_bias is not None else [])

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        c = x[0]
        _add_product(self.up, self._live(self.up), c[:, None], out)
        if self.up_bias is not None:
            _write(self.up_bias, self._live(self.up_bias) * c, out)
        _add_product(self.down, self._live(self.down), c[None, :], out, -1.0)

    def adjoint(self, delta: ParamDict) -> Algebra:
        y = (self._live(self.up) * self._get(self.up, delta)).sum(1) - (
            self._live(self.down) * self._get(self.down, delta)
        ).sum(0)
        if self.up_bias is not None:
            y = y + self._live(self.up_bias) * self._get(self.up_bias, delta)
        return [y]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        diag = (self._live(self.up) ** 2).sum(1) + (self._live(self.down) ** 2).sum(0)
        if self.up_bias is not None:
            diag = diag + self._live(self.up_bias) ** 2
        self._set_diagonal(diag, eps)

    def act(self, element: torch.Tensor) -> None:
        c = self._on(element)
        _write(self.up, _read(self.up, None) * c[:, None], None)
        if self.up_bias is not None:
            _write(self.up_bias, _read(self.up_bias, None) * c, None)
        _write(self.down, _read(self.down, None) / c[None, :], None)

    def canonicalize(self) -> list[Degeneracy]:
        up, down = _read(self.up, None), _read(self.down, None)
        if self.up_bias is not None:
            up = torch.cat([up, _read(self.up_bias, None)[:, None]], dim=1)
        nu, nd = up.norm(dim=1), down.norm(dim=0)
        ok = (nu > 0) & (nd > 0)
        c = torch.where(ok, (nd / nu.where(ok, 1.0)).sqrt(), 1.0)
        lead = torch.gather(up, 1, up.abs().argmax(1, keepdim=True)).squeeze(1)
        self.act(c * torch.where(lead < 0, -1.0, 1.0))  # balanced |up_k| = |down_k|, largest up entry positive
        return []


# ----------------------------------------------------------------------------------------------------------------
# Translations (affine symmetries created by softmax shift invariance, output biases and LayerNorm centring)
# ----------------------------------------------------------------------------------------------------------------


class KeyBiasShift(SymmetryGroup):
    """Without rotary positions the key bias only adds q_i . b_K to every score of row i, which the softmax removes:
    b_K -> b_K + t is a symmetry (r per key head)."""

    name = "key_bias_shift"

    def __init__(self, layer: int, k_bias: TensorSlot) -> None:
        super().__init__(layer, f"layers.{layer}.{self.name}", "b_K -> b_K + t (softmax shift invariance)")
        self.k_bias = k_bias

    def dimension(self) -> int:
        return self.k_bias.get().shape[0]

    def slots(self) -> list[TensorSlot]:
        return [self.k_bias]

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        _write(self.k_bias, x[0], out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        return [self._get(self.k_bias, delta)]

    def precondition(self, y: Algebra) -> Algebra:
        return [y[0]]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return scale * torch.randn(self.dimension(), generator=generator, dtype=torch.float64)

    def act(self, element: torch.Tensor) -> None:
        _write(self.k_bias, _read(self.k_bias, None) + self._on(element), None)

    def canonicalize(self) -> list[Degeneracy]:
        _write(self.k_bias, torch.zeros_like(_read(self.k_bias, None)), None)
        return []


class ValueBiasFold(SymmetryGroup):
    """Attention rows sum to one, so b_V contributes the constant b_V W_O, which an output bias absorbs:
    b_V -> b_V + t, b_O -> b_O - sum_h t W_O^h (d_h per key/value head)."""

    name = "value_bias_fold"

    def __init__(self, layer: int, slots: AttentionSlots) -> None:
        super().__init__(layer, f"layers.{layer}.{self.name}", "b_V -> b_V + t, b_O -> b_O - t W_O")
        self.s = slots
        self.hkv, self.dh, self.g = slots.num_kv_heads, slots.head_dim, slots.num_heads // slots.num_kv_heads

    def dimension(self) -> int:
        return self.hkv * self.dh

    def slots(self) -> list[TensorSlot]:
        return [self.s.v_bias, self.s.o, self.s.o_bias]

    def _o(self) -> torch.Tensor:
        o = self._live(self.s.o)  # (d, H d_h)
        return o.reshape(o.shape[0], self.hkv, self.g, self.dh)  # W_O^h transposed, grouped

    def _bo_change(self, t: torch.Tensor) -> torch.Tensor:
        return torch.einsum("dmgk,mk->d", self._o(), t.reshape(self.hkv, self.dh))

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        _write(self.s.v_bias, x[0], out)
        _write(self.s.o_bias, -self._bo_change(x[0]), out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        dbo = self._get(self.s.o_bias, delta)
        back = torch.einsum("dmgk,d->mk", self._o(), dbo).reshape(-1)
        return [self._get(self.s.v_bias, delta) - back]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        o = self._o()
        gram = torch.einsum("dmgk,dmgl->mkl", o, o).double()
        gram = gram + torch.eye(self.dh, dtype=torch.float64, device=gram.device)
        self._chol = torch.linalg.cholesky(gram)

    def precondition(self, y: Algebra) -> Algebra:
        t = torch.cholesky_solve(y[0].double().reshape(self.hkv, self.dh, 1), self._chol)
        return [t.reshape(-1).to(self._dtype)]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return scale * torch.randn(self.dimension(), generator=generator, dtype=torch.float64)

    def act(self, element: torch.Tensor) -> None:
        element = self._on(element)
        change = self._bo_change(element)
        _write(self.s.v_bias, _read(self.s.v_bias, None) + element, None)
        _write(self.s.o_bias, _read(self.s.o_bias, None) - change, None)

    def canonicalize(self) -> list[Degeneracy]:
        self.act(-_read(self.s.v_bias, None))
        return []


class LayerNormBiasShift(SymmetryGroup):
    """A LayerNorm bias b feeds readers that all have biases: b -> b + t, reader biases c -> c - W t (d per norm)."""

    name = "layernorm_bias_shift"

    def __init__(
        self, layer: int | None, key: str, bias: TensorSlot, readers: Sequence[tuple[TensorSlot, TensorSlot]]
    ) -> None:
        super().__init__(layer, key, "LayerNorm bias b -> b + t, reader biases c -> c - W t")
        self.bias, self.readers = bias, list(readers)

    def dimension(self) -> int:
        return self.bias.param.shape[0]

    def slots(self) -> list[TensorSlot]:
        return [self.bias] + [s for pair in self.readers for s in pair]

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        _write(self.bias, x[0], out)
        for w, c in self.readers:
            _write(c, -(self._live(w) @ x[0]), out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        y = self._get(self.bias, delta)
        for w, c in self.readers:
            y = y - self._live(w).T @ self._get(c, delta)
        return [y]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        gram = torch.eye(self.dimension(), dtype=torch.float64, device=self.device)
        for w, _ in self.readers:
            wt = self._live(w).double()
            gram = gram + wt.T @ wt
        self._chol = torch.linalg.cholesky(gram)

    def precondition(self, y: Algebra) -> Algebra:
        return [torch.cholesky_solve(y[0].double()[:, None], self._chol)[:, 0].to(self._dtype)]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return scale * torch.randn(self.dimension(), generator=generator, dtype=torch.float64)

    def act(self, element: torch.Tensor) -> None:
        t = self._on(element)
        _write(self.bias, _read(self.bias, None) + t, None)
        for w, c in self.readers:
            _write(c, _read(c, None) - _read(w, None) @ t, None)

    def canonicalize(self) -> list[Degeneracy]:
        self.act(-_read(self.bias, None))
        return []


class CentringTranslation(SymmetryGroup):
    """With mean-centring norms (LayerNorm) as the only readers of the residual stream, its all-ones direction is
    invisible: every writer may add any multiple of 1 to its outputs. Writer weights (d, in) get 1 a^T, embedding
    rows get a_v 1, writer biases a 1. Dimension: one per writer column, embedding row and bias."""

    name = "centring_translation"

    def __init__(
        self, layer: int | None, key: str, columns: list[TensorSlot], rows: list[TensorSlot], vectors: list[TensorSlot]
    ) -> None:
        super().__init__(layer, key, "writer outputs + multiples of the all-ones direction (LayerNorm centring)")
        self.columns, self.rows, self.vectors = columns, rows, vectors
        self.d = (
            columns[0].get().shape[0] if columns else (rows[0].get().shape[1] if rows else vectors[0].get().shape[0])
        )

    def _sizes(self) -> list[int]:
        return (
            [s.get().shape[1] for s in self.columns] + [s.get().shape[0] for s in self.rows] + [1] * len(self.vectors)
        )

    def dimension(self) -> int:
        return sum(self._sizes())

    def slots(self) -> list[TensorSlot]:
        return self.columns + self.rows + self.vectors

    def _shifts(self, x: Algebra) -> list[torch.Tensor]:
        """The change of every slot for coefficients x: 1 a^T on writer weights, a 1^T on rows, a 1 on biases."""
        out, it = [], iter(x)
        for _ in self.columns:
            out.append(next(it)[None, :].expand(self.d, -1))
        for _ in self.rows:
            out.append(next(it)[:, None].expand(-1, self.d))
        for _ in self.vectors:
            out.append(next(it).expand(self.d))
        return out

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        for s, shift in zip(self.slots(), self._shifts(x), strict=True):
            _write(s, shift, out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        return (
            [self._get(s, delta).sum(0) for s in self.columns]
            + [self._get(s, delta).sum(1) for s in self.rows]
            + [self._get(s, delta).sum().reshape(1) for s in self.vectors]
        )

    def precondition(self, y: Algebra) -> Algebra:
        return [t / self.d for t in y]  # each coordinate moves d entries by one

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> Algebra:
        return [scale * torch.randn(n, generator=generator, dtype=torch.float64) for n in self._sizes()]

    def act(self, element: Algebra) -> None:
        for s, shift in zip(self.slots(), self._shifts([self._on(e) for e in element]), strict=True):
            _write(s, _read(s, None) + shift, None)

    def canonicalize(self) -> list[Degeneracy]:
        for s in self.columns:
            w = _read(s, None)
            _write(s, w - w.mean(0, keepdim=True), None)
        for s in self.rows:
            e = _read(s, None)
            _write(s, e - e.mean(1, keepdim=True), None)
        for s in self.vectors:
            b = _read(s, None)
            _write(s, b - b.mean(), None)
        return []


# ----------------------------------------------------------------------------------------------------------------
# Residual rotation
# ----------------------------------------------------------------------------------------------------------------


class ResidualReader:
    """Maps that read the residual stream through one normalisation: y = n(x) diag(g) + b, then y W^T + c."""

    def __init__(
        self, gain: TensorSlot | None, bias: TensorSlot | None, maps: list[tuple[TensorSlot, TensorSlot | None]]
    ) -> None:
        self.gain, self.bias, self.maps = gain, bias, maps


class ResidualRotation(SymmetryGroup):
    """Residual rotation x -> x R (DESIGN 2.1), R in O(d) restricted to what the stored weights allow:
    block-diagonal over `clusters` (coordinates on which a tied final gain, or a norm bias without reader biases,
    is constant) and fixing the all-ones direction when norms centre (LayerNorm). Action: rows in residual
    coordinates (embeddings, writer biases, such norm biases) M -> M R; writers W (d, in) -> R^T W; readers behind a
    norm with gain g: W -> W D R D^-1 (D = diag g), reader biases c -> c + (W - W') b.
    Dimension: sum over clusters of m(m-1)/2, or (m-1)(m-2)/2 with centring."""

    name = "residual_rotation"
    #: `precondition` solves with C = sum of the tensors' own Grams, ignoring reader gains and the restriction to
    #: clusters and to the all-ones complement: a preconditioner, not the inverse of the group's Gram
    exact_precondition = False

    def __init__(
        self,
        d: int,
        rows: list[TensorSlot],
        writers: list[TensorSlot],
        readers: list[ResidualReader],
        clusters: list[list[int]] | None,
        centring: bool,
        linear: bool = True,
        note: str = "",
    ) -> None:
        desc = "x -> x R on the residual stream" + (", R fixing the all-ones direction" if centring else "")
        super().__init__(None, self.name, desc + (f"; {note}" if note else ""))
        self.d, self.rows, self.writers, self.readers = d, rows, writers, readers
        self.clusters = clusters if clusters is not None else [list(range(d))]
        self.centring, self.linear = centring, linear
        mask = torch.zeros(d, d, dtype=torch.float64)
        proj = torch.zeros(d, d, dtype=torch.float64)
        for cluster in self.clusters:
            idx = torch.tensor(cluster)
            mask[idx[:, None], idx[None, :]] = 1.0
            m = len(cluster)
            block = torch.eye(m, dtype=torch.float64) - (1.0 / m if centring else 0.0)
            proj[idx[:, None], idx[None, :]] = block
        self._mask, self._proj = mask, proj
        self._placed: dict = {}

    def dimension(self) -> int:
        if self.centring:
            return sum((len(c) - 1) * (len(c) - 2) // 2 for c in self.clusters if len(c) > 1)
        return sum(len(c) * (len(c) - 1) // 2 for c in self.clusters)

    def slots(self) -> list[TensorSlot]:
        out = self.rows + self.writers
        for rd in self.readers:
            out += [s for s in (rd.gain, rd.bias) if s is not None]
            out += [s for pair in rd.maps for s in pair if s is not None]
        return out

    def project(self, y: torch.Tensor) -> torch.Tensor:
        """Orthogonal projection of a d x d matrix onto the group's Lie algebra."""
        key = (y.device, y.dtype)
        if key not in self._placed:  # d x d constants, moved once per device and dtype
            self._placed[key] = (
                self._proj.to(device=y.device, dtype=y.dtype),
                self._mask.to(device=y.device, dtype=y.dtype),
            )
        p, mask = self._placed[key]
        return p @ (skew(y) * mask) @ p

    def _gain(self, rd: ResidualReader) -> torch.Tensor:
        return torch.ones(self.d, dtype=self._dtype, device=self.device) if rd.gain is None else self._live(rd.gain)

    def _bias(self, rd: ResidualReader) -> torch.Tensor | None:
        return None if rd.bias is None else self._live(rd.bias)

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        om = x[0]
        for s in self.rows:
            _write(s, (_rows(self._live(s)) @ om).reshape(s.get().shape), out)
        for s in self.writers:
            _write(s, -(om @ self._live(s)), out)
        for rd in self.readers:
            g, b = self._gain(rd), self._bias(rd)
            for w, c in rd.maps:
                dw = ((self._live(w) * g) @ om) / g
                _write(w, dw, out)
                if c is not None and b is not None:
                    _write(c, -(dw @ b), out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        y = torch.zeros(self.d, self.d, dtype=self._dtype, device=self.device)
        for s in self.rows:
            y = y + _rows(self._live(s)).T @ _rows(self._get(s, delta))
        for s in self.writers:
            y = y - self._get(s, delta) @ self._live(s).T
        for rd in self.readers:
            g, b = self._gain(rd), self._bias(rd)
            for w, c in rd.maps:
                wg = self._live(w) * g
                y = y + wg.T @ (self._get(w, delta) / g)
                if c is not None and b is not None:
                    y = y - torch.outer(wg.T @ self._get(c, delta), b / g)
        return [self.project(y)]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        c = torch.zeros(self.d, self.d, dtype=torch.float64, device=self.device)
        for s in self.rows:
            m = _rows(self._live(s)).double()
            c = c + m.T @ m
        for s in self.writers:
            w = self._live(s).double()
            c = c + w @ w.T
        for rd in self.readers:
            for w, _ in rd.maps:
                wt = self._live(w).double()
                c = c + wt.T @ wt
        self._c_factors = lyapunov_factor(symmetric_eigh(c), eps)

    def precondition(self, y: Algebra) -> Algebra:
        return [self.project(lyapunov_apply(self._c_factors, y[0])).to(self._dtype)]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        x = torch.randn(self.d, self.d, generator=generator, dtype=torch.float64) * scale / math.sqrt(self.d)
        return torch.linalg.matrix_exp(self.project(x))  # on the CPU, like every drawn element

    def act(self, element: torch.Tensor) -> None:
        rot = self._on(element)
        for s in self.rows:
            _write(s, (_rows(_read(s, None)) @ rot).reshape(s.get().shape), None)
        for s in self.writers:
            _write(s, rot.T @ _read(s, None), None)
        for rd in self.readers:
            g, b = self._gain(rd), self._bias(rd)
            for w, c in rd.maps:
                old = _read(w, None)
                new = ((old * g) @ rot) / g
                _write(w, new, None)
                if c is not None and b is not None:
                    _write(c, _read(c, None) + (old - new) @ b, None)

    def principal_gauge(self, embedding: torch.Tensor) -> tuple[torch.Tensor, list[Degeneracy]]:
        """The rotation R of the principal gauge: per cluster the eigenbasis of the embedding Gram E^T E (inside
        the complement of the all-ones direction when centring), signs fixed on the embedding's columns."""
        emb = embedding.double()
        rot = torch.zeros(self.d, self.d, dtype=torch.float64, device=emb.device)
        degs = []
        for cluster in self.clusters:
            idx = torch.tensor(cluster, device=emb.device)
            e = emb[:, idx]
            m = len(cluster)
            if self.centring and m > 1:
                basis = _centred_basis(m).to(emb.device)  # (m, m-1), orthonormal basis of 1^perp
                z, cd = principal_rotation(basis.T @ e.T @ e @ basis, e @ basis)
                ones = torch.full((m, 1), 1.0 / math.sqrt(m), dtype=torch.float64, device=emb.device)
                block = ones @ ones.T + basis @ z @ basis.T
            elif self.centring:
                block, cd = torch.ones(1, 1, dtype=torch.float64, device=emb.device), []
            else:
                block, cd = principal_rotation(e.T @ e, e)
            rot[idx[:, None], idx[None, :]] = block
            degs += [Degeneracy(-1, [cluster[i] for i in dg.indices], dg.value) for dg in cd]
        return rot, degs

    def canonicalize(self) -> list[Degeneracy]:
        """Principal gauge from the token embedding (the first row tensor), applied to every tensor."""
        rot, degs = self.principal_gauge(_read(self.rows[0], None))
        self.act(rot)
        return degs


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _centred_basis(m: int) -> torch.Tensor:
    """A fixed orthonormal basis (m, m-1) of the complement of the all-ones vector (Helmert-type)."""
    a = torch.eye(m, dtype=torch.float64)[:, : m - 1] - 1.0 / m
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r))[None, :]


# ----------------------------------------------------------------------------------------------------------------
# Building the groups of a model through its adapter
# ----------------------------------------------------------------------------------------------------------------


def _value_clusters(values: torch.Tensor) -> list[list[int]]:
    """Coordinates grouped by equal value (a diagonal gain's commutant is block diagonal on these)."""
    groups: dict[float, list[int]] = {}
    for i, v in enumerate(values.detach().double().cpu().tolist()):
        groups.setdefault(v, []).append(i)
    return sorted(groups.values(), key=lambda c: c[0])


def _qk_algebra(
    slots: AttentionSlots, inv_freq: torch.Tensor | None, notes: list[str], layer: int
) -> tuple[Subalgebra, str]:
    r, rot = slots.qk_dim, slots.rotary_dim
    if slots.q_norm is not None:
        gq, gk = slots.q_norm.param, slots.k_norm.param
        half = rot // 2
        if _is_meta(gq):
            mask = torch.ones(half, dtype=torch.bool)
            if layer == 0:
                notes.append(
                    "QK-norm gains not materialised (meta device): rotations counted on every rotary pair, "
                    "as for freshly initialised gains"
                )
        else:
            gq64, gk64 = gq.detach().double().cpu(), gk.detach().double().cpu()
            mask = (gq64[:half] == gq64[half:rot]) & (gk64[:half] == gk64[half:rot])
        alg = RotaryCommutant(r, rot, pair_mask=mask, scalings=False, pass_block=False)
        return alg, (
            f"QK-norm: per-head normalisation admits only rotations, on the {int(mask.sum())}/{half} rotary "
            "pairs whose q/k gains are equal (per key head)"
        )
    if rot == 0:
        return FullLinear(r), "full GL(r) per key head (no rotary positions)"
    if inv_freq is not None and not _is_meta(inv_freq) and inv_freq.unique().numel() < inv_freq.numel():
        notes.append(f"layer {layer}: repeated rotary frequencies; the commutant is larger than counted")
    if rot < r:
        return RotaryCommutant(r, rot), f"RoPE commutant on {rot} rotary dims + GL({r - rot}) on the rest, per key head"
    return RotaryCommutant(r, rot), "RoPE commutant (a complex scalar per rotary pair): r per key head"


def symmetry_groups(model: nn.Module) -> tuple[list[SymmetryGroup], list[str]]:
    """The continuous symmetry groups that hold for `model`'s weights as stored, and notes on what breaks others.

    Raises UnsupportedModelError ("unsupported: <class>") for a model no adapter knows."""
    adapter = get_adapter(model)
    notes: list[str] = []
    groups: list[SymmetryGroup] = []
    inv_freq = adapter.rope_inv_freq()
    layers = adapter.layers()
    d = adapter.embedding().weight.shape[1]
    centring = False
    rows = list(adapter.embedding_slots())
    writers: list[TensorSlot] = []
    readers: list[ResidualReader] = []
    residual_linear = True
    translation_columns: dict[int | None, list[TensorSlot]] = {}
    translation_vectors: dict[int | None, list[TensorSlot]] = {}
    for layer in layers:
        i = layer.index
        att = adapter.attention_slots(layer)
        mlp = adapter.mlp_slots(layer)
        # --- QK
        if att.qk_gauge_fixed:
            if i == 0:
                notes.append("QK gauge fixed in storage (pivot gauge): no QK redundancy left")
        else:
            alg, desc = _qk_algebra(att, inv_freq, notes, i)
            if alg.dimension() > 0:
                groups.append(QKGauge(i, att, alg, desc, key_bias_free=_key_bias_free(att)))
            if att.q_norm is not None:
                groups.append(QKNormGainExchange(i, att.q_norm, att.k_norm, att.rotary_dim))
                if i == 0:
                    notes.append(
                        "QK-norm: the per-head scale of W_Q/W_K is a symmetry only up to the norm's epsilon, "
                        "so it is not counted"
                    )
        if _key_bias_free(att):
            groups.append(KeyBiasShift(i, att.k_bias))
        # --- VO
        if att.vo_gauge_fixed:
            if i == 0:
                notes.append("VO gauge fixed in storage (pivot gauge): no VO redundancy left")
        elif att.v is not None:
            if att.value_parallel_removal:
                groups.append(
                    VOGauge(
                        i,
                        att,
                        Conformal(att.head_dim),
                        "CO(d_h) = scalings x rotations per kv head (value-space parallel removal breaks GL(d_h))",
                    )
                )
            else:
                groups.append(VOGauge(i, att, FullLinear(att.head_dim), "GL(d_h) per key/value head"))
        if att.v_bias is not None and att.o_bias is not None and not att.value_parallel_removal:
            groups.append(ValueBiasFold(i, att))
        # --- MLP
        if mlp.gated and not mlp.scale_fixed:
            groups.append(MLPScale(i, mlp.up, mlp.down, mlp.up_bias))
        # --- norms before attention and MLP
        for tag, norm, maps in (
            ("attention_norm", layer.attention_norm, [(att.q, att.q_bias), (att.k, att.k_bias), (att.v, att.v_bias)]),
            ("mlp_norm", layer.mlp_norm, mlp.readers()),
        ):
            ns = adapter.norm_slots(norm)
            centring = centring or ns.centring
            if any(w is None for w, _ in maps):  # gauge-fixed readers: reached through full weights only
                residual_linear = False
            maps = [(w, b) for w, b in maps if w is not None]
            if ns.gain is not None:
                groups.append(NormGain(i, f"layers.{i}.{tag}_gain", ns, maps))
            if ns.bias is not None:
                if all(b is not None for _, b in maps):
                    groups.append(LayerNormBiasShift(i, f"layers.{i}.{tag}_bias_shift", ns.bias, maps))
                else:
                    raise UnsupportedModelError(
                        f"unsupported: {type(adapter.model).__name__} (a norm bias read by maps without biases)"
                    )
            readers.append(ResidualReader(ns.gain, ns.bias, maps))
        # --- writers
        if att.o is not None:
            writers.append(att.o)
            translation_columns.setdefault(i, []).append(att.o)
        if att.o_bias is not None:
            rows.append(att.o_bias)
            translation_vectors.setdefault(i, []).append(att.o_bias)
        writers.append(mlp.down)
        translation_columns.setdefault(i, []).append(mlp.down)
        if mlp.down_bias is not None:
            rows.append(mlp.down_bias)
            translation_vectors.setdefault(i, []).append(mlp.down_bias)

    # --- final norm and head
    final = adapter.norm_slots(adapter.final_norm())
    head = adapter.head_slot()
    tied = adapter.head_tied()
    clusters = None
    if head is not None and not tied:
        if final.gain is not None:
            groups.append(NormGain(None, "final_norm_gain", final, [(head, None)]))
        if final.bias is not None:
            rows.append(final.bias)  # no head bias to absorb it: it rotates with the stream, gains must commute
            clusters = _gain_clusters(final.gain, notes)
        else:
            readers.append(ResidualReader(final.gain, None, [(head, None)]))
    elif head is not None:
        if final.gain is not None:
            notes.append("final norm gain not foldable: the output head is tied to the embedding")
            clusters = _gain_clusters(final.gain, notes)
        if final.bias is not None:
            rows.append(final.bias)

    # --- residual stream
    if centring:
        notes.append(
            "LayerNorm centring: residual rotations must fix the all-ones direction (O(d) -> O(d-1)); the "
            "all-ones direction of every writer becomes a translation symmetry"
        )
        embed_rows = adapter.embedding_slots()
        global_rows = [s for s in embed_rows if not (tied and s.param is adapter.embedding().weight)]
        if tied:
            notes.append("token-embedding translations broken by the tied head")
        for i in sorted(k for k in translation_columns if k is not None):
            groups.append(
                CentringTranslation(
                    i, f"layers.{i}.centring_translation", translation_columns[i], [], translation_vectors.get(i, [])
                )
            )
        if global_rows:
            groups.append(CentringTranslation(None, "embeddings.centring_translation", [], global_rows, []))
    if len(adapter.embedding_slots()) > 1:
        notes.append("absolute position embeddings rotate with the stream: they do not break the residual rotation")
    if head is None:
        notes.append(
            "no LM head known to the adapter: the outputs read the residual stream directly, and a residual rotation "
            "changes, so it is not a symmetry"
        )
        return groups, notes
    note = "" if residual_linear else "counted only: factors stored gauge-fixed (canonicalize re-gauges)"
    residual = ResidualRotation(d, rows, writers, readers, clusters, centring, linear=residual_linear, note=note)
    if residual.dimension() > 0:
        groups.append(residual)
    return groups, notes


def _key_bias_free(att: AttentionSlots) -> bool:
    """The key bias cancels in the softmax: no rotary positions (which would rotate it per position), no QK-norm."""
    return att.k_bias is not None and att.rotary_dim == 0 and att.q_norm is None and not att.qk_gauge_fixed


def _gain_clusters(gain: TensorSlot | None, notes: list[str]) -> list[list[int]] | None:
    if gain is None:
        return None
    if _is_meta(gain.param):
        notes.append("final norm gain not materialised (meta device): assumed constant (as initialised)")
        return None
    clusters = _value_clusters(gain.param)
    if len(clusters) > 1:
        notes.append(f"residual rotation reduced to the commutant of the final gain ({len(clusters)} distinct values)")
    return clusters


__all__ = [
    "CentringTranslation",
    "KeyBiasShift",
    "LayerNormBiasShift",
    "MLPScale",
    "NormGain",
    "QKGauge",
    "QKNormGainExchange",
    "ResidualRotation",
    "SymmetryGroup",
    "VOGauge",
    "ValueBiasFold",
    "symmetry_groups",
]
