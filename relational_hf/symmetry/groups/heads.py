"""Head-space groups: the QK and VO gauges of every layer and the QK-norm gain exchange (DESIGN.md 2.1)."""

from __future__ import annotations

import dataclasses
import math

import torch

from ...architectures import AttentionSlots, TensorSlot
from ..algebra import (
    DEFAULT_EPS,
    Degeneracy,
    FullLinear,
    RotaryCommutant,
    Subalgebra,
    balance_complex_pairs,
    balanced_factors,
    principal_rotation,
)
from .base import Algebra, ParamDict, SymmetryGroup, _DiagonalScaling, _read, _write


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


class QKNormGainExchange(_DiagonalScaling):
    """QK-norm gain exchange (Qwen3): the per-dimension gains g_q, g_k (shared by all heads of a layer) act after the
    per-head normalisation and before RoPE, so g_q -> g_q c, g_k -> g_k / c with c constant on each rotary pair
    (and free on non-rotated dimensions) leaves every score unchanged. Dimension R/2 + (r - R) per layer."""

    name = "qk_norm_gain_exchange"

    def __init__(
        self, layer: int, q_gain: TensorSlot, k_gain: TensorSlot, rotary_dim: int, offset: float = 0.0
    ) -> None:
        r = q_gain.param.shape[0]
        self.offset = offset  # the norms scale by gain + offset (Gemma 3: 1 + w)
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
        _write(self.q_gain, (self._live(self.q_gain) + self.offset) * c, out)
        _write(self.k_gain, -(self._live(self.k_gain) + self.offset) * c, out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        gq, gk = self._live(self.q_gain) + self.offset, self._live(self.k_gain) + self.offset
        return [self._reduce(gq * self._get(self.q_gain, delta) - gk * self._get(self.k_gain, delta))]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        gq, gk = self._live(self.q_gain) + self.offset, self._live(self.k_gain) + self.offset
        diag = self._reduce(gq * gq + gk * gk)
        self._set_diagonal(diag, eps)

    def act(self, element: torch.Tensor) -> None:
        c, o = self._expand(self._on(element)), self.offset
        _write(self.q_gain, (_read(self.q_gain, None) + o) * c - o, None)
        _write(self.k_gain, (_read(self.k_gain, None) + o) / c - o, None)

    def canonicalize(self) -> list[Degeneracy]:
        gq, gk = _read(self.q_gain, None) + self.offset, _read(self.k_gain, None) + self.offset
        nq, nk = self._reduce(gq * gq).sqrt(), self._reduce(gk * gk).sqrt()
        ok = (nq > 0) & (nk > 0)
        c = torch.where(ok, (nk / nq.where(ok, 1.0)).sqrt(), 1.0)
        half = self.rot // 2  # the first nonzero gain of each pair decides the sign
        lead = torch.cat([torch.where(gq[:half] != 0, gq[:half], gq[half : self.rot]), gq[self.rot :]])
        c = c * torch.where(lead < 0, -1.0, 1.0)
        self.act(c)
        return []
