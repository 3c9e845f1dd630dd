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
from .gemma import norm_gain


class ConversionError(ValueError):
    """A model the converter cannot convert (no pivot gauge at some head), or a converted model that failed the
    converter's own checks (logits or parameter count)."""


RELATIVE_RANK_TOL = 1e-7


def _rank_deficient(blocks: torch.Tensor) -> list[tuple[int, int]]:
    """(head, numerical rank) of each (r x d) block in `blocks` (H, r, d) whose rank is below r: the number of
    singular values above RELATIVE_RANK_TOL x the largest.

    The singular values come from an SVD of the tall (d x r) transposes (the same values; LAPACK's tall path is
    many times faster than the wide one here). Before that, a screen: the eigenvalues of the Gram matrices B B^T
    (r x r, one product) are within about r d eps lambda_max of the exact ones, so a block whose smallest
    computed eigenvalue exceeds `screen` x the largest (1e-8 at least, 16 times that error bound) has
    sigma_min / sigma_max > about 1e-4 > RELATIVE_RANK_TOL for certain and needs no SVD. Only the other blocks get one."""
    r, d = blocks.shape[-2:]
    screen = max(1e-8, 16 * r * d * torch.finfo(blocks.dtype).eps)
    eig = torch.linalg.eigvalsh(blocks @ blocks.transpose(-1, -2))  # (H, r), ascending
    clear = (eig[:, -1] > 0) & (eig[:, 0] > screen * eig[:, -1])
    suspect = (~clear).nonzero().flatten().tolist()
    if not suspect:
        return []
    s = torch.linalg.svdvals(blocks[suspect].transpose(-1, -2))  # (h, r), descending
    top = s[:, :1].clamp_min(torch.finfo(s.dtype).tiny)
    ranks = (s > RELATIVE_RANK_TOL * top).sum(-1) * (s[:, 0] > 0)
    return [(h, int(rank)) for h, rank in zip(suspect, ranks.tolist()) if rank < r]


def _nonzero_rows(w: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """Whether each row of W diag(g) has a non-zero entry (bool, W's rows), without forming it: a product of two
    non-zero fp32, bf16 or fp16 numbers is non-zero in float64, so a row of the float64 fold is non-zero exactly where
    W has a non-zero entry in a column of non-zero gain."""
    if gain is not None and not bool((gain != 0).all()):
        w = w[:, gain != 0]
    low, high = torch.aminmax(w, dim=-1)  # one pass, no temporary of W's size
    return (low != 0) | (high != 0)


@torch.no_grad()
def layer_pivot_obstructions(model: nn.Module, index: int, layer) -> list[str]:
    """Messages naming each head/unit of decoder layer `index` (its adapter roles `layer`, weights loaded) where the
    pivot gauge does not exist. The streaming converter calls it on each layer as it is read."""
    adapter = get_adapter(model)
    h_kv, d_h = adapter.num_kv_heads(), adapter.head_dim()
    slots = adapter.attention_slots(layer)
    rope = slots.rotary_dim > 0
    found: list[str] = []
    w = adapter.attention_weights(layer)
    gain = None if layer.attention_norm is None else norm_gain(adapter, layer.attention_norm)  # Gemma: 1 + w

    def folded(x: torch.Tensor) -> torch.Tensor:  # W diag(g) in float64, one block per key/value head
        x = x.double() if gain is None else x.to(torch.float64, copy=True).mul_(gain.double())
        return x.view(h_kv, d_h, -1)

    for h, rank in _rank_deficient(folded(w.v)):
        found.append(f"layer {index}, key/value head {h}: W_V block has rank {rank} < head_dim {d_h}")
    if slots.q_norm is not None or 0 < slots.rotary_dim < d_h:  # QK-norm, partial rotary: QK pair stored as it is
        pass
    elif rope:
        half = d_h // 2
        nonzero = _nonzero_rows(w.k, gain).view(h_kv, d_h)  # rows of each key head with a non-zero entry
        for h, j in (~(nonzero[:, :half] | nonzero[:, half:])).nonzero().tolist():
            found.append(f"layer {index}, key/value head {h}: W_K rotary pair {j} is zero")
    else:
        for h, rank in _rank_deficient(folded(w.k)):
            found.append(f"layer {index}, key/value head {h}: W_K block has rank {rank} < head_dim {d_h}")
    mlp_gain = None if layer.mlp_norm is None else norm_gain(adapter, layer.mlp_norm)
    mlp = adapter.mlp_slots(layer)
    up = mlp.up.get()
    gated = mlp.gated  # a plain MLP has no scale gauge: no pivot divides by its rows
    zero_units = (~_nonzero_rows(up, mlp_gain)).nonzero().flatten().tolist() if gated else []
    if zero_units:
        shown = ", ".join(map(str, zero_units[:8])) + (", ..." if len(zero_units) > 8 else "")
        found.append(f"layer {index}: {len(zero_units)} SwiGLU unit(s) with a zero up-projection row ({shown})")
    return found


def pivot_gauge_obstructions(model: nn.Module) -> list[str]:
    """Messages naming each layer/head/unit where the pivot gauge does not exist (empty when conversion can go on)."""
    found: list[str] = []
    for i, layer in enumerate(get_adapter(model).layers()):
        found += layer_pivot_obstructions(model, i, layer)
    return found


def raise_obstructions(found: list[str]) -> None:
    """`ConversionError` listing `found` (the messages of `layer_pivot_obstructions`), when there are any."""
    if found:
        raise ConversionError(
            "the pivot gauge does not exist for this checkpoint (a pruned or zeroed head?): "
            + "; ".join(found[:10])
            + (f"; and {len(found) - 10} more" if len(found) > 10 else "")
        )


def check_pivot_gauge_exists(model: nn.Module) -> None:
    """Raise `ConversionError` naming every layer and head where the pivot gauge does not exist."""
    raise_obstructions(pivot_gauge_obstructions(model))


def _adapter_of(config, trust_remote_code: bool):
    from ..architectures import UnsupportedModelError
    from ..shards import meta_model

    try:
        return get_adapter(meta_model(config, trust_remote_code=trust_remote_code))
    except (UnsupportedModelError, ValueError, KeyError):  # no adapter, or no causal LM: refused where it is loaded
        return None


def refuse_without_relational_form(config, *, trust_remote_code: bool = False) -> None:
    """`UnsupportedModelError` in one line, from the config alone (a meta-device model: nothing read or allocated),
    when the family's adapter names features the relational architecture cannot hold: commands that convert or
    compress refuse such a model before any work (every family that converts compresses, streamed or in memory:
    `streamed_compression_refusal`). Other families pass (their own checks follow)."""
    from ..architectures import UnsupportedModelError

    adapter = _adapter_of(config, trust_remote_code)
    if adapter is not None and adapter.relational_obstruction is not None:
        raise UnsupportedModelError(
            f"unsupported: {type(adapter.model).__name__} ({adapter.relational_obstruction}: no relational form yet)"
        )


def streamed_compression_refusal(config, *, trust_remote_code: bool = False) -> str | None:
    """Why the layer-streamed compression (`compress.streamed`) does not take this checkpoint yet, in one line, or
    None: every family that compresses streams (GPT-2, GPT-NeoX and their conversions: `convert.layernorm_stream`
    holds their ends; Gemma 3 and its conversion: each layer's own mask and rotary table, the sandwich norms and the
    embedding scale as in memory, `compress.layer_inputs`)."""
    del config, trust_remote_code
    return None
