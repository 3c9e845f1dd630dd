"""Optimisation on the quotient (DESIGN.md 2.3): vertical/horizontal split of updates and balance (the optimiser
wrapper that applies the split at every step is `projected_optimizer.ProjectedOptimizer`).

The vertical space at theta is V = { xi(X) : X in the Lie algebra of every included group } (xi summed over groups).
The vertical part of an update delta is xi(X*) with X* the least-squares solution of xi^T xi X = xi^T delta; the
horizontal part is delta - xi(X*), orthogonal to V. xi^T xi couples groups that share tensors (a QK gauge and the
norm gain in front of it both move W_Q), so X* is found by preconditioned conjugate gradients whose preconditioner
is block diagonal: each group's own exact Gram inverse, i.e. the per-head Sylvester solves
(W_Q^T W_Q) X + X (W_K^T W_K) = Y through eigendecompositions of the small SPD Grams (+ eps I), restricted to the
surviving subalgebra (RoPE commutant, CO(d_h), GQA-shared), the diagonal solves of gains and MLP scales, and so on.
When the groups touch disjoint tensors one iteration is exact. The default solver uses this: it eliminates a largest
set of groups on pairwise disjoint tensors exactly (a direct answer when that is every group, as for a free-gauge
relational model) and runs the conjugate gradients only on the Schur complement of the others (e.g. Llama's norm
gains), which needs about half the iterations of CG on the full system and touches only the coupled tensors.

Groups that share no tensor, directly or through other groups, have orthogonal vertical spaces, so the normal
equations split into independent blocks (the connected components of the groups' shared tensors: about one per
decoder layer and kind for Llama, one per group for a free-gauge relational model), solved one block at a time. A
block needs only its own tensors, so with sharded parameters (FSDP2 DTensors) one block at a time is gathered whole
(`sharding.full_tensor`), solved, and each process applies its own shard of the answer: the update is the
one-process update, and the memory is one block's whole tensors, not the model's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .algebra import DEFAULT_EPS
from .groups import Algebra, ParamDict, ResidualRotation, SymmetryGroup, symmetry_groups
from .sharding import full_tensor, is_sharded

logger = logging.getLogger(__name__)


def _dot(a: list[Algebra], b: list[Algebra]) -> float:
    terms = [
        torch.dot(x.reshape(-1), y.reshape(-1))
        for xs, ys in zip(a, b, strict=True)
        for x, y in zip(xs, ys, strict=True)
    ]
    return float(torch.stack(terms).sum()) if terms else 0.0


def _axpy(alpha: float, x: list[Algebra], y: list[Algebra]) -> list[Algebra]:
    return [[yi + alpha * xi for xi, yi in zip(xs, ys, strict=True)] for xs, ys in zip(x, y, strict=True)]


def _sq_norm(vectors: Iterable[torch.Tensor]) -> float:
    """|v|^2 summed over tensors, with one conversion to a Python float."""
    terms = [torch.dot(t.reshape(-1), t.reshape(-1)) for t in vectors]
    return float(torch.stack(terms).sum()) if terms else 0.0


def _pcg(
    apply: Callable[[list[Algebra]], list[Algebra]],
    precondition: Callable[[list[Algebra]], list[Algebra]],
    r: list[Algebra],
    b_norm: float,
    tol: float,
    max_iter: int,
    on_step: Callable[[float, list[Algebra]], None],
) -> tuple[int, float]:
    """Preconditioned conjugate gradients from the residual `r` of the current solution: `apply(p)` is the operator,
    `on_step(alpha, p)` adds alpha p to the caller's solution. Stops when the residual in the preconditioner's norm,
    relative to `b_norm`, is <= tol. Returns (iterations, relative residual)."""
    z = precondition(r)
    p, rz = z, _dot(r, z)
    rel = math.sqrt(max(rz, 0.0)) / b_norm if b_norm > 0 else 0.0
    iterations = 0
    if b_norm <= 0 or rel <= tol:
        return iterations, rel
    for iterations in range(1, max_iter + 1):  # noqa: B007 - the count is reported
        ap = apply(p)
        pap = _dot(p, ap)
        if not pap > 0:
            break
        alpha = rz / pap
        on_step(alpha, p)
        r = _axpy(-alpha, ap, r)
        z = precondition(r)
        rz_new = _dot(r, z)
        rel = math.sqrt(max(rz_new, 0.0)) / b_norm
        if rel <= tol:
            break
        p = _axpy(rz_new / rz, p, z)
        rz = rz_new
    return iterations, rel


def _disjoint_cover(groups: list[SymmetryGroup]) -> list[int]:
    """Indices (ascending) of a maximal set of groups with an exact `precondition` that pairwise touch no common
    parameter, chosen greedily by decreasing dimension. Groups on disjoint tensors have orthogonal vertical images, so xi^T xi is block diagonal
    on them and each group's own Gram inverse (`precondition`) solves their normal equations exactly."""
    taken: set[int] = set()
    chosen = []
    for i in sorted(range(len(groups)), key=lambda i: -groups[i].dimension()):
        if not groups[i].exact_precondition:
            continue
        ids = {id(s.param) for s in groups[i].slots()}
        if taken.isdisjoint(ids):
            chosen.append(i)
            taken |= ids
    return sorted(chosen)


