"""The residual rotation x -> x R (DESIGN.md 2.1) and the readers of the residual stream it acts through."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from ...architectures import TensorSlot
from ..algebra import (
    DEFAULT_EPS,
    ColumnSigns,
    Degeneracy,
    lyapunov_apply,
    lyapunov_factor,
    principal_axes,
    signed_principal_axes,
    skew,
    symmetric_eigh,
)
from .base import Algebra, ParamDict, SymmetryGroup, _read, _write


class ResidualReader:
    """Maps that read the residual stream through one normalisation: y = n(x) diag(g + offset) + b, then y W^T + c.
    Under a rotation R the maps become W D R D^-1 (D = diag(g + offset)); the norm bias b stays and the map biases
    absorb the change, c + (W - W') b, unless some map has no bias: then b itself moves to b D^-1 R D
    (`moves_bias`), which keeps every y W^T."""

    def __init__(
        self,
        gain: TensorSlot | None,
        bias: TensorSlot | None,
        maps: list[tuple[TensorSlot, TensorSlot | None]],
        offset: float = 0.0,
    ) -> None:
        self.gain, self.bias, self.maps, self.offset = gain, bias, maps, offset
        self.moves_bias = bias is not None and any(c is None for _, c in maps)


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
        if rd.gain is None:
            return torch.ones(self.d, dtype=self._dtype, device=self.device)
        return self._live(rd.gain) + rd.offset

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
            if rd.moves_bias:
                _write(rd.bias, ((b / g) @ om) * g, out)
            for w, c in rd.maps:
                dw = ((self._live(w) * g) @ om) / g
                _write(w, dw, out)
                if c is not None and b is not None and not rd.moves_bias:
                    _write(c, -(dw @ b), out)

    def adjoint(self, delta: ParamDict) -> Algebra:
        y = torch.zeros(self.d, self.d, dtype=self._dtype, device=self.device)
        for s in self.rows:
            y = y + _rows(self._live(s)).T @ _rows(self._get(s, delta))
        for s in self.writers:
            y = y - self._get(s, delta) @ self._live(s).T
        for rd in self.readers:
            g, b = self._gain(rd), self._bias(rd)
            if rd.moves_bias:
                y = y + torch.outer(b / g, self._get(rd.bias, delta) * g)
            for w, c in rd.maps:
                wg = self._live(w) * g
                y = y + wg.T @ (self._get(w, delta) / g)
                if c is not None and b is not None and not rd.moves_bias:
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
            if rd.moves_bias:
                _write(rd.bias, ((b / g) @ rot) * g, None)
            for w, c in rd.maps:
                old = _read(w, None)
                new = ((old * g) @ rot) / g
                _write(w, new, None)
                if c is not None and b is not None and not rd.moves_bias:
                    _write(c, _read(c, None) + (old - new) @ b, None)

    def principal_gauge(
        self, embedding: torch.Tensor | Callable[[], Iterable[torch.Tensor]]
    ) -> tuple[torch.Tensor, list[Degeneracy]]:
        """The rotation R of the principal gauge: per cluster the eigenbasis of the embedding Gram E^T E (inside
        the complement of the all-ones direction when centring), signs fixed on the embedding's columns.
        `embedding`: the matrix E, or (E too big to hold) a function returning an iterator over its row blocks in
        order, read twice: E^T E summed block by block, then the signs."""
        whole = isinstance(embedding, torch.Tensor)
        blocks = (lambda: (embedding,)) if whole else embedding
        device = embedding.device if whole else torch.device("cpu")
        index = [torch.tensor(c, device=device) for c in self.clusters]
        every = len(self.clusters) == 1

        def columns(block: torch.Tensor, k: int) -> torch.Tensor:
            e = block.double()
            e = e if every else e[:, index[k]]
            return e @ bases[k] if bases[k] is not None else e

        bases = [
            _centred_basis(len(c)).to(device) if self.centring and len(c) > 1 else None for c in self.clusters
        ]  # (m, m-1), orthonormal basis of 1^perp
        grams = [torch.zeros(0)] * len(self.clusters)
        for block in blocks():
            for k in range(len(self.clusters)):
                e = columns(block, k)
                grams[k] = e.T @ e if grams[k].numel() == 0 else grams[k] + e.T @ e
        axes = [principal_axes(g) if g.numel() else None for g in grams]
        signs = [ColumnSigns() for _ in self.clusters]
        for block in blocks():
            for k, ax in enumerate(axes):
                if ax is not None:
                    signs[k].update(columns(block, k) @ ax[1])
        rot = torch.zeros(self.d, self.d, dtype=torch.float64, device=device)
        degs = []
        for k, cluster in enumerate(self.clusters):
            m = len(cluster)
            if axes[k] is None or (self.centring and m == 1):
                block, cd = torch.ones(1, 1, dtype=torch.float64, device=device), []
            else:
                evals, evecs = axes[k]
                z, cd = signed_principal_axes(evals, evecs, signs[k].signs(evecs.shape[1]).to(device))
                if self.centring:
                    ones = torch.full((m, 1), 1.0 / math.sqrt(m), dtype=torch.float64, device=device)
                    block = ones @ ones.T + bases[k] @ z @ bases[k].T
                else:
                    block = z
            idx = index[k]
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
