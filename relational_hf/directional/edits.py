"""Component edits (DESIGN.md section 3): rescale the parallel and perpendicular parts of the updates at a site,
or remove the attention diagonal as a control. Reversible by construction: hooks only, no parameter is touched."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..modeling.modeling_directional import scale_parallel
from .sites import EDIT_SITES, AttentionState, attention_hooks, check_sites, select_layers, tap_sites


def check_scale(name: str, value: object) -> float:
    """`value` as a float; ValueError unless it is a finite real number (int or float, not bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite real number (int or float), got {value!r}")
    return float(value)


def remove_diagonal(state: AttentionState) -> AttentionState:
    """The diagonal-removal control: A_tt = 0, each row renormalised to sum 1 (a row with no other key, e.g. the
    first token of a sequence, then outputs 0), o_t = sum_{s != t} A_ts v_s / sum_{s != t} A_ts."""
    t, s = state.weights.shape[-2:]
    rows = torch.arange(t, device=state.weights.device)
    own = torch.zeros(t, s, dtype=torch.bool, device=state.weights.device)
    own[rows, s - t + rows] = True  # query t sits at key position S - T + t
    weights = state.weights.masked_fill(own, 0.0)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    return AttentionState(weights, state.values, torch.matmul(weights, state.values))


@contextmanager
def scale_components(
    model: nn.Module,
    site: str,
    parallel: float = 1.0,
    perpendicular: float = 1.0,
    layers: Iterable[int] | None = None,
) -> Iterator[nn.Module]:
    """Inside the context, `model` computes with the edit y~ = s_par y_par + s_perp y_perp at `site` in `layers`
    (None: all), y_par = (y.z / |z|^2) z relative to the site's reference z:
    - "residual_attention", "residual_mlp", "block": the update written to the residual (z = the residual read);
    - "value": the per-head attention output before W_O, o_t -> s_par o_par + s_perp o_perp with z = v_t;
    - "value_exclude_self": o_t = d_t + c_t with d_t = A_tt v_t kept as is, c_t -> s_par c_par + s_perp c_perp
      (no masking, no row renormalisation);
    - "diagonal": the control A_tt = 0 with rows renormalised (takes no scales).
    (1, 1) is an exact no-op. On exit, also after an exception, every hook is removed and the attention
    implementation restored: parameters are never modified, so the model is bit-identical afterwards.
    Yields the model.
    """
    (site,) = check_sites(site, EDIT_SITES)
    s_par, s_perp = check_scale("parallel", parallel), check_scale("perpendicular", perpendicular)
    if site == "diagonal":
        if (s_par, s_perp) != (1.0, 1.0):
            raise ValueError(
                "site 'diagonal' is the A_tt = 0 control and takes no scales (parallel = perpendicular = 1)"
            )
        with attention_hooks(model, [(roles.attention, remove_diagonal) for roles in select_layers(model, layers)]):
            yield model
        return
    identity = s_par == 1.0 and s_perp == 1.0

    def edit(site: str, layer: int, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor | None:
        return None if identity else scale_parallel(y, z, s_par, s_perp)

    with tap_sites(model, site, edit, layers):
        yield model
