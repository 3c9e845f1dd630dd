"""Redundancy report: how many stored parameters are pure gauge, by group and by layer, plus invariant descriptors.

Counting: every group of `symmetry_groups` contributes its dimension; for generic weights the combined action has
discrete stabilisers, so the redundant dimension is the sum and the quotient (the functions the architecture can
express, locally) has dimension total_parameters - redundant_dimensions. The tests check the sum against the
numerical rank of the combined infinitesimal action on tiny models.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..architectures import get_adapter
from ..outputs.paths import save_figure
from .groups import symmetry_groups
from .invariants import HeadDescriptors, head_descriptors, layer_descriptors


@dataclass
class GroupEntry:
    """One group instance: key (unique), name (kind), layer (None: model-wide), dimension, what it does."""

    key: str
    name: str
    layer: int | None
    dimension: int
    description: str


@dataclass
class RedundancyReport:
    """Redundancy of a model's stored parameters under its continuous symmetries (DESIGN.md 2.1)."""

    model_class: str
    total_parameters: int
    groups: list[GroupEntry]
    notes: list[str] = field(default_factory=list)
    rank_tolerance: float = 1e-3
    descriptors: list[HeadDescriptors] | None = None
    #: groups whose dimension depends on weight values the report could not see (config alone): each counted at
    #: its largest possible dimension here and NOT in `redundant_dimensions`
    value_dependent: list[GroupEntry] = field(default_factory=list)

    @property
    def value_dependent_dimensions(self) -> int:
        """At most this many further redundant dimensions, depending on weight values not read."""
        return sum(g.dimension for g in self.value_dependent)

    @property
    def redundant_dimensions(self) -> int:
        """Sum of the orbit dimensions of all groups."""
        return sum(g.dimension for g in self.groups)

    @property
    def quotient_dimension(self) -> int:
        """total_parameters - redundant_dimensions: the local dimension of the space of functions."""
        return self.total_parameters - self.redundant_dimensions

    @property
    def redundant_percent(self) -> float:
        return 100.0 * self.redundant_dimensions / max(self.total_parameters, 1)

    @property
    def by_group(self) -> dict[str, int]:
        """Dimension per group kind (e.g. "qk_gauge"), summed over layers."""
        out: dict[str, int] = defaultdict(int)
        for g in self.groups:
            out[g.name] += g.dimension
        return dict(out)

    @property
    def by_group_percent(self) -> dict[str, float]:
        return {k: 100.0 * v / max(self.total_parameters, 1) for k, v in self.by_group.items()}

    @property
    def by_layer(self) -> dict[int, int]:
        """Dimension per decoder layer (groups tied to a layer only)."""
        out: dict[int, int] = defaultdict(int)
        for g in self.groups:
            if g.layer is not None:
                out[g.layer] += g.dimension
        return dict(sorted(out.items()))

    @property
    def by_layer_and_group(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for g in self.groups:
            if g.layer is not None:
                out[g.layer][g.name] += g.dimension
        return {k: dict(v) for k, v in sorted(out.items())}

    @property
    def model_wide(self) -> dict[str, int]:
        """Groups not tied to one layer (residual rotation, final norm gain, embedding translations)."""
        out: dict[str, int] = defaultdict(int)
        for g in self.groups:
            if g.layer is None:
                out[g.name] += g.dimension
        return dict(out)

    def to_dict(self) -> dict:
        """JSON-ready summary (descriptors included when computed)."""
        return {
            "model_class": self.model_class,
            "total_parameters": self.total_parameters,
            "redundant_dimensions": self.redundant_dimensions,
            "quotient_dimension": self.quotient_dimension,
            "redundant_percent": self.redundant_percent,
            "by_group": self.by_group,
            "by_group_percent": self.by_group_percent,
            "by_layer": {str(k): v for k, v in self.by_layer.items()},
            "by_layer_and_group": {str(k): v for k, v in self.by_layer_and_group.items()},
            "model_wide": self.model_wide,
            "groups": [g.__dict__ for g in self.groups],
            "notes": self.notes,
            "rank_tolerance": self.rank_tolerance,
            "value_dependent": [g.__dict__ for g in self.value_dependent],
            "value_dependent_dimensions_at_most": self.value_dependent_dimensions,
            "descriptors": None if self.descriptors is None else [d.to_dict() for d in self.descriptors],
        }

    def to_markdown(self) -> str:
        """A Markdown summary: totals, a table by group, a table by layer, per-layer effective ranks, notes."""
        lines = [
            f"## Redundancy of `{self.model_class}`",
            "",
            f"- stored parameters: {self.total_parameters:,}",
            f"- redundant (gauge) dimensions: {self.redundant_dimensions:,} ({self.redundant_percent:.3f}%)",
            f"- quotient dimension: {self.quotient_dimension:,}",
        ]
        if self.value_dependent:
            lines.append(
                f"- not counted above, depends on weights not read: at most {self.value_dependent_dimensions:,} more ("
                + ", ".join(f"{g.name} {g.dimension:,}" for g in self.value_dependent)
                + ")"
            )
        lines += [
            "",
            "| group | dimension | % of parameters | what acts |",
            "|---|---:|---:|---|",
        ]
        descriptions = {}
        for g in self.groups:
            descriptions.setdefault(g.name, g.description)
        for name, dim in sorted(self.by_group.items(), key=lambda kv: -kv[1]):
            lines.append(
                f"| {name} | {dim:,} | {100.0 * dim / max(self.total_parameters, 1):.3f} | {descriptions[name]} |"
            )
        layers = self.by_layer_and_group
        if layers:
            names = sorted({n for v in layers.values() for n in v})
            lines += ["", "| layer | " + " | ".join(names) + " | total |", "|---" * (len(names) + 2) + "|"]
            for layer, dims in layers.items():
                row = " | ".join(f"{dims.get(n, 0):,}" for n in names)
                lines.append(f"| {layer} | {row} | {sum(dims.values()):,} |")
        if self.model_wide:
            lines += ["", "Model-wide: " + ", ".join(f"{k} {v:,}" for k, v in self.model_wide.items())]
        if self.descriptors:
            lines += [
                "",
                f"Effective ranks (singular values > {self.rank_tolerance:g} x largest), per query head:",
                "",
                "| layer | G_QK | G_VO | mean |cos| QK | mean |cos| VO |",
                "|---|---|---|---:|---:|",
            ]
            for d in self.descriptors:
                lines.append(
                    f"| {d.layer} | {d.qk_rank} | {d.vo_rank} | {_mean_offdiag(d.qk_similarity):.3f} | "
                    f"{_mean_offdiag(d.vo_similarity):.3f} |"
                )
        if self.notes:
            lines += ["", "Notes:"] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _mean_offdiag(m: torch.Tensor) -> float:
    n = m.shape[0]
    if n < 2:
        return 0.0
    mask = ~torch.eye(n, dtype=torch.bool)
    return float(m[mask].abs().mean())


def redundancy_report(model: nn.Module, *, descriptors: bool = True, rank_tol: float = 1e-3) -> RedundancyReport:
    """Count the redundant (gauge) dimensions of `model`'s stored parameters, per group and per layer, with the
    invariant descriptors (effective ranks of G_QK and G_VO at relative tolerance `rank_tol`, head-to-head
    similarities) unless `descriptors=False` or the weights are not materialised (meta device).

    total_parameters counts distinct stored parameters (tied weights once). Raises UnsupportedModelError
    ("unsupported: <class>") for a model no adapter knows."""
    groups, notes = symmetry_groups(model)
    entries = [GroupEntry(g.key, g.name, g.layer, g.dimension(), g.description) for g in groups]
    total = sum(p.numel() for p in model.parameters())
    meta = any(p.device.type == "meta" for p in model.parameters())
    desc = head_descriptors(model, rank_tol) if descriptors and not meta else None
    return RedundancyReport(type(model).__name__, total, entries, notes, rank_tol, desc)


def _final_gain_unknown(model: nn.Module) -> bool:
    """True when the residual rotation's dimension depends on final-gain values that are not materialised: a head
    tied to the embedding behind a final norm gain on the meta device (a varying gain breaks O(d) down to the
    commutant of diag(g); with an untied head the gain folds into the head and O(d) survives whatever its values)."""
    adapter = get_adapter(model)
    norm = adapter.final_norm()
    gain = getattr(norm, "weight", None) if norm is not None else None
    return adapter.head_tied() and gain is not None and gain.device.type == "meta"


def redundancy_report_from_config(config, *, trust_remote_code: bool = False) -> RedundancyReport:
    """Redundancy counts of the causal LM described by a Transformers config alone (weights on the meta device:
    nothing allocated). What depends on weight values is separated: behind a tied head, the residual rotation O(d)
    survives only if the final norm gain is constant (as initialised; a trained gain with distinct values reduces it
    to the commutant of diag(g), down to nothing), so it goes to `value_dependent` (at most d(d-1)/2) with a note,
    and `redundant_dimensions` counts what the config alone determines."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    report = redundancy_report(model, descriptors=False)
    if _final_gain_unknown(model):
        moved = [g for g in report.groups if g.name == "residual_rotation"]
        if moved:
            report.groups = [g for g in report.groups if g.name != "residual_rotation"]
            report.value_dependent += moved
            report.notes = [n for n in report.notes if "final norm gain not materialised" not in n]
            report.notes.append(
                "--meta: the residual rotation O(d) (at most "
                f"{sum(g.dimension for g in moved):,} dimensions) is a symmetry only if the final norm gain in "
                "front of the tied head is constant; a varying gain (visible only with the weights) reduces it to "
                "the rotations among equal gain values, possibly none. It is listed apart, not counted; run "
                "without --meta to count it"
            )
    return report


def redundancy_report_from_checkpoint(
    path: str | os.PathLike,
    *,
    descriptors: bool = True,
    rank_tol: float = 1e-3,
    trust_remote_code: bool = False,
    progress: bool = False,
) -> RedundancyReport:
    """`redundancy_report` of the safetensors checkpoint folder `path` without building the model: the model lives
    on the meta device, the one-dimensional tensors (norm gains, biases: the values the counts depend on) are read,
    and the descriptors are computed one layer at a time from that layer's attention tensors (read from the
    shards, released after use). Same numbers as loading the model and calling `redundancy_report`; memory is one
    layer's attention."""
    from tqdm.auto import tqdm

    from ..shards import (
        check_complete,
        materialize,
        materialize_small,
        open_checkpoint,
        release,
        trim_heap,
    )

    reader, config, model = open_checkpoint(path, trust_remote_code=trust_remote_code, check=False)
    get_adapter(model)  # a family no adapter knows is named before the checkpoint's layout is checked
    check_complete(model, reader)
    materialize_small(model, reader)
    groups, notes = symmetry_groups(model)
    entries = [GroupEntry(g.key, g.name, g.layer, g.dimension(), g.description) for g in groups]
    total = sum(p.numel() for p in model.parameters())
    desc = None
    if descriptors:
        adapter = get_adapter(model)
        names = {id(m): n for n, m in model.named_modules()}
        desc = []
        for layer in tqdm(adapter.layers(), desc="layers", disable=not progress):
            attention = materialize(model, reader, names[id(layer.attention)])
            desc.append(layer_descriptors(adapter, layer, rank_tol))
            release(attention)
            trim_heap()
    return RedundancyReport(type(model).__name__, total, entries, notes, rank_tol, desc)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def plot_redundancy_by_layer(report: RedundancyReport, path: str | Path) -> Path:
    """Write a PNG stacked bar chart: redundant dimensions per layer by group kind (model-wide groups as a last bar)."""
    layers = report.by_layer_and_group
    labels = [str(k) for k in layers] + (["model-wide"] if report.model_wide else [])
    columns = list(layers.values()) + ([report.model_wide] if report.model_wide else [])
    names = sorted({n for c in columns for n in c})
    fig = _figure(max(6.0, 0.5 * len(labels) + 3), 4.5)
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0] * len(labels)
    for name in names:
        values = [c.get(name, 0) for c in columns]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("layer")
    ax.set_ylabel("redundant dimensions")
    ax.set_title(
        f"{report.model_class}: {report.redundant_dimensions:,} of {report.total_parameters:,} "
        f"({report.redundant_percent:.2f}%)"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120, files_only=False)  # the user's path: a file, a link, a stream or -


