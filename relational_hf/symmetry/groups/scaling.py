"""Scalings: norm gains and gated-MLP scales (tori, diagonal Grams)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...architectures import NormSlots, TensorSlot
from ..algebra import (
    DEFAULT_EPS,
    Degeneracy,
)
from .base import Algebra, ParamDict, _add_product, _DiagonalScaling, _read, _write


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
        self.offset = norm.offset  # the norm scales by gain + offset: that product is what the group scales

    def _g(self) -> torch.Tensor:
        return self._live(self.gain) + self.offset

    def dimension(self) -> int:
        return self.gain.param.shape[0]

    def slots(self) -> list[TensorSlot]:
        return [self.gain] + ([self.bias] if self.bias is not None else []) + self.readers

    def vertical(self, x: Algebra, out: ParamDict) -> None:
        c = x[0]
        _write(self.gain, self._g() * c, out)
        if self.bias is not None:
            _write(self.bias, self._live(self.bias) * c, out)
        for w in self.readers:
            _add_product(w, self._live(w), c, out, -1.0)

    def adjoint(self, delta: ParamDict) -> Algebra:
        y = self._g() * self._get(self.gain, delta)
        if self.bias is not None:
            y = y + self._live(self.bias) * self._get(self.bias, delta)
        for w in self.readers:
            y = y - (self._live(w) * self._get(w, delta)).sum(0)
        return [y]

    def prepare(
        self, eps: float = DEFAULT_EPS, dtype: torch.dtype = torch.float64, params: ParamDict | None = None
    ) -> None:
        super().prepare(eps, dtype, params)
        diag = self._g() ** 2
        if self.bias is not None:
            diag = diag + self._live(self.bias) ** 2
        for w in self.readers:
            diag = diag + (self._live(w) ** 2).sum(0)
        self._set_diagonal(diag, eps)

    def act(self, element: torch.Tensor) -> None:
        c = self._on(element)
        _write(self.gain, (_read(self.gain, None) + self.offset) * c - self.offset, None)
        if self.bias is not None:
            _write(self.bias, _read(self.bias, None) * c, None)
        for w in self.readers:
            _write(w, _read(w, None) / c, None)

    def canonicalize(self) -> list[Degeneracy]:
        g = _read(self.gain, None) + self.offset
        self.act(torch.where(g != 0, 1.0 / g.where(g != 0, 1.0), 1.0))  # fold: g (+ offset) -> 1
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
