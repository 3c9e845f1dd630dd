"""What is measured on an update: the per-vector quantities of DESIGN.md section 3 and their per-layer summaries.

For an update y and its reference z (row vectors, last dimension), with y_par = alpha z, alpha = y.z / |z|^2 and
y_perp = y - y_par (the split lives in `modeling_directional.parallel_component`):
- parallel ratio |y_par| / |y_perp|, averaged over the vectors that are not degenerate: a vector with
  |y_perp| <= 1e-5 |y| (y along z to float precision, or y = 0; e.g. the first token at the value site, where
  o_0 = v_0) has no meaningful ratio and is counted apart;
- zero updates (y = 0, e.g. c_0 at the exclude-self site, whose context is empty) have no direction and are skipped;
- parallel energy |y_par|^2 / |y|^2 (= cos^2(y, z));
- alpha, so that z + y = (1 + alpha) z + y_perp;
- cos(z, z + y): how far the update turns the reference (at residual sites z = h, so this is cos(h, h + y)).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..modeling.modeling_directional import parallel_coefficient, parallel_component

_TINY = torch.finfo(torch.float64).tiny
#: |y_perp| <= DEGENERATE_TOLERANCE * |y|: the ratio |y_par|/|y_perp| is not defined to float precision
DEGENERATE_TOLERANCE = 1e-5


def select_tokens(y: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The vectors of y at real (non-padding) positions, flattened to (N, e).

    y: (B, T, e) at residual sites or (B, H, T, e) at value sites; valid: (B, T) bool, or None for all positions.
    """
    if valid is None:
        return y.reshape(-1, y.shape[-1])
    batch, tokens = (y.shape[0], y.shape[2]) if y.dim() == 4 else (y.shape[0], y.shape[1])
    if tuple(valid.shape) != (batch, tokens):
        raise ValueError(f"attention_mask has shape {tuple(valid.shape)}, expected ({batch}, {tokens})")
    if y.dim() == 4:
        valid = valid[:, None, :].expand(batch, y.shape[1], tokens)  # (B, H, T)
    return y[valid.to(device=y.device, dtype=torch.bool)]


def vector_statistics(y: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-vector statistics (float64, shape y.shape[:-1]): "parallel_ratio" |y_par|/|y_perp| (nan where degenerate,
    see DEGENERATE_TOLERANCE), "parallel_energy" |y_par|^2/|y|^2 (0 for y = 0), "alpha" y.z/|z|^2 and "cosine"
    cos(z, z + y)."""
    y, z = y.double(), z.double()
    alpha = parallel_coefficient(y, z).squeeze(-1).double()
    y_par = parallel_component(y, z)
    y_perp = y - y_par
    par_norm, perp_norm, y_norm = y_par.norm(dim=-1), y_perp.norm(dim=-1), y.norm(dim=-1)
    return {
        "parallel_ratio": torch.where(
            perp_norm > DEGENERATE_TOLERANCE * y_norm, par_norm / perp_norm.clamp_min(_TINY), torch.nan
        ),
        "parallel_energy": par_norm.square() / y_norm.square().clamp_min(_TINY),
        "alpha": alpha,
        "cosine": F.cosine_similarity(z, z + y, dim=-1, eps=1e-30),
    }


@dataclass
class LayerStatistics:
    """Summary of the updates of one site in one layer; means over the `count` non-zero updates (real tokens, times
    heads at value sites), except parallel_ratio, averaged over the count - degenerate vectors that have a ratio.
    alpha_std is the population standard deviation of alpha."""

    layer: int
    count: int
    degenerate: int
    parallel_ratio: float
    parallel_energy: float
    alpha_mean: float
    alpha_std: float
    cosine: float

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass
class Moments:
    """Running float64 sums of the per-vector statistics, to merge batches of a data set."""

    count: int = 0
    degenerate: int = 0
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, y: torch.Tensor, z: torch.Tensor) -> None:
        """Add the (N, e) updates y with references z (zero updates are skipped)."""
        nonzero = y.ne(0).any(-1)
        stats = vector_statistics(y[nonzero], z[nonzero])
        stats["alpha_sq"] = stats["alpha"].square()
        ratio = stats.pop("parallel_ratio")
        defined = ~ratio.isnan()
        stats["parallel_ratio"] = ratio[defined]
        for name, values in stats.items():
            self.sums[name] = self.sums.get(name, 0.0) + values.sum().item()
        self.count += int(nonzero.sum())
        self.degenerate += int((~defined).sum())

    def summary(self, layer: int) -> LayerStatistics:
        """The means (and the std of alpha) of everything added so far, for layer `layer`."""
        n = max(self.count, 1)
        mean = {name: total / n for name, total in self.sums.items()}
        alpha = mean.get("alpha", 0.0)
        with_ratio = max(self.count - self.degenerate, 1)
        return LayerStatistics(
            layer=layer,
            count=self.count,
            degenerate=self.degenerate,
            parallel_ratio=self.sums.get("parallel_ratio", 0.0) / with_ratio,
            parallel_energy=mean.get("parallel_energy", 0.0),
            alpha_mean=alpha,
            alpha_std=math.sqrt(max(mean.get("alpha_sq", 0.0) - alpha * alpha, 0.0)),
            cosine=mean.get("cosine", 0.0),
        )


@dataclass
class DirectionalReport:
    """Per-layer statistics by site: sites[site][i] summarises layer sites[site][i].layer."""

    sites: dict[str, list[LayerStatistics]]

    def profile(self, statistic: str = "parallel_ratio") -> dict[str, list[float]]:
        """One statistic per layer for each site, e.g. the parallel profile {site: [ratio of layer 0, ...]}."""
        return {site: [getattr(s, statistic) for s in layers] for site, layers in self.sites.items()}

    def to_dict(self) -> dict:
        """{site: [per-layer dict, ...]} (JSON-ready)."""
        return {site: [s.to_dict() for s in layers] for site, layers in self.sites.items()}

    def to_markdown(self) -> str:
        """A table with one row per site and layer."""
        lines = [
            "| site | layer | |y_par|/|y_perp| | parallel energy | alpha mean | alpha std | cos(h, h+y) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for site, layers in self.sites.items():
            for s in layers:
                lines.append(
                    f"| {site} | {s.layer} | {s.parallel_ratio:.4f} | {s.parallel_energy:.4f} | {s.alpha_mean:+.4f} "
                    f"| {s.alpha_std:.4f} | {s.cosine:.4f} |"
                )
        return "\n".join(lines)
