"""Weight compression of the decoder layers: group-wise quantisation and pruning (magnitude, Wanda), unstructured or
N:M. The one home of these operations: the baselines (`compress.baselines`) and the directional compression
diagnostics (`directional.compression`) use them.

The operations act on the linear maps of every decoder layer (attention and MLP, found through the architecture
adapter; embeddings and the output head stay dense) and return a compressed deep copy. Quantisation is a fake-quant
round trip (the dequantised weights are stored in the model's dtype), which has exactly the numerical effect of
serving those integer weights. Pruning zeroes weights and keeps the dense storage.

Pruning scores: |W_ij| (magnitude) and |W_ij| ||x_j||_2 ("A Simple and Effective Pruning Approach for Large Language
Models", arXiv 2306.11695, Wanda), x_j the j-th input feature over the calibration tokens.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..architectures import get_adapter
from ..lm.metrics import model_device
from ..modeling import GaugeFixedLinear

#: The named settings of `compress_weights`: group-wise quantisation to 8 or 4 bits, or 50% pruning by a score,
#: unstructured or N:M.
COMPRESSION_SETTINGS: tuple[str, ...] = (
    "int8",
    "int4",
    "magnitude",
    "magnitude-2:4",
    "magnitude-4:8",
    "wanda",
    "wanda-2:4",
    "wanda-4:8",
)
PRUNING_SCORES: tuple[str, ...] = ("magnitude", "wanda")
PRUNING_PATTERNS: tuple[str, ...] = ("unstructured", "2:4", "4:8")


# ----------------------------------------------------------------------------------------------------------------
# The weight matrices of the decoder layers
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class WeightMatrix:
    """One stored weight seen as (outputs x inputs): nn.Linear (out, in), Transformers' Conv1D (in, out), and the
    free entries of a GaugeFixedLinear (out, in - m; its fixed pivot entries are gauge constants, not data)."""

    module: nn.Module

    @property
    def rows(self) -> torch.Tensor:
        """The weight as (outputs, inputs), a view of the parameter."""
        w = self.module.weight
        return w.T if isinstance(self.module, Conv1D) else w

    @torch.no_grad()
    def write(self, rows: torch.Tensor) -> None:
        """Store new (outputs, inputs) values in the parameter."""
        self.rows.copy_(rows.to(self.module.weight.dtype))

    def input_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """Per-entry ||x_j|| (outputs, inputs) for the input-feature norms of this map (in,)."""
        if isinstance(self.module, GaugeFixedLinear):
            return norms[self.module.free_index]
        return norms.expand_as(self.rows)


def weight_matrices(model: nn.Module) -> list[WeightMatrix]:
    """The linear maps of every decoder layer's attention and MLP, found through the architecture adapter."""
    found = []
    for roles in get_adapter(model).layers():
        for part in (roles.attention, roles.mlp):
            for module in part.modules():
                if isinstance(module, (nn.Linear, Conv1D, GaugeFixedLinear)):
                    found.append(WeightMatrix(module))
    return found


# ----------------------------------------------------------------------------------------------------------------
# Quantisation and pruning
# ----------------------------------------------------------------------------------------------------------------


def fake_quantize(rows: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """Symmetric group-wise round trip of a weight (outputs, inputs): per row and group g of `group_size` consecutive
    inputs, scale_g = max|w_g| / (2^(b-1) - 1), w~ = clamp(round(w / scale_g), -2^(b-1), 2^(b-1) - 1) * scale_g."""
    if bits < 2 or group_size < 1:
        raise ValueError(f"need bits >= 2 and group_size >= 1, got bits={bits}, group_size={group_size}")
    out_features, in_features = rows.shape
    qmax = 2 ** (bits - 1) - 1
    w = F.pad(rows.float(), (0, (-in_features) % group_size)).view(out_features, -1, group_size)  # (out, G, g)
    scale = w.abs().amax(-1, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / scale), -qmax - 1, qmax)
    return (q * scale).view(out_features, -1)[:, :in_features].to(rows.dtype)


def pruning_mask(
    score: torch.Tensor, pattern: str = "unstructured", sparsity: float = 0.5, per_row: bool = False
) -> torch.Tensor:
    """Keep-mask (bool, like score (outputs, inputs)) removing the lowest scores.

    "unstructured": the round(sparsity * n) lowest of the whole matrix (per_row: of each row, n its length);
    "N:M": in each row, of every M consecutive inputs the M - N lowest (a ragged tail group keeps its highest).
    """
    keep = torch.ones(score.shape, dtype=torch.bool, device=score.device)
    if pattern == "unstructured":
        if not 0.0 <= sparsity <= 1.0:
            raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
        flat = score if per_row else score.reshape(1, -1)
        k = round(sparsity * flat.shape[1])
        if k:
            drop = flat.topk(k, dim=1, largest=False).indices
            keep.view(flat.shape).scatter_(1, drop, False)
        return keep
    if pattern not in PRUNING_PATTERNS:
        raise ValueError(f"unknown pruning pattern {pattern!r}; allowed patterns: {', '.join(PRUNING_PATTERNS)}")
    n, m = (int(p) for p in pattern.split(":"))
    out_features, in_features = score.shape
    padded = F.pad(score.float(), (0, (-in_features) % m), value=math.inf).view(out_features, -1, m)  # (out, G, M)
    drop = padded.topk(m - n, dim=-1, largest=False).indices
    mask = torch.ones_like(padded, dtype=torch.bool).scatter_(-1, drop, False)
    return mask.view(out_features, -1)[:, :in_features]


