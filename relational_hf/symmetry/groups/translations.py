"""Translations: affine symmetries created by softmax shift invariance, output biases and LayerNorm centring."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...architectures import AttentionSlots, TensorSlot
from ..algebra import (
    DEFAULT_EPS,
    Degeneracy,
)
from .base import Algebra, ParamDict, SymmetryGroup, _read, _write


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