@dataclass
class _Block:
    """Groups connected through shared tensors (a connected component), and the split of the "auto" solver on them:
    `first` a largest set on pairwise disjoint tensors (eliminated exactly), `second` the rest, `coupled` the first
    groups sharing a tensor with the second, `reduced_keys` the tensors the reduced iterations touch."""

    groups: list[SymmetryGroup]
    keys: list[int]
    first: list[SymmetryGroup]
    second: list[SymmetryGroup]
    coupled: list[SymmetryGroup]
    reduced_keys: list[int]
    second_keys: set[int]

    @classmethod
    def of(cls, groups: list[SymmetryGroup], order: list[int]) -> _Block:
        keys = {id(s.param) for g in groups for s in g.slots()}
        chosen = set(_disjoint_cover(groups))
        first = [g for i, g in enumerate(groups) if i in chosen]
        second = [g for i, g in enumerate(groups) if i not in chosen]
        second_keys = {id(s.param) for g in second for s in g.slots()}
        coupled = [g for g in first if any(id(s.param) in second_keys for s in g.slots())]
        reduced = second_keys | {id(s.param) for g in coupled for s in g.slots()}
        return cls(
            groups=groups,
            keys=[k for k in order if k in keys],
            first=first,
            second=second,
            coupled=coupled,
            reduced_keys=[k for k in order if k in reduced],
            second_keys=second_keys,
        )


def _blocks(groups: list[SymmetryGroup], order: list[int]) -> list[_Block]:
    """The groups split into connected components of their shared tensors (union-find on parameter ids), in the order
    of their first group; `order` orders the parameter ids of each block."""
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, g in enumerate(groups):
        for s in g.slots():
            j = owner.setdefault(id(s.param), i)
            parent[root(i)] = root(j)
    members: dict[int, list[SymmetryGroup]] = {}
    for i, g in enumerate(groups):
        members.setdefault(root(i), []).append(g)
    return [_Block.of(block, order) for block in members.values()]


@dataclass
class ProjectionStats:
    """Diagnostics of one projection: norms of the update and of its vertical part, CG iterations, the final
    relative residual of the normal equations (in the preconditioner's norm)."""

    update_norm: float
    vertical_norm: float
    iterations: int
    residual: float

    @property
    def vertical_share(self) -> float:
        """|vertical| / |update| (0 for a zero update)."""
        return self.vertical_norm / self.update_norm if self.update_norm > 0 else 0.0

    @classmethod
    def combine(cls, parts: Iterable[ProjectionStats]) -> ProjectionStats:
        """The statistics of independent blocks taken together: norms combined as a root sum of squares, the most
        iterations and the largest relative residual of any block (an upper bound of the whole system's)."""
        parts = list(parts)
        return cls(
            math.sqrt(sum(p.update_norm**2 for p in parts)),
            math.sqrt(sum(p.vertical_norm**2 for p in parts)),
            max((p.iterations for p in parts), default=0),
            max((p.residual for p in parts), default=0.0),
        )