@torch.no_grad()
def input_feature_norms(model: nn.Module, calibration_ids: torch.Tensor, batch_size: int = 8) -> list[torch.Tensor]:
    """||x_j||_2 over all calibration tokens for each input feature j of each map in `weight_matrices(model)`."""
    matrices = weight_matrices(model)
    sums = [None] * len(matrices)

    def hook_for(i: int):
        def hook(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # (tokens, in)
            sums[i] = x.square().sum(0) if sums[i] is None else sums[i] + x.square().sum(0)

        return hook

    device = model_device(model)
    was_training = model.training
    model.eval()
    with ExitStack() as stack:
        for i, matrix in enumerate(matrices):
            stack.callback(matrix.module.register_forward_pre_hook(hook_for(i)).remove)
        try:
            for start in range(0, calibration_ids.shape[0], batch_size):
                model(input_ids=calibration_ids[start : start + batch_size].to(device), use_cache=False)
        finally:
            model.train(was_training)
    return [s.sqrt() for s in sums]


def quantize_weights(model: nn.Module, bits: int = 8, group_size: int = 128) -> nn.Module:
    """A deep copy of `model` whose decoder-layer weights went through `fake_quantize(w, bits, group_size)`."""
    compressed = copy.deepcopy(model)
    for matrix in weight_matrices(compressed):
        matrix.write(fake_quantize(matrix.rows.detach(), bits, group_size))
    return compressed


def prune_weights(
    model: nn.Module,
    score: str = "magnitude",
    pattern: str = "unstructured",
    sparsity: float = 0.5,
    calibration_ids: torch.Tensor | None = None,
) -> nn.Module:
    """A deep copy of `model` with decoder-layer weights pruned by `pruning_mask`.

    score "magnitude": |W_ij|, unstructured over each whole matrix; "wanda": |W_ij| * ||x_j||_2 (input-feature norms on
    `calibration_ids`, required), unstructured per output row as in Wanda. N:M patterns act per row for both.
    """
    if score not in PRUNING_SCORES:
        raise ValueError(f"unknown pruning score {score!r}; allowed scores: {', '.join(PRUNING_SCORES)}")
    if pattern not in PRUNING_PATTERNS:
        raise ValueError(f"unknown pruning pattern {pattern!r}; allowed patterns: {', '.join(PRUNING_PATTERNS)}")
    compressed = copy.deepcopy(model)
    matrices = weight_matrices(compressed)
    norms: list[torch.Tensor | None] = [None] * len(matrices)
    if score == "wanda":
        if calibration_ids is None:
            raise ValueError("score 'wanda' needs calibration_ids (activation norms)")
        norms = input_feature_norms(compressed, calibration_ids)
    for matrix, norm in zip(matrices, norms):
        w = matrix.rows.detach()
        s = w.abs().float() if norm is None else w.abs().float() * matrix.input_norms(norm)
        matrix.write(w * pruning_mask(s, pattern, sparsity, per_row=score == "wanda"))
    return compressed


def compress_weights(
    model: nn.Module, setting: str, calibration_ids: torch.Tensor | None = None, group_size: int = 128
) -> nn.Module:
    """A compressed deep copy for a setting of `COMPRESSION_SETTINGS`: "int8"/"int4" group-wise quantisation, or
    "<score>[-N:M]" pruning ("magnitude", "wanda"; no pattern: 50% unstructured)."""
    (setting,) = settings_from([setting])
    if setting in ("int8", "int4"):
        return quantize_weights(model, bits=int(setting[3:]), group_size=group_size)
    score, _, pattern = setting.partition("-")
    return prune_weights(model, score, pattern or "unstructured", 0.5, calibration_ids)


def settings_from(names: Iterable[str]) -> list[str]:
    """Validate compression setting names (ValueError naming the allowed ones)."""
    names = list(names)
    for name in names:
        if name not in COMPRESSION_SETTINGS:
            raise ValueError(
                f"unknown compression setting {name!r}; allowed settings: {', '.join(COMPRESSION_SETTINGS)}"
            )
    return names


__all__ = [
    "COMPRESSION_SETTINGS",
    "PRUNING_PATTERNS",
    "PRUNING_SCORES",
    "WeightMatrix",
    "compress_weights",
    "fake_quantize",
    "input_feature_norms",
    "prune_weights",
    "pruning_mask",
    "quantize_weights",
    "settings_from",
    "weight_matrices",
]
