"""What each decoder layer of a relational model reads and writes during its compression (`compress.lowrank`), as
the model's own forward pass computes it.

- Positions and masks per layer (`layer_positions`): the rotary table and the causal mask of a full layer, and for a
  sliding-window layer (`RelationalConfig.layer_types`, Gemma 3) the sliding layers' own rotary table
  (`sliding_rope_parameters`) and Transformers' own sliding-window mask function (`sliding_window_causal_mask_function`,
  the one `create_sliding_window_causal_mask` evaluates), so the calibration passes attend exactly as the model does.
- Sandwich norms (`sandwiched`, `output_norm_weights`): with `sandwich_norms` a sublayer's output u enters the stream
  as N(u) = g * u / rms(u). The truncations fit u (the maps are linear in it); to first order an error e in u enters
  the stream as g * (e - projection on u) / rms(u), so each token's fit and error are weighted by
  mean(g^2) / (mean(u^2) + eps), the energy the norm gives an error at that token (the projection on u, which only
  lowers it, is left out). The stream itself always goes through the norm (the layers' own modules), so a dense
  layer released once its maps are assembled (the layer-streamed path, `released`) keeps its sandwich norms.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import sliding_window_causal_mask_function

from ..modeling import RelationalConfig
from ..modeling.modeling_relational import RelationalRotaryEmbedding
from ..shards import drop_caches, release


def _causal_mask(t: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The additive mask (1, 1, t, t) of causal attention, through a sliding window of `window` positions when given
    (Transformers' mask function: key s is seen from query q when s <= q and s > q - window)."""
    q, s = torch.arange(t)[:, None], torch.arange(t)[None]
    seen = s <= q if window is None else sliding_window_causal_mask_function(window)(0, 0, q, s)
    return torch.zeros(t, t, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[None, None]


def _positions(
    config: RelationalConfig, t: int, dtype: torch.dtype = torch.float32, device=None, layer: int | None = None
):
    """(cos, sin, mask, position ids) of windows of t tokens, from the config alone (no weights needed), for decoder
    layer `layer` (None: a full-attention layer): a sliding-window layer's own rotary table and window mask."""
    pos = torch.arange(t, device=device)[None]
    sliding = layer is not None and config.layer_sliding(layer)
    if config.position_encoding == "rope":
        rope = config.sliding_rope_parameters if sliding else None
        rotary = RelationalRotaryEmbedding(config, rope).to(device)
        cos, sin = rotary(torch.zeros(1, t, 1, dtype=dtype, device=device), pos)
    else:
        cos = sin = None
    return cos, sin, _causal_mask(t, dtype, config.sliding_window if sliding else None).to(device), pos


def layer_positions(config: RelationalConfig, t: int, dtype: torch.dtype = torch.float32, device=None) -> list[tuple]:
    """`_positions` of every decoder layer, in order (one computation per layer type)."""
    full = _positions(config, t, dtype, device)
    sliding = [i for i in range(config.num_hidden_layers) if config.layer_sliding(i)]
    local = _positions(config, t, dtype, device, layer=sliding[0]) if sliding else None
    return [local if config.layer_sliding(i) else full for i in range(config.num_hidden_layers)]


def window_mask(attn: nn.Module, positions: tuple) -> torch.Tensor | None:
    """The mask of `positions` when the relational attention `attn` attends through a sliding window, else None
    (plain causal attention, which the truncations compute without a mask)."""
    return positions[2] if attn.config.layer_sliding(attn.layer_idx) else None


def sandwiched(norm: nn.Module | None, u: torch.Tensor) -> torch.Tensor:
    """What a sublayer's output u writes into the stream: N(u) through its sandwich norm, u itself without one."""
    return u if norm is None else norm(u)


def output_norm_weights(norm: nn.Module | None, u: torch.Tensor) -> torch.Tensor | None:
    """Per-token weights (...,) of errors in the sublayer output u (..., d) behind the sandwich norm `norm` (module
    docstring): mean(g^2) / (mean(u^2) + eps); None without a norm."""
    if norm is None:
        return None
    gain = norm.weight.detach().double().pow(2).mean()
    return gain / (u.detach().double().pow(2).mean(-1) + norm.variance_epsilon)


def released(layer: nn.Module) -> None:
    """`shards.release` of the dense decoder layer `layer` whose full weights are assembled, but for its sandwich
    norms (d gains each): the errors behind them are still weighed, and the stream still carried, through them."""
    kept = [norm for norm in (layer.attention_output_norm, layer.mlp_output_norm) if norm is not None]
    for child in layer.children():
        if all(child is not norm for norm in kept):
            release(child)
    drop_caches(layer)


def combined(*weights: torch.Tensor | None) -> torch.Tensor | None:
    """The product of the given per-token weights (None: all ones), None when every one is None."""
    found = [w for w in weights if w is not None]
    if not found:
        return None
    out = found[0]
    for w in found[1:]:
        out = out * w.to(out.dtype)
    return out


__all__ = ["combined", "layer_positions", "output_norm_weights", "released", "sandwiched", "window_mask"]