def plot_head_similarity(report: RedundancyReport, directory: str | Path) -> list[Path]:
    """Write one PNG per layer with the head-to-head similarity heatmaps of G_QK and G_VO."""
    if report.descriptors is None:
        raise ValueError("the report has no descriptors (computed with descriptors=False or on the meta device)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in report.descriptors:
        fig = _figure(9.0, 4.2)
        for i, (title, m) in enumerate((("G_QK", d.qk_similarity), ("G_VO", d.vo_similarity))):
            ax = fig.add_subplot(1, 2, i + 1)
            image = ax.imshow(m.numpy(), vmin=-1.0, vmax=1.0, cmap="RdBu_r")
            ax.set_title(f"layer {d.layer}: {title} head similarity")
            ax.set_xlabel("head")
            ax.set_ylabel("head")
            fig.colorbar(image, ax=ax, fraction=0.046)
        fig.tight_layout()
        path = directory / f"head_similarity_layer{d.layer:03d}.png"
        save_figure(fig, path, dpi=100)
        paths.append(path)
    return paths


__all__ = [
    "GroupEntry",
    "RedundancyReport",
    "plot_head_similarity",
    "plot_redundancy_by_layer",
    "redundancy_report",
    "redundancy_report_from_checkpoint",
    "redundancy_report_from_config",
]