class UpdateProjector:
    """Splits parameter updates of `model` into vertical (along symmetry orbits) and horizontal parts.

    groups: the groups to project out (default: every group with a linear action on trainable parameters, except
    the residual rotation unless `residual=True`; the residual rotation couples every tensor of the model and its
    Gram needs a d x d eigendecomposition per step). Groups touching a frozen parameter, or one outside
    `allowed_params`, are skipped (a projection must not move what the optimiser does not own).
    tol / max_iter: stopping rule of the conjugate gradients (relative residual in the preconditioner's norm).
    eps: relative regulariser of the Gram solves (rank-deficient heads stay finite).
    dtype: dtype of the parameter-sized arithmetic (default float64 when a projected parameter is float64, else
    float32); the small Gram factorisations always run in float64.
    solver: "auto" (default) splits the groups once into a largest set of groups on pairwise disjoint tensors
    (chosen greedily by dimension; their normal equations are block diagonal, solved exactly by each group's Gram
    inverse) and the rest; with no rest (e.g. a free-gauge relational model) one preconditioned solve is the
    answer, otherwise the first set is eliminated exactly and preconditioned CG runs on the Schur complement of the
    rest, xi_2^T (I - P_1) xi_2 (P_1 the projection onto the first set's vertical space), with the same stopping
    rule; its iterates are those of CG on the full system taken two at a time, and each touches only the tensors of
    the coupled groups. "cg": preconditioned CG on the full normal equations (the reference). Either solver runs
    block by block (`blocks`: groups connected through shared tensors; the normal equations do not couple blocks),
    so CG's stopping rule holds for every block, which bounds the whole system's relative residual by the same tol.
    Sharded (FSDP2 DTensor) parameters are read whole, one block at a time (see `block_vertical`).
    """

    def __init__(
        self,
        model: nn.Module,
        groups: list[SymmetryGroup] | None = None,
        *,
        residual: bool = False,
        tol: float = 1e-8,
        max_iter: int = 50,
        eps: float = DEFAULT_EPS,
        allowed_params: Iterable[torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
        solver: str = "auto",
    ) -> None:
        if solver not in ("auto", "cg"):
            raise ValueError(f"solver must be 'auto' or 'cg', got {solver!r}")
        if groups is None:
            groups, _ = symmetry_groups(model)
            groups = [g for g in groups if residual or not isinstance(g, ResidualRotation)]
        allowed = None if allowed_params is None else {id(p) for p in allowed_params}
        kept, skipped = [], []
        for g in groups:
            ok = g.linear and all(
                s.param.requires_grad and (allowed is None or id(s.param) in allowed) for s in g.slots()
            )
            (kept if ok else skipped).append(g)
        if skipped:
            logger.info(
                "update projection skips %d group(s) on frozen or foreign parameters: %s",
                len(skipped),
                ", ".join(g.key for g in skipped[:5]),
            )
        self.groups = kept
        self.tol, self.max_iter, self.eps = tol, max_iter, eps
        self.params: dict[int, nn.Parameter] = {}
        for g in self.groups:
            for s in g.slots():
                self.params[id(s.param)] = s.param
        self.names = {id(p): n for n, p in model.named_parameters()}
        if dtype is None:
            wide = any(p.dtype == torch.float64 for p in self.params.values())
            dtype = torch.float64 if wide else torch.float32
        self.dtype = dtype
        self.solver = solver
        # independent blocks of the normal equations, each with the split of the "auto" solver
        self.blocks = _blocks(self.groups, list(self.params))
        self.last_stats: ProjectionStats | None = None

    # --- the normal equations, one block at a time ----------------------------------------------------------------
    def _zeros(self, keys: Iterable[int]) -> ParamDict:
        return {k: torch.zeros(self.params[k].shape, dtype=self.dtype, device=self.params[k].device) for k in keys}

    def _xi(self, x: list[Algebra], block: _Block) -> ParamDict:
        out = self._zeros(block.keys)
        for g, xg in zip(block.groups, x, strict=True):
            g.vertical(xg, out)
        return out

    def _precondition(self, y: list[Algebra], groups: list[SymmetryGroup]) -> list[Algebra]:
        return [g.precondition(yg) for g, yg in zip(groups, y, strict=True)]

    def _solve(self, full: ParamDict, block: _Block) -> tuple[ParamDict, int, float]:
        """Preconditioned CG on xi^T xi X = xi^T delta (the "cg" solver); returns (xi(X*), iterations, relative
        residual)."""
        groups = block.groups
        b = [g.adjoint(full) for g in groups]
        x = [[torch.zeros_like(t) for t in bg] for bg in b]
        b_norm = math.sqrt(max(_dot(b, self._precondition(b, groups)), 0.0))

        def step(alpha: float, p: list[Algebra]) -> None:
            x[:] = _axpy(alpha, p, x)

        def apply(p: list[Algebra]) -> list[Algebra]:
            image = self._xi(p, block)
            return [g.adjoint(image) for g in groups]

        iterations, rel = _pcg(apply, lambda y: self._precondition(y, groups), b, b_norm, self.tol, self.max_iter, step)
        return self._xi(x, block), iterations, rel

    def _solve_split(self, full: ParamDict, block: _Block) -> tuple[ParamDict, int, float]:
        """The "auto" solver: returns (xi(X*), iterations, relative residual). With B = the first (pairwise
        disjoint) groups and C = the rest, X_B = A_BB^-1 xi_B^T (delta - xi_C X_C) and X_C solves the Schur complement
        system xi_C^T (I - P_B) xi_C X_C = xi_C^T (I - P_B) delta; then xi(X*) = P_B delta + (I - P_B) xi_C X_C, with
        P_B xi_C X_C = xi_B A_BB^-1 xi_B^T xi_C X_C accumulated in the algebra along the CG directions."""
        first, second, coupled = block.first, block.second, block.coupled
        y_first = [g.adjoint(full) for g in first]
        x_first = self._precondition(y_first, first)
        vertical = self._zeros(block.keys)
        for g, xg in zip(first, x_first, strict=True):
            g.vertical(xg, vertical)  # P_B delta
        if not second:  # block-diagonal normal equations: the preconditioned solve is exact
            return vertical, 1, 0.0
        b_full = [g.adjoint(full) for g in second]
        # the full system's right-hand side in the preconditioner's norm, as in the reference CG
        b_norm = math.sqrt(max(_dot(y_first, x_first) + _dot(b_full, self._precondition(b_full, second)), 0.0))
        # reduced right-hand side xi_C^T (delta - P_B delta); the eliminated residual is zero throughout
        r = _axpy(-1.0, [g.adjoint(vertical) for g in second], b_full)
        # work: xi_C p on the coupled groups' tensors. The eliminated groups read it (zero outside the tensors of C)
        # and write -P_B xi_C p back into it, where only the tensors of C are read again: `sink` sends their writes
        # elsewhere to a scratch copy that nothing reads, so only the tensors of C are re-zeroed.
        work = self._zeros(block.reduced_keys)
        second_keys = [k for k in block.reduced_keys if k in block.second_keys]
        sink = {k: work[k] if k in block.second_keys else torch.empty_like(work[k]) for k in work}
        x_second = [[torch.zeros_like(t) for t in pg] for pg in r]  # X_C
        x_coupled: list[list[Algebra]] = []  # A_BB^-1 xi_B^T xi_C X_C on the coupled groups
        last: list[list[Algebra]] = []  # A_BB^-1 xi_B^T xi_C p of the latest direction

        def apply(p: list[Algebra]) -> list[Algebra]:  # xi_C^T (I - P_B) xi_C p
            for k in second_keys:
                work[k].zero_()
            for g, pg in zip(second, p, strict=True):
                g.vertical(pg, work)  # xi_C p
            last[:] = [self._precondition([g.adjoint(work) for g in coupled], coupled)]
            for g, xg in zip(coupled, last[0], strict=True):
                g.vertical([-t for t in xg], sink)  # (I - P_B) xi_C p, on the tensors of C
            return [g.adjoint(work) for g in second]

        def step(alpha: float, p: list[Algebra]) -> None:
            x_second[:] = _axpy(alpha, p, x_second)
            first_step = [[alpha * t for t in xg] for xg in last[0]] if not x_coupled else None
            x_coupled[:] = [first_step if first_step is not None else _axpy(alpha, last[0], x_coupled[0])]

        iterations, rel = _pcg(apply, lambda y: self._precondition(y, second), r, b_norm, self.tol, self.max_iter, step)
        if x_coupled:  # xi(X*) = P_B delta + xi_C X_C - P_B xi_C X_C
            for g, xg in zip(second, x_second, strict=True):
                g.vertical(xg, vertical)
            for g, xg in zip(coupled, x_coupled[0], strict=True):
                g.vertical([-t for t in xg], vertical)
        return vertical, 1 + iterations, rel

    def _full(self, delta: ParamDict, keys: Iterable[int]) -> ParamDict:
        """`delta` over the parameters `keys` in `self.dtype` (missing entries zero; no copy where it fits)."""
        full = {}
        for k in keys:
            p, t = self.params[k], delta.get(k)
            if t is not None and t.dtype == self.dtype and t.shape == p.shape and t.device == p.device:
                full[k] = t
            else:
                full[k] = torch.zeros(p.shape, dtype=self.dtype, device=p.device)
                if t is not None:
                    full[k].copy_(t)
        return full

    @torch.no_grad()
    def block_vertical(
        self, block: _Block, delta: ParamDict, at: ParamDict | None = None
    ) -> tuple[ParamDict, ProjectionStats]:
        """xi(X*) of one block (an element of `self.blocks`) for the update `delta` (whole tensors, keyed by
        id(param); entries outside the block are ignored), at the values `at` (whole tensors, read only; default the
        live parameters, whole tensors gathered for sharded ones). Returns the block's vertical part, in
        `self.dtype`, and its statistics."""
        full = self._full(delta, block.keys)
        if at is None and any(is_sharded(self.params[k]) for k in block.keys):
            at = {k: full_tensor(self.params[k]) for k in block.keys}  # each tensor gathered once, not per group
        try:
            for g in block.groups:
                g.prepare(self.eps, self.dtype, at)
            if self.solver == "cg":
                vertical, iterations, rel = self._solve(full, block)
            else:
                vertical, iterations, rel = self._solve_split(full, block)
        finally:
            for g in block.groups:
                g.release()
        stats = ProjectionStats(
            math.sqrt(_sq_norm(full.values())), math.sqrt(_sq_norm(vertical.values())), iterations, rel
        )
        return vertical, stats

    @torch.no_grad()
    def vertical_part(self, delta: ParamDict, at: ParamDict | None = None) -> ParamDict:
        """xi(X*) for the update `delta` (dict id(param) -> tensor shaped like the parameter, whole tensors also for
        sharded parameters), in `self.dtype`, solved block by block (`block_vertical`). `at`: the parameter values
        to project at (same keys and shapes, read only; default the live parameters). `last_stats` combines the
        blocks' statistics."""
        vertical: ParamDict = {}
        parts = []
        for block in self.blocks:
            part, stats = self.block_vertical(block, delta, at)
            vertical.update(part)
            parts.append(stats)
        self.last_stats = ProjectionStats.combine(parts)
        return vertical

    # --- public, name-keyed ------------------------------------------------------------------------------------
    def split(self, update: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(vertical, horizontal) parts of an update given as {parameter name: tensor} (names of
        `model.named_parameters()`); entries the groups do not touch are entirely horizontal."""
        by_name = {n: k for k, n in self.names.items()}
        delta = {by_name[n]: t for n, t in update.items() if n in by_name and by_name[n] in self.params}
        vert = self.vertical_part(delta)
        vertical, horizontal = {}, {}
        for n, t in update.items():
            k = by_name.get(n)
            v = vert.get(k) if k is not None else None
            vertical[n] = torch.zeros_like(t) if v is None else v.to(t.dtype)
            horizontal[n] = t - vertical[n]
        return vertical, horizontal

    def balance(self) -> dict[str, torch.Tensor]:
        """The balance (moment map) of every included group, keyed by group key; see `orbit_balance`."""
        return {g.key: torch.cat([t.reshape(-1) for t in g.balance()]) for g in self.groups}


def vertical_horizontal_split(
    model: nn.Module, update: Mapping[str, torch.Tensor], *, residual: bool = False, tol: float = 1e-8
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split an update {parameter name: tensor} of `model` at its current weights theta into the vertical part
    xi(X*) (along the symmetry orbits, X* the least-squares fit of DESIGN 2.3) and the horizontal part
    delta - xi(X*), orthogonal to every vertical direction. Builds an `UpdateProjector`; keep one for repeated use."""
    return UpdateProjector(model, residual=residual, tol=tol).split(update)


@torch.no_grad()
def orbit_balance(model: nn.Module, groups: list[SymmetryGroup] | None = None) -> dict[str, torch.Tensor]:
    """Balance (moment map) per group, mu(theta) = xi^T(theta) projected onto the group's algebra:
    QK gauge: sum over the query heads of a key/value head of W~_Q^T W~_Q - W~_K^T W~_K (biases as extra rows),
    shape (H_kv, r, r); VO: W~_V^T W~_V - sum_h W_O^h W_O^h^T, (H_kv, d_h, d_h); norm gain: g^2 - sum |reader
    column|^2; MLP scale: |W_up row k|^2 - |W_down column k|^2. Exact gradient flow of an invariant loss conserves
    it; a horizontal step changes it only at second order in the step size; the difference to an earlier balance
    is the orbit drift."""
    if groups is None:
        groups, _ = symmetry_groups(model)
    out = {}
    for g in groups:
        if g.linear and not isinstance(g, ResidualRotation):
            parts = g.balance()
            out[g.key] = parts[0] if len(parts) == 1 else torch.cat([t.reshape(-1) for t in parts])
    return out


def orbit_drift(reference: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """|mu_now - mu_ref|_F per group key (from two `orbit_balance` results), plus "total" (root sum of squares)."""
    out = {k: float((current[k] - reference[k]).norm()) for k in reference if k in current}
    out["total"] = math.sqrt(sum(v * v for v in out.values()))
    return out


__all__ = [
    "ProjectionStats",
    "UpdateProjector",
    "orbit_balance",
    "orbit_drift",
    "vertical_horizontal_split",
]
