"""Blocks of the relational transformer for converted LayerNorm families (GPT-2, GPT-NeoX), imported by
`modeling_relational.py` and travelling to the Hub with it (``trust_remote_code``): the plain (non-gated) MLP with
biases, and the input embedding with absolute positions and centring (and Gemma's embedding scale). Imports only
torch, transformers and the configuration file.

Why these hold a LayerNorm model exactly (SliceGPT's observation): LayerNorm(x) = g * C x / rms(C x) + beta with
C = I - 11^T / d. When every write into the residual stream is mean-free (C x = x), LayerNorm is the gain-free RMS norm
followed by the gain and the bias, which fold into the maps that read it (W diag(g), b + W beta). The converter makes
the writes mean-free by centring the output maps and their biases (C W_O, C b_O, ...) and the embedded input: the
stored embedding when the head is untied, or this module's parameter-free centring (`embedding_centring`) when the
head is tied to it (the embedding also makes the logits, so it cannot be centred itself)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from .configuration_relational import RelationalConfig


class RelationalPlainMLP(nn.Module):
    """act(x W_up + b_up) W_down + b_down (`mlp_gated=False`; biases with `mlp_bias`). No continuous gauge: the
    activation is not homogeneous, so both maps are stored as they are in either gauge."""

    def __init__(self, config: RelationalConfig, layer_idx: int | None = None) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        f = config.intermediate_size if layer_idx is None else config.layer_intermediate_size(layer_idx)
        self.up_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    @torch.no_grad()
    def set_full_weights(self, weights: dict[str, torch.Tensor], *, fix_gauge: bool = False) -> None:
        """Load up/down weights (Linear layout) and, with `mlp_bias`, up_bias/down_bias; `fix_gauge` has nothing to
        fix (no gauge)."""
        for name, key in (("up_proj", "up"), ("down_proj", "down")):
            module = getattr(self, name)
            module.weight.copy_(weights[key])
            if module.bias is not None:
                if weights.get(f"{key}_bias") is None:
                    raise ValueError(f"set_full_weights: an MLP with biases (mlp_bias=True) needs {key + '_bias'!r}")
                module.bias.copy_(weights[f"{key}_bias"])

    def gauge_pairs(self) -> tuple:
        """No factor pair with a gauge."""
        return ()

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The up/down weights (Linear layout) and their biases."""
        out = {"up": self.up_proj.weight, "down": self.down_proj.weight}
        if self.up_proj.bias is not None:
            out["up_bias"], out["down_bias"] = self.up_proj.bias, self.down_proj.bias
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


def position_table(config: RelationalConfig) -> nn.Embedding | None:
    """The absolute position embeddings (max_position_embeddings x d) of `position_encoding="learned"`, else None."""
    if config.position_encoding != "learned":
        return None
    return nn.Embedding(config.max_position_embeddings, config.hidden_size)


def embed_input(
    config: RelationalConfig, inputs_embeds: torch.Tensor, positions: nn.Embedding | None, position_ids: torch.Tensor
) -> torch.Tensor:
    """The stream's first state: token embeddings times `embedding_scale` (in their dtype, as Gemma scales them),
    plus the position table's rows (learned positions), centred over the d coordinates when `embedding_centring`."""
    if config.embedding_scale is not None:
        scale = torch.tensor(config.embedding_scale, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        inputs_embeds = inputs_embeds * scale
    if positions is not None:
        if not torch.compiler.is_compiling() and int(position_ids.max()) >= positions.num_embeddings:
            raise ValueError(
                f"position {int(position_ids.max())} is outside the learned position table "
                f"(max_position_embeddings={positions.num_embeddings})"
            )
        inputs_embeds = inputs_embeds + positions(position_ids).to(inputs_embeds.dtype)
    if config.embedding_centring:
        inputs_embeds = inputs_embeds - inputs_embeds.mean(-1, keepdim=True)
    return inputs_embeds


__all__ = ["RelationalPlainMLP", "embed_input", "position_table"]
