"""Perplexity and component sweeps: how much the language model loses when a component of the updates is scaled,
at all layers at once (`sweep_components`, `sweep_all`) or one layer at a time (`sweep_layers`, `sweep_per_layer`).

Every sweep runs on a `CleanPass`: the unedited pass is computed once and shared, s = 1 is the unedited model (not
recomputed), and an edit of layer l reruns only layers l..L-1 from the recorded input h_l."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..lm.metrics import perplexity  # noqa: F401 - the one home of perplexity, re-exported
from .edits import check_scale, scale_components
from .replay import CleanPass
from .sites import SITES, check_sites, select_layers
from .tables import finite_or_none

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
        """The fields and the deltas as a JSON-ready dict (an infinite perplexity becomes null)."""
        return {
            **asdict(self),
            "perplexities": [finite_or_none(p) for p in self.perplexities],
            "deltas": [finite_or_none(d) for d in self.deltas],
        }


@dataclass
class LayerSweepResult:
    """Perplexity with one component of the updates at `site` scaled by s in ONE layer at a time (the other component
    and every other layer unedited): perplexities[i][j] for layers[i] and values[j], on `tokens` predicted tokens of
    the first `rows` rows, whose unedited perplexity is `baseline`."""

    site: str
    component: str
    values: list[float]
    layers: list[int]
    perplexities: list[list[float]]
    baseline: float
    rows: int = 0
    tokens: int = 0

    @property
    def deltas(self) -> list[list[float]]:
        """Delta PPL per layer and value: PPL(layer, s) - PPL of the unedited model."""
        return [[p - self.baseline for p in row] for row in self.perplexities]

    def to_dict(self) -> dict:
        """The fields and the deltas as a JSON-ready dict (an infinite perplexity becomes null)."""
        out = asdict(self)
        out["perplexities"] = [[finite_or_none(p) for p in row] for row in self.perplexities]
        out["deltas"] = [[finite_or_none(d) for d in row] for row in self.deltas]
        return out


#: the site pair whose perpendicular edits coincide (d_t = A_tt v_t is parallel to v_t): computed once
_SAME_PERPENDICULAR = ("value", "value_exclude_self")


def _shared_site(site: str, component: str) -> str:
    """The site whose run stands for (site, component): "value" for both perpendicular value sweeps."""
    return _SAME_PERPENDICULAR[0] if site in _SAME_PERPENDICULAR and component == "perpendicular" else site


def _clean_for(model, input_ids, attention_mask, batch_size, clean: CleanPass | None, progress: bool) -> CleanPass:
    if clean is None:
        return CleanPass(model, input_ids, attention_mask, batch_size, progress=progress)
    clean.matches(model, input_ids, attention_mask, batch_size)
    return clean


def _check_component(component: str) -> None:
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; allowed components: {', '.join(COMPONENTS)}")


def _edited_perplexity(clean: CleanPass, site: str, component: str, s: float, layers, start: int, rows=None):
    if s == 1.0:  # the unedited model
        return clean.baseline_of(rows)
    with scale_components(clean.model, site, layers=layers, **{component: s}):
        return clean.perplexity(start, rows)


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
    clean: CleanPass | None = None,
    progress: bool = False,
) -> SweepResult:
    """PPL under `scale_components(model, site, parallel=s)` (component "parallel") or `perpendicular=s`
    ("perpendicular") for each s in `values`, the edit applied in all `layers` at once (None: every layer), and the
    unedited baseline (that of `clean` unless given). `clean`: a `CleanPass` of this model on these inputs to reuse
    (recorded here otherwise); layers before the first edited one are replayed from it.

    Perpendicular sweeps at "value" and "value_exclude_self" coincide: d_t = A_tt v_t is parallel to v_t, so
    o_perp = c_perp and o_par = d_t + c_par; the two sites differ only in what the parallel scale acts on."""
    (site,) = check_sites(site, SITES)
    _check_component(component)
    values = [check_scale(component, v) for v in values]
    layers = None if layers is None else list(layers)
    start = 0 if layers is None else min(roles.index for roles in select_layers(model, layers))
    clean = _clean_for(model, input_ids, attention_mask, batch_size, clean, progress)
    perplexities = [
        _edited_perplexity(clean, site, component, s, layers, start)
        for s in tqdm(values, desc=f"{site} {component}", disable=not progress, leave=False)
    ]
    return SweepResult(site, component, values, perplexities, clean.baseline if baseline is None else baseline)


def sweep_all(
    model: nn.Module,
    input_ids: torch.Tensor,
    sites: Sequence[str] = SITES,
    components: Sequence[str] = COMPONENTS,
    values: Iterable[float] = DEFAULT_SWEEP_VALUES,
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    progress: bool = True,
    clean: CleanPass | None = None,
) -> list[SweepResult]:
    """`sweep_components` (all layers at once) for every site and component, sharing one `CleanPass` (and its
    baseline); the perpendicular sweep shared by "value" and "value_exclude_self" is computed once."""
    values = [float(v) for v in values]
    sites = check_sites(sites, SITES)
    for component in components:
        _check_component(component)
    clean = _clean_for(model, input_ids, attention_mask, batch_size, clean, progress)
    jobs = [(site, component) for site in sites for component in components]
    runs: dict[tuple[str, str], SweepResult] = {}
    with tqdm(total=len(jobs) * len(values), desc="all-layer sweeps", disable=not progress, leave=False) as bar:
        for site, component in jobs:
            key = (_shared_site(site, component), component)
            if key not in runs:
                runs[key] = sweep_components(
                    model, input_ids, site, component, values, attention_mask, None, batch_size, None, clean
                )
            bar.update(len(values))
    return [
        SweepResult(
            site, component, values, runs[(_shared_site(site, component), component)].perplexities, clean.baseline
        )
        for site, component in jobs
    ]


def sweep_layers(
    model: nn.Module,
    input_ids: torch.Tensor,
    site: str,
    component: str = "parallel",
    values: Iterable[float] = (0.0, 0.5),
    layers: Iterable[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    clean: CleanPass | None = None,
    rows: int | None = None,
    progress: bool = True,
    bar: tqdm | None = None,
) -> LayerSweepResult:
    """Per-layer edits: for each layer l of `layers` (None: all) and each s, PPL with `scale_components(model, site,
    layers=[l], component=s)`, i.e. only layer l edited, on the first `rows` rows (None: all). Layers 0..l-1 are
    replayed from `clean` (recorded here if not given), so each run costs (L - l)/L of a forward pass. `bar`: a tqdm
    bar to advance once per run instead of a bar of its own."""
    (site,) = check_sites(site, SITES)
    _check_component(component)
    values = [check_scale(component, v) for v in values]
    chosen = [roles.index for roles in select_layers(model, layers)]
    clean = _clean_for(model, input_ids, attention_mask, batch_size, clean, progress)
    own = bar is None
    if own:
        bar = tqdm(total=len(chosen) * len(values), desc=f"per-layer {site} {component}", disable=not progress)
    perplexities = []
    try:
        for layer in chosen:
            row = []
            for s in values:
                row.append(_edited_perplexity(clean, site, component, s, [layer], layer, rows))
                bar.update()
            perplexities.append(row)
    finally:
        if own:
            bar.close()
    n = clean.num_rows if rows is None else rows
    return LayerSweepResult(
        site, component, values, chosen, perplexities, clean.baseline_of(rows), n, int(clean.row_count[:n].sum())
    )


def sweep_per_layer(
    model: nn.Module,
    input_ids: torch.Tensor,
    sites: Sequence[str],
    edits: Sequence[tuple[str, Sequence[float]]] = (("parallel", (0.0, 0.5)), ("perpendicular", (0.0,))),
    layers: Iterable[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    clean: CleanPass | None = None,
    rows: int | None = None,
    progress: bool = True,
) -> list[LayerSweepResult]:
    """`sweep_layers` for every site and every (component, values) of `edits`, sharing one `CleanPass`, with one
    progress bar over all runs; the perpendicular edits shared by "value" and "value_exclude_self" run once."""
    sites = check_sites(sites, SITES)
    edits = [(component, [check_scale(component, v) for v in values]) for component, values in edits if values]
    for component, _ in edits:
        _check_component(component)
    layers = None if layers is None else list(layers)
    n_layers = len(select_layers(model, layers))
    clean = _clean_for(model, input_ids, attention_mask, batch_size, clean, progress)
    jobs = [(site, component, values) for site in sites for component, values in edits]
    runs: dict = {}
    total = sum(len(values) for _, _, values in jobs) * n_layers
    results = []
    with tqdm(total=total, desc="per-layer edits", disable=not progress, leave=False) as bar:
        for site, component, values in jobs:
            key = (_shared_site(site, component), component, tuple(values))
            if key not in runs:
                runs[key] = sweep_layers(
                    model,
                    input_ids,
                    site,
                    component,
                    values,
                    layers,
                    attention_mask,
                    batch_size,
                    clean,
                    rows,
                    progress=False,
                    bar=bar,
                )
            else:
                bar.update(len(values) * n_layers)
            result = runs[key]
            results.append(
                LayerSweepResult(
                    site,
                    component,
                    result.values,
                    result.layers,
                    result.perplexities,
                    result.baseline,
                    result.rows,
                    result.tokens,
                )
            )
    return results
