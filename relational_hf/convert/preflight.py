"""Checks run by `to_relational` before any weight is moved: does the pivot gauge exist for every head?

The pivot gauge (DESIGN.md, gauge fixing) divides by pivot blocks of the source weights, so it exists only when

- each key/value head's value block W_V^(h) (d_h x d, norm gain folded in) has full rank d_h;
- each key head's block W_K^(h) has full rank d_h (without RoPE), or, with RoPE, each rotary pair
  (k_j, k_{j + d_h/2}) is non-zero (the complex-pair gauge divides by one entry of each pair);
- each SwiGLU hidden unit's up-projection row is non-zero.

A pruned or zeroed head breaks these; the converter then reports the layer and head instead of failing inside
`torch.linalg.inv` or producing NaN logits.
"""

from __future__ import annotations

import torch
from torch import nn

from ..architectures import get_adapter


class ConversionError(ValueError):
    """A model the converter cannot convert (no pivot gauge at some head), or a converted model that failed the
    converter's own checks (logits or parameter count)."""

RELATIVE_RANK_TOL = 1e-7


def _rank_deficient(blocks: torch.Tensor) -> list[tuple[int, int]]:
    """(head, numerical rank) of each (r x d) block in `blocks` (H, r, d) whose rank is below r."""
    s = torch.linalg.svdvals(blocks)  # (H, r), descending
    top = s[:, :1].clamp_min(torch.finfo(s.dtype).tiny)
    ranks = (s > RELATIVE_RANK_TOL * top).sum(-1) * (s[:, 0] > 0)
    return [(h, int(rank)) for h, rank in enumerate(ranks.tolist()) if rank < blocks.shape[1]]


@torch.no_grad()
def pivot_gauge_obstructions(model: nn.Module) -> list[str]:
    """Messages naming each layer/head/unit where the pivot gauge does not exist (empty when conversion can go on)."""
    adapter = get_adapter(model)
    h_kv, d_h = adapter.num_kv_heads(), adapter.head_dim()
    rope = getattr(model.config, "position_encoding", "rope") != "none"
    found: list[str] = []
    for i, layer in enumerate(adapter.layers()):
        w = adapter.attention_weights(layer)
        gain = layer.attention_norm.weight.detach().double() if layer.attention_norm is not None else 1.0
        k = (w.k.double() * gain).view(h_kv, d_h, -1)
        v = (w.v.double() * gain).view(h_kv, d_h, -1)
        for h, rank in _rank_deficient(v):
            found.append(f"layer {i}, key/value head {h}: W_V block has rank {rank} < head_dim {d_h}")
        if rope:
            half = d_h // 2
            pair_norm = (k[:, :half].square().sum(-1) + k[:, half:].square().sum(-1)).sqrt()  # (H_kv, d_h/2)
            for h, j in (pair_norm == 0).nonzero().tolist():
                found.append(f"layer {i}, key/value head {h}: W_K rotary pair {j} is zero")
        else:
            for h, rank in _rank_deficient(k):
                found.append(f"layer {i}, key/value head {h}: W_K block has rank {rank} < head_dim {d_h}")
        up = layer.mlp.up_proj.weight.detach().double()
        if layer.mlp_norm is not None:
            up = up * layer.mlp_norm.weight.detach().double()
        zero_units = (up.abs().amax(-1) == 0).nonzero().flatten().tolist()
        if zero_units:
            shown = ", ".join(map(str, zero_units[:8])) + (", ..." if len(zero_units) > 8 else "")
            found.append(f"layer {i}: {len(zero_units)} SwiGLU unit(s) with a zero up-projection row ({shown})")
    return found


def check_pivot_gauge_exists(model: nn.Module) -> None:
    """Raise `ConversionError` naming every layer and head where the pivot gauge does not exist."""

    found = pivot_gauge_obstructions(model)
    if found:
        raise ConversionError(
            "the pivot gauge does not exist for this checkpoint (a pruned or zeroed head?): "
            + "; ".join(found[:10])
            + (f"; and {len(found) - 10} more" if len(found) > 10 else "")
        )
