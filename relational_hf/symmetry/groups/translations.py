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

    def __init__(self, layer: int, k_bias: TensorSlot, index: torch.Tensor | None = None) -> None:
        super().__init__(layer, f"layers.{layer}.{self.name}", "b_K -> b_K + t (softmax shift invariance)")
        self.k_bias = k_bias
        #: the coordinates that may move: all, or with partial rotary the non-rotated ones of every key head
        self.index = index

    def dimension(self) -> int:
        return self.k_bias.get().shape[0] if self.index is None else len(self.index)

    def slots(self) -> list[TensorSlot]:
        return [self.k_bias]

    def _spread(self, t: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return t
        return t.new_zeros(self.k_bias.get().shape[0]).index_copy_(0, self.index.to(t.device), t)

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        _write(self.k_bias, self._spread(x[0]), out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        y = self._get(self.k_bias, delta)
        return [y if self.index is None else y[self.index.to(y.device)]]

    def precondition(self, y: Algebra) -> Algebra:
        return [y[0]]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return scale * torch.randn(self.dimension(), generator=generator, dtype=torch.float64)

    def act(self, element: torch.Tensor) -> None:
        _write(self.k_bias, _read(self.k_bias, None) + self._spread(self._on(element)), None)

    def canonicalize(self) -> list[Degeneracy]:
        b = _read(self.k_bias, None)
        self.act(-(b if self.index is None else b[self.index.to(b.device)]))
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


class ReaderCentringTranslation(SymmetryGroup):
    """The readers of a mean-centring norm (LayerNorm) see y = n(x) diag(g) + b with n(x) . 1 = 0, so y . w = b . w
    for w = 1 / g is a constant: every output row k of a reader may add u_k w^T to its weight if its bias absorbs the
    constant, W -> W + u w^T, c -> c - (b . w) u (without a norm bias, c may be absent). Dimension: the readers'
    output features."""

    name = "reader_centring_translation"

    def __init__(
        self, layer: int | None, key: str, gain: TensorSlot | None, bias: TensorSlot | None, maps, offset: float = 0.0
    ) -> None:
        super().__init__(layer, key, "reader rows + u (1/g), reader biases - (b . 1/g) u (LayerNorm centring)")
        self.gain, self.bias, self.maps, self.offset = gain, bias, list(maps), offset

    def dimension(self) -> int:
        return sum(w.get().shape[0] for w, _ in self.maps)

    def slots(self) -> list[TensorSlot]:
        """The readers and their biases, and the norm's gain and bias that the direction is read from."""
        norm = [s for s in (self.gain, self.bias) if s is not None]
        return norm + [s for pair in self.maps for s in pair if s is not None]

    def _direction(self, read=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w = 1 / g, b . w) (the group moves neither g nor b), read by `read` (default: the live or snapshot
        values of a projection)."""
        read = read or self._live
        d = self.maps[0][0].get().shape[1]
        ones = torch.ones(d, dtype=self._dtype, device=self.device)
        w = ones if self.gain is None else 1.0 / (read(self.gain) + self.offset)
        beta = (w * read(self.bias)).sum() if self.bias is not None else w.new_zeros(())
        return w, beta

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        w, beta = self._direction()
        for (weight, bias), u in zip(self.maps, x, strict=True):
            _write(weight, torch.outer(u, w), out)
            if bias is not None:
                _write(bias, -beta * u, out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        w, beta = self._direction()
        out = []
        for weight, bias in self.maps:
            y = self._get(weight, delta) @ w
            out.append(y if bias is None else y - beta * self._get(bias, delta))
        return out

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        w, beta = self._direction()
        self._norm2 = (w * w).sum() + beta * beta

    def precondition(self, y: Algebra) -> Algebra:
        return [t / self._norm2 for t in y]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> Algebra:
        return [scale * torch.randn(w.get().shape[0], generator=generator, dtype=torch.float64) for w, _ in self.maps]

    def act(self, element: Algebra) -> None:
        w, beta = self._direction(lambda slot: _read(slot, None))
        for (weight, bias), u in zip(self.maps, element, strict=True):
            u = self._on(u)
            _write(weight, _read(weight, None) + torch.outer(u, w), None)
            if bias is not None:
                _write(bias, _read(bias, None) - beta * u, None)

    def canonicalize(self) -> list[Degeneracy]:
        """Reader rows orthogonal to 1 / g (W w = 0)."""
        w, _ = self._direction(lambda slot: _read(slot, None))
        self.act([-(_read(weight, None) @ w) / (w * w).sum() for weight, _ in self.maps])
        return []


class ParallelBiasExchange(SymmetryGroup):
    """Attention and MLP in parallel (GPT-NeoX): both read the layer input and their outputs are added together, so
    only b_O + b_down matters: b_O -> b_O + t, b_down -> b_down - t (d per layer)."""

    name = "parallel_bias_exchange"

    def __init__(self, layer: int, o_bias: TensorSlot, down_bias: TensorSlot) -> None:
        super().__init__(layer, f"layers.{layer}.{self.name}", "b_O -> b_O + t, b_down -> b_down - t")
        self.o_bias, self.down_bias = o_bias, down_bias

    def dimension(self) -> int:
        return self.o_bias.get().shape[0]

    def slots(self) -> list[TensorSlot]:
        return [self.o_bias, self.down_bias]

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        _write(self.o_bias, x[0], out)
        _write(self.down_bias, -x[0], out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        return [self._get(self.o_bias, delta) - self._get(self.down_bias, delta)]

    def precondition(self, y: Algebra) -> Algebra:
        return [y[0] / 2]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return scale * torch.randn(self.dimension(), generator=generator, dtype=torch.float64)

    def act(self, element: torch.Tensor) -> None:
        t = self._on(element)
        _write(self.o_bias, _read(self.o_bias, None) + t, None)
        _write(self.down_bias, _read(self.down_bias, None) - t, None)

    def canonicalize(self) -> list[Degeneracy]:
        """Equal halves: b_O = b_down."""
        self.act((_read(self.down_bias, None) - _read(self.o_bias, None)) / 2)
        return []


class CentringBiasExchange(SymmetryGroup):
    """A mean-centring norm with a bias b read by maps of which some have no bias (GPT-NeoX's final LayerNorm and
    untied head): y = n(x) D + b with n(x) . 1 = 0, so y M^T = n(x) D + b M^T for M = I + s w^T, w = 1 / g. Every
    reader W -> W M with b -> b M^-T leaves each y W^T unchanged. Dimension d per such norm."""

    name = "centring_bias_exchange"

    def __init__(self, layer: int | None, key: str, gain: TensorSlot | None, bias: TensorSlot, maps, offset=0.0):
        super().__init__(layer, key, "readers W -> W (I + s w^T), norm bias b -> b (I + s w^T)^-T, w = 1/g")
        self.gain, self.bias, self.maps, self.offset = gain, bias, [w for w, _ in maps], offset

    def dimension(self) -> int:
        return self.bias.param.shape[0]

    def slots(self) -> list[TensorSlot]:
        return ([self.gain] if self.gain is not None else []) + [self.bias] + self.maps

    def _w(self, read) -> torch.Tensor:
        if self.gain is None:
            return torch.ones(self.dimension(), dtype=self._dtype, device=self.device)
        return 1.0 / (read(self.gain) + self.offset)

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        s, w, b = x[0], self._w(self._live), self._live(self.bias)
        for m in self.maps:
            _write(m, torch.outer(self._live(m) @ s, w), out)
        _write(self.bias, -(b @ w) * s, out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        w, b = self._w(self._live), self._live(self.bias)
        y = -(b @ w) * self._get(self.bias, delta)
        for m in self.maps:
            y = y + self._live(m).T @ (self._get(m, delta) @ w)
        return [y]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        w, b = self._w(self._live), self._live(self.bias)
        gram = (b @ w) ** 2 * torch.eye(self.dimension(), dtype=torch.float64, device=self.device)
        for m in self.maps:
            wm = self._live(m).double()
            gram = gram + (w @ w) * (wm.T @ wm)
        self._chol = torch.linalg.cholesky(
            gram + eps * gram.diagonal().mean() * torch.eye(len(gram), device=gram.device, dtype=gram.dtype)
        )

    def precondition(self, y: Algebra) -> Algebra:
        return [torch.cholesky_solve(y[0].double()[:, None], self._chol)[:, 0].to(self._dtype)]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return scale / self.dimension() * torch.randn(self.dimension(), generator=generator, dtype=torch.float64)

    def act(self, element: torch.Tensor) -> None:
        s, w = self._on(element), self._w(lambda slot: _read(slot, None))
        b = _read(self.bias, None)
        for m in self.maps:
            weight = _read(m, None)
            _write(m, weight + torch.outer(weight @ s, w), None)
        _write(self.bias, b - (b @ w) / (1.0 + s @ w) * s, None)  # b (I + w s^T)^-1, Sherman-Morrison

    def canonicalize(self) -> list[Degeneracy]:
        """b -> w / |w|^2 (so b . w = 1) where b . w != 0: one point of each orbit."""
        w, b = self._w(lambda slot: _read(slot, None)), _read(self.bias, None)
        if (b @ w).abs() > 0:
            self.act(b - w / (w @ w))
        return []
