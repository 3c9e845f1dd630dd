"""Perplexity and component sweeps: how much the language model loses when a component of the updates is scaled."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..lm.metrics import perplexity
from .edits import check_scale, scale_components
from .sites import SITES, check_sites

COMPONENTS: tuple[str, ...] = ("parallel", "perpendicular")
DEFAULT_SWEEP_VALUES: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)


@dataclass
class SweepResult:
    """Perplexity with one component of the updates at `site` scaled by each value s (the other kept at 1)."""

    site: str
    component: str
    values: list[float]
    perplexities: list[float]
    baseline: float

    @property
    def deltas(self) -> list[float]:
        """Delta PPL(s) = PPL(s) - PPL of the unedited model."""
        return [p - self.baseline for p in self.perplexities]

    def to_dict(self) -> dict:
        """The fields and the deltas as a JSON-ready dict."""
        return {**asdict(self), "deltas": self.deltas}


def sweep_components(
    model: nn.Module,
    input_ids: torch.Tensor,
    site: str,
    component: str = "parallel",
    values: Iterable[float] = DEFAULT_SWEEP_VALUES,
    attention_mask: torch.Tensor | None = None,
    layers: Iterable[int] | None = None,
    batch_size: int = 8,
    baseline: float | None = None,
) -> SweepResult:
    """PPL under `scale_components(model, site, parallel=s)` (component "parallel") or `perpendicular=s`
    ("perpendicular") for each s in `values`, and the unedited baseline (computed unless given).

    Perpendicular sweeps at "value" and "value_exclude_self" coincide: d_t = A_tt v_t is parallel to v_t, so
    o_perp = c_perp and o_par = d_t + c_par; the two sites differ only in what the parallel scale acts on."""
    (site,) = check_sites(site, SITES)
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; allowed components: {', '.join(COMPONENTS)}")
    values = [check_scale(component, v) for v in values]
    layers = None if layers is None else list(layers)
    if baseline is None:
        baseline = perplexity(model, input_ids, attention_mask, batch_size)
    perplexities = []
    for s in values:
        with scale_components(model, site, layers=layers, **{component: s}):
            perplexities.append(perplexity(model, input_ids, attention_mask, batch_size))
    return SweepResult(site, component, values, perplexities, baseline)


def sweep_all(
    model: nn.Module,
    input_ids: torch.Tensor,
    sites: Sequence[str] = SITES,
    components: Sequence[str] = COMPONENTS,
    values: Iterable[float] = DEFAULT_SWEEP_VALUES,
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> list[SweepResult]:
    """`sweep_components` for every site and component, sharing one baseline perplexity."""
    values = list(values)
    baseline = perplexity(model, input_ids, attention_mask, batch_size)
    jobs = [(site, component) for site in check_sites(sites, SITES) for component in components]
    return [
        sweep_components(model, input_ids, site, component, values, attention_mask, None, batch_size, baseline)
        for site, component in tqdm(jobs, desc="sweeps", disable=not progress, leave=False)
    ]
