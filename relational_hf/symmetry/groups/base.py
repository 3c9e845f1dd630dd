"""The interface of one continuous symmetry group of the stored weights (DESIGN.md 2.1-2.3), and the parameter-space
helpers every group shares.


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

import torch

from ...architectures import TensorSlot
from ..algebra import (
    DEFAULT_EPS,
    Degeneracy,
)
from ..sharding import full_tensor

ParamDict = dict[int, torch.Tensor]
Algebra = list[torch.Tensor]  # an element of a group's Lie algebra, as a list of tensors (float64)


def _is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def _read(slot: TensorSlot, src: ParamDict | None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The slot's view of the live parameter (src None, always a copy: later writes must not alias it; the whole
    tensor of a sharded parameter, `sharding.full_tensor`) or of the vector `src`, in `dtype` (float64 for finite
    actions and canonical forms)."""
    if src is None:
        return slot.get(full_tensor(slot.param)).to(dtype, copy=True)
    return slot.get(src[id(slot.param)]).to(dtype)


def _write(slot: TensorSlot, value: torch.Tensor, out: ParamDict | None) -> None:
    """Set the live parameter's view to `value` (out None) or add `value` into the vector `out` (`value` in Linear
    layout; reshaped to a per-head view)."""
    if out is None:
        target = slot.view(slot.param.data)
        target.copy_(value.to(target.dtype).reshape(target.shape))
    else:
        target = slot.view(out[id(slot.param)])
        target.add_(value.to(target.dtype).reshape(target.shape))


def _add_product(slot: TensorSlot, a: torch.Tensor, b: torch.Tensor, out: ParamDict, alpha: float = 1.0) -> None:
    """Add alpha * a * b (broadcasting) into the vector `out` at the slot's view, without a temporary where the
    dtypes agree."""
    target = slot.view(out[id(slot.param)])
    if slot.per_head:
        target.add_((alpha * a * b).to(target.dtype).reshape(target.shape))
    elif a.dtype == target.dtype and b.dtype == target.dtype:
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
        """Moment map xi^T(theta): e.g. W_Q^T W_Q - W_K^T W_K for a QK gauge, projected onto the algebra. A sharded
        parameter is read whole, once (`sharding.full_tensor`)."""
        values = {id(s.param): full_tensor(s.param) for s in self.slots()}
        saved = self._cache, self._source
        self._cache, self._source = {}, values  # the factors of theta are read from `values`, like a delta
        try:
            return self.adjoint(values)
        finally:
            self._cache, self._source = saved

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


class _DiagonalScaling(SymmetryGroup):
    """A group of independent positive scalings (a torus): its Gram is diagonal, so the preconditioner is its exact
    inverse, and random elements are exp of Gaussian log-scales."""

    def _set_diagonal(self, diag: torch.Tensor, eps: float) -> None:
        self._diag = diag + eps * diag.mean() + torch.finfo(diag.dtype).tiny

    def precondition(self, y: Algebra) -> Algebra:
        return [y[0] / self._diag]

    def random_element(self, generator: torch.Generator, scale: float = 0.3) -> torch.Tensor:
        return torch.exp(scale * torch.randn(self.dimension(), generator=generator, dtype=torch.float64))
