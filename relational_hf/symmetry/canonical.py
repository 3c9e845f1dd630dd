"""Dressing (DESIGN.md 2.2): move a model to a canonical representative of its orbit, and move it along its orbit.

The canonical form is reached group by group, in an order where every later group preserves what the earlier
ones fixed (and acts equivariantly on it), so the composite is invariant under the whole group:
  translations and bias folds (LayerNorm bias -> 0, key bias -> 0, value bias -> output bias, writers centred),
  norm gains folded into their readers (g -> 1),
  residual rotation: principal gauge (eigenbasis of the embedding Gram E^T E, signs fixed),
  gated-MLP scales balanced (|W_up row k| = |W_down column k|, largest W_up entry positive),
  QK-norm gain exchange balanced, QK and VO gauges: balanced SVD (full GL) or, under RoPE, the commutant part
  (balanced complex pair norms, phase fixed); CO(d_h) under value-space parallel removal: balanced scale and the
  principal axes of W_V^T W_V.
Degenerate spectra (equal singular values, equal eigenvalues) are detected, reported and broken deterministically.

Relational models in the pivot gauge store gauge-fixed factors; what is left to canonicalise (the residual
rotation, and CO(d_h) when VO stays free) is reached through a free-gauge copy: full weights -> canonical free
form -> back into the pivot gauge (`set_full_weights` chooses pivots deterministically from canonical factors).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..architectures import get_adapter
from ..modeling import RelationalConfig
from .algebra import Degeneracy
from .groups import (
    CentringBiasExchange,
    CentringTranslation,
    KeyBiasShift,
    LayerNormBiasShift,
    MLPScale,
    NormGain,
    ParallelBiasExchange,
    QKGauge,
    QKNormGainExchange,
    ReaderCentringTranslation,
    ResidualRotation,
    SymmetryGroup,
    ValueBiasFold,
    VOGauge,
    symmetry_groups,
)

logger = logging.getLogger(__name__)

_ORDER = (
    LayerNormBiasShift,
    KeyBiasShift,
    ValueBiasFold,
    NormGain,
    ReaderCentringTranslation,  # after the gains are folded (w = 1): reader rows orthogonal to the all-ones vector
    CentringBiasExchange,
    ParallelBiasExchange,
    CentringTranslation,
    ResidualRotation,
    MLPScale,
    QKNormGainExchange,
    QKGauge,
    VOGauge,
)


@dataclass
class CanonicalizationReport:
    """What `canonicalize` did: the groups it fixed and the degeneracies (group key, head, indices, value) it met."""

    groups: list[str] = field(default_factory=list)
    degeneracies: list[tuple[str, Degeneracy]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"canonicalised {len(self.groups)} group(s); {len(self.degeneracies)} degenerate cluster(s)"]
        for key, dg in self.degeneracies[:20]:
            lines.append(f"  {key}: head {dg.head}, indices {dg.indices}, value {dg.value:.4g}")
        return "\n".join(lines)


def _is_pivot_relational(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return isinstance(config, RelationalConfig) and config.gauge == "pivot"


def _free_copy(model: nn.Module) -> nn.Module:
    """A relational model of the same class in the free gauge computing the same function (full factors)."""
    config = copy.deepcopy(model.config)
    config.gauge = "free"
    free = type(model)(config).to(device=model.device, dtype=next(model.parameters()).dtype)
    _copy_relational(model, free)
    return free


@torch.no_grad()
def _copy_relational(src: nn.Module, dst: nn.Module) -> None:
    """Copy every factor of relational `src` into `dst` (same shapes, any gauge): attention and MLP through their
    full weights (moved to dst's gauge), every other parameter by name."""
    handled = set()
    for ls, ld in zip(get_adapter(src).layers(), get_adapter(dst).layers(), strict=True):
        handled.update(_copy_relational_layer(ls, ld))
    src_params = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        if id(p) not in handled:
            p.copy_(src_params[name].to(p.dtype))


@torch.no_grad()
def _copy_relational_layer(ls, ld) -> set[int]:
    """One decoder layer (`LayerRoles`) of a relational model into the same layer of another (any gauge): attention
    and MLP through their full weights, every other parameter of the block by name. Returns the ids of dst's
    parameters it wrote."""
    ld.attention.set_full_weights({k: v.detach() for k, v in ls.attention.full_weights().items()})
    ld.mlp.set_full_weights({k: v.detach() for k, v in ls.mlp.full_weights().items()})
    handled = {id(p) for p in ld.attention.parameters()} | {id(p) for p in ld.mlp.parameters()}
    src_params = dict(ls.block.named_parameters())
    for name, p in ld.block.named_parameters():
        if id(p) not in handled:
            p.copy_(src_params[name].to(p.dtype))
            handled.add(id(p))
    return handled


def _ordered(groups: list[SymmetryGroup]) -> list[SymmetryGroup]:
    rank = {cls: i for i, cls in enumerate(_ORDER)}
    return sorted(groups, key=lambda g: rank.get(type(g), len(_ORDER)))


@torch.no_grad()
def canonicalize_groups(
    groups: list[SymmetryGroup],
    report: CanonicalizationReport,
    principal: Callable[[], tuple[torch.Tensor, list[Degeneracy]]] | None = None,
) -> None:
    """Move the live parameters to the canonical representative of each group in `groups`, in the canonical order
    (module docstring), recording the groups and their degeneracies in `report`. The one step both the in-memory
    `canonicalize` (all groups of a model at once) and the streaming one (the groups of one layer at a time,
    `relational_hf.symmetry.canonical_stream`) run.

    `principal`: for a `ResidualRotation` restricted to part of the model, the function giving the element R of
    the principal gauge (computed once, from the whole token embedding E^T E) that the part is moved by, instead
    of the group's own `canonicalize` (which reads the embedding among its own tensors)."""
    for g in _ordered(groups):
        if principal is not None and isinstance(g, ResidualRotation):
            rotation, degs = principal()
            g.act(rotation)
        else:
            degs = g.canonicalize()
        if g.key not in report.groups:
            report.groups.append(g.key)
            report.degeneracies += [(g.key, dg) for dg in degs]


@torch.no_grad()
def _canonicalize_linear(model: nn.Module, report: CanonicalizationReport) -> None:
    groups, _ = symmetry_groups(model)
    canonicalize_groups(groups, report)


def canonicalize(model: nn.Module, *, return_report: bool = False):
    """A deep copy of `model` moved to the canonical representative of its symmetry orbit (DESIGN 2.2), computing
    the same function. Two models on the same orbit (one moved from the other by any element of the groups of
    `symmetry_groups`) canonicalise to the same parameters up to float rounding.

    Arithmetic runs in float64; the copy keeps the model's dtype. With `return_report=True` returns
    (model, CanonicalizationReport) listing the groups fixed and the degenerate spectra met (each broken
    deterministically). Raises UnsupportedModelError for a model no adapter knows."""
    get_adapter(model)  # fail early with "unsupported: <class>"
    report = CanonicalizationReport()
    out = copy.deepcopy(model)
    dtype = next(out.parameters()).dtype
    if _is_pivot_relational(out):
        free = _free_copy(out).double()
        _canonicalize_linear(free, report)
        _copy_relational(free, out)
    else:
        out.double()
        _canonicalize_linear(out, report)
        out.to(dtype)
    if report.degeneracies:
        logger.info(
            "canonicalize: %d degenerate spectral cluster(s), broken deterministically", len(report.degeneracies)
        )
    return (out, report) if return_report else out


@torch.no_grad()
def apply_random_symmetry(
    model: nn.Module, generator: torch.Generator | None = None, scale: float = 0.3, groups: list[str] | None = None
) -> nn.Module:
    """Move `model` in place by a random element of (all, or the named) symmetry groups: the function is
    unchanged, the stored parameters are not. `scale` sets the size of the Lie-algebra element exponentiated.
    Pivot-gauge relational models move through their free-gauge form and are re-gauged."""
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    target = _free_copy(model).double() if _is_pivot_relational(model) else model
    dtype = next(target.parameters()).dtype
    target.double()
    all_groups, _ = symmetry_groups(target)
    for g in all_groups:
        if groups is None or g.name in groups:
            g.act(g.random_element(generator, scale))
    target.to(dtype)
    if target is not model:
        _copy_relational(target, model)
    return model


__all__ = ["CanonicalizationReport", "apply_random_symmetry", "canonicalize", "canonicalize_groups"]
