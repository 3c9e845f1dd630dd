"""Soft parallel suppression (DESIGN.md section 3): the auxiliary loss lambda * mean cos^2(y, z) over chosen sites.

For an update y and its reference z, cos^2(y, z) = |y_par|^2 / |y|^2 with y_par = alpha z, alpha = y.z / |z|^2
(`modeling_directional.parallel_coefficient`, the one home of the split). The updates are read by the directional
toolkit's hooks (`relational_hf.directional.sites.tap_sites`), so any model an architecture adapter knows is
supported:

- "residual": y = attention output after W_O and y = MLP output, z = the hidden state entering that sublayer
  (sites "residual_attention" and "residual_mlp");
- "value": per head before W_O, y = o_t = sum_s A_ts v_s, z = v_t (site "value"; runs the eager attention kernel).

The mean is taken over the units (site, layer; the heads of a value site are averaged first) and over the real
token positions; the gradient flows through both y and z. Use it in a custom loop as::

    suppression = ParallelSuppression(model, "residual")
    with suppression.installed():
        suppression.start(attention_mask)
        outputs = model(input_ids=ids, attention_mask=attention_mask, labels=ids)
        batch = suppression.stop()
    loss = outputs.loss + lam * batch.mean_energy
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..architectures import get_adapter
from ..modeling.modeling_directional import parallel_coefficient
from .sites import tap_sites
from .statistics import select_tokens, vector_statistics

#: The directional sites behind each `parallel_suppression_site` value.
SITE_GROUPS: dict[str, tuple[str, ...]] = {
    "residual": ("residual_attention", "residual_mlp"),
    "value": ("value",),
}

_TINY = torch.finfo(torch.float32).tiny


def parallel_energy(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """cos^2(y, z) = |y_par|^2 / |y|^2 = alpha^2 |z|^2 / |y|^2 per vector (fp32, shape y.shape[:-1]; 0 for y = 0)."""
    alpha = parallel_coefficient(y, z).squeeze(-1)
    z_sq = z.float().pow(2).sum(-1)
    y_sq = y.float().pow(2).sum(-1)
    return alpha.square() * z_sq / y_sq.clamp_min(_TINY)


@dataclass
class SuppressionBatch:
    """What one forward pass measured.

    energy_sum: sum over real token positions of the per-position mean of cos^2(y, z) over the units (with
    gradient); positions: number of real token positions; units: number of (site, layer) pairs seen;
    ratio_sum / ratio_count: sum and count of |y_par| / |y_perp| over the non-degenerate vectors (detached;
    zero unless the ratio was asked for)."""

    energy_sum: torch.Tensor
    positions: torch.Tensor
    units: int
    ratio_sum: torch.Tensor
    ratio_count: torch.Tensor

    @property
    def mean_energy(self) -> torch.Tensor:
        """mean cos^2(y, z) over units and positions of this forward pass."""
        return self.energy_sum / self.positions.clamp_min(1)


class ParallelSuppression:
    """Reads cos^2(y, z) at the sites of `site` ("residual" or "value") during forward passes of `model`.

    `installed()` adds the hooks (a context; removed on exit); between `start(attention_mask)` and `stop()` every
    forward pass is measured. Outside start/stop the hooks compute the same quantities but keep nothing, so
    activation-checkpoint recomputation in the backward pass (which runs the forward again and must save the same
    tensors) neither measures twice nor changes the computation.
    """

    def __init__(self, model: nn.Module, site: str = "residual") -> None:
        if site not in SITE_GROUPS:
            raise ValueError(f"parallel suppression site must be one of {tuple(SITE_GROUPS)}, got {site!r}")
        get_adapter(model)  # UnsupportedModelError now rather than at the first step
        self.model, self.site, self.sites = model, site, SITE_GROUPS[site]
        self._active = False
        self._valid: torch.Tensor | None = None
        self._measure_ratio = False
        self._reset()

    def _reset(self) -> None:
        self._energy: torch.Tensor | None = None  # (B, T): sum over units of cos^2
        self._units = 0
        self._ratio_sum: torch.Tensor | float = 0.0
        self._ratio_count: torch.Tensor | float = 0.0

    @contextmanager
    def installed(self) -> Iterator[ParallelSuppression]:
        """Hooks on the model's sites for the duration of the context."""
        with tap_sites(self.model, self.sites, self._on_update):
            yield self

    def start(self, attention_mask: torch.Tensor | None = None, measure_ratio: bool = False) -> None:
        """Measure the next forward passes; attention_mask (B, T) marks real tokens (None: all positions).
        `measure_ratio` also records |y_par| / |y_perp| (directional statistics, float64, detached)."""
        self._reset()
        self._valid = None if attention_mask is None else attention_mask.bool()
        self._measure_ratio = measure_ratio
        self._active = True

    def stop(self) -> SuppressionBatch:
        """Stop measuring and return what was measured since `start`."""
        self._active = False
        energy, valid = self._energy, self._valid
        if energy is None:
            raise RuntimeError(
                f"parallel suppression saw no update at sites {self.sites}: was the model run inside installed()?"
            )
        per_position = energy / self._units  # (B, T)
        if valid is None:
            energy_sum, positions = per_position.sum(), torch.tensor(per_position.numel(), device=energy.device)
        else:
            valid = valid.to(energy.device)
            energy_sum, positions = per_position.masked_fill(~valid, 0.0).sum(), valid.sum()
        ratio_sum, ratio_count = (
            torch.as_tensor(v, dtype=torch.float32, device=energy.device) for v in (self._ratio_sum, self._ratio_count)
        )
        batch = SuppressionBatch(energy_sum, positions, self._units, ratio_sum, ratio_count)
        self._energy, self._valid = None, None
        return batch

    def _on_update(self, site: str, layer: int, y: torch.Tensor, z: torch.Tensor) -> None:
        # computed also when inactive: activation-checkpoint recomputation must save the same tensors as the forward
        energy = parallel_energy(y, z)  # (B, T) at residual sites, (B, H, T) at value sites
        if not self._active:
            return None
        if energy.dim() == 3:
            energy = energy.mean(1)
        self._energy = energy if self._energy is None else self._energy + energy
        self._units += 1
        if self._measure_ratio:
            with torch.no_grad():
                stats = vector_statistics(
                    select_tokens(y.detach(), self._valid), select_tokens(z.detach(), self._valid)
                )
                ratio = stats["parallel_ratio"]
                defined = ~ratio.isnan()
                self._ratio_sum = self._ratio_sum + ratio[defined].sum()
                self._ratio_count = self._ratio_count + defined.sum()
        return None  # measure only: the forward computation is unchanged


__all__ = ["SITE_GROUPS", "ParallelSuppression", "SuppressionBatch", "parallel_energy"]
