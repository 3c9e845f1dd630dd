"""Weight compression of the decoder layers: group-wise quantisation and pruning (magnitude, Wanda), unstructured or
N:M. The one home of these operations: the baselines (`compress.baselines`) and the directional compression
diagnostics (`directional.compression`) use them.

The operations act on the linear maps of every decoder layer (attention and MLP, found through the architecture
adapter; embeddings and the output head stay dense) and return a compressed deep copy (`compress_weights`), or let
the model itself compute with the compressed weights inside a context (`compressed_view`: no copy, and layer by layer
for a model whose layers are offloaded to disk). Quantisation is a fake-quant
round trip (the dequantised weights are stored in the model's dtype), which has exactly the numerical effect of
serving those integer weights. Pruning zeroes weights and keeps the dense storage.

Pruning scores: |W_ij| (magnitude) and |W_ij| ||x_j||_2 ("A Simple and Effective Pruning Approach for Large Language
Models", arXiv 2306.11695, Wanda), x_j the j-th input feature over the calibration tokens.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
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
        return self.rows_of(self.module.weight)

    def rows_of(self, weight: torch.Tensor) -> torch.Tensor:
        """A tensor laid out as this module's weight, seen as (outputs, inputs)."""
        return weight.T if isinstance(self.module, Conv1D) else weight

    @torch.no_grad()
    def write(self, rows: torch.Tensor) -> None:
        """Store new (outputs, inputs) values in the parameter."""
        self.rows.copy_(rows.to(self.module.weight.dtype))

    def stored(self, rows: torch.Tensor) -> torch.Tensor:
        """(outputs, inputs) values laid out and typed as the parameter stores them."""
        rows = rows.to(self.module.weight.dtype)
        return rows.T.contiguous() if isinstance(self.module, Conv1D) else rows

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


def _pruned_rows(
    matrix: WeightMatrix, score: str, pattern: str, sparsity: float, norm: torch.Tensor | None, w: torch.Tensor
) -> torch.Tensor:
    """The (outputs, inputs) values w of `matrix` pruned by `pruning_mask` of the score (|W| or the Wanda score
    |W| ||x||, `norm` the input-feature norms)."""
    s = w.abs().float() if norm is None else w.abs().float() * matrix.input_norms(norm)
    return w * pruning_mask(s, pattern, sparsity, per_row=score == "wanda")


def _check_pruning(score: str, pattern: str, calibration_ids: torch.Tensor | None) -> None:
    if score not in PRUNING_SCORES:
        raise ValueError(f"unknown pruning score {score!r}; allowed scores: {', '.join(PRUNING_SCORES)}")
    if pattern not in PRUNING_PATTERNS:
        raise ValueError(f"unknown pruning pattern {pattern!r}; allowed patterns: {', '.join(PRUNING_PATTERNS)}")
    if score == "wanda" and calibration_ids is None:
        raise ValueError("score 'wanda' needs calibration_ids (activation norms)")


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
    feature_norms: list[torch.Tensor] | None = None,
) -> nn.Module:
    """A deep copy of `model` with decoder-layer weights pruned by `pruning_mask`.

    score "magnitude": |W_ij|, unstructured over each whole matrix; "wanda": |W_ij| * ||x_j||_2 (input-feature norms on
    `calibration_ids`, or the `feature_norms` of `input_feature_norms` measured before), unstructured per output row
    as in Wanda. N:M patterns act per row for both.
    """
    _check_pruning(score, pattern, calibration_ids if feature_norms is None else feature_norms)
    compressed = copy.deepcopy(model)
    matrices = weight_matrices(compressed)
    norms: list[torch.Tensor | None] = [None] * len(matrices)
    if score == "wanda" and feature_norms is not None:
        if len(feature_norms) != len(matrices):
            raise ValueError(f"feature_norms has {len(feature_norms)} entries for {len(matrices)} weight matrices")
        norms = list(feature_norms)
    elif score == "wanda":
        norms = input_feature_norms(compressed, calibration_ids)
    for matrix, norm in zip(matrices, norms):
        matrix.write(_pruned_rows(matrix, score, pattern, sparsity, norm, matrix.rows.detach()))
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


def _setting_rows(
    matrix: WeightMatrix, setting: str, group_size: int, norm: torch.Tensor | None, weight: torch.Tensor
) -> torch.Tensor:
    """The values `compress_weights` stores for `matrix` under a (checked) setting, computed from `weight` (laid out
    as the parameter) and laid out and typed as the parameter."""
    w = matrix.rows_of(weight).detach()
    if setting in ("int8", "int4"):
        rows = fake_quantize(w, int(setting[3:]), group_size)
    else:
        score, _, pattern = setting.partition("-")
        rows = _pruned_rows(matrix, score, pattern or "unstructured", 0.5, norm, w)
    rows = rows.to(weight.dtype)
    return rows.T.contiguous() if isinstance(matrix.module, Conv1D) else rows


class _CompressedWeights(Mapping):
    """An Accelerate hook's `weights_map` whose entries in `compress` come out compressed: `compress[key](value)`
    of the stored value, each time the hook brings the weight in (nothing kept)."""

    def __init__(self, weights: Mapping, compress: dict) -> None:
        self.weights, self.compress = weights, compress

    def __getitem__(self, key):
        value = self.weights[key]
        return self.compress[key](value) if key in self.compress else value

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def __getattr__(self, name):  # what else the hook reads of its map (e.g. `dataset`)
        return getattr(self.__dict__["weights"], name)


def _offload_hooks(model: nn.Module) -> dict[str, object]:
    """{module name: Accelerate hook that brings that module's parameters in for each call, from its weights_map}."""
    found = {}
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        for each in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            if getattr(each, "offload", False) and getattr(each, "weights_map", None) is not None:
                found[name] = each
    return found


def _offloaded_weight(model: nn.Module, name: str, hooks: dict[str, object]) -> tuple[object, str]:
    """(the hook that loads the weight of module `name`, the weight's key in that hook's weights_map)."""
    for prefix, hook in hooks.items():
        if prefix == name:
            return hook, "weight"
        if getattr(hook, "place_submodules", False) and (not prefix or name.startswith(prefix + ".")):
            return hook, f"{name[len(prefix) + 1 :] if prefix else name}.weight"
    raise ValueError(
        f"the weight of {name} is on the meta device and no Accelerate hook brings it in: compressed_view needs "
        "the weights in memory or offloaded by a device map"
    )


#: the models inside a `compressed_view` now
_VIEWED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def in_compressed_view(model: nn.Module) -> bool:
    """Whether `model` computes with compressed weights now (inside `compressed_view`)."""
    return model in _VIEWED


@contextmanager
def compressed_view(
    model: nn.Module, setting: str, calibration_ids: torch.Tensor | None = None, group_size: int = 128
) -> Iterator[nn.Module]:
    """While open, `model` computes (inference only) with the decoder weights `compress_weights(model, setting,
    calibration_ids, group_size)` would store, without a copy of the model. Weights in memory are compressed once and
    swapped in for each call of their module (one compressed copy of the decoder weights is held); weights a device
    map offloads (to disk or CPU, on the meta device between calls) come in compressed: the Accelerate hook that
    brings each one in for a call gets it compressed from the stored values, and nothing is kept, so a model that does
    not fit in memory is compressed layer by layer. Wanda's input-feature norms are measured on `calibration_ids`
    first (the dense model). On exit, also after an error, the model is the dense one again. Views of one model do not
    nest. Yields the model."""
    (setting,) = settings_from([setting])
    score, _, pattern = setting.partition("-")
    if score in PRUNING_SCORES:
        _check_pruning(score, pattern or "unstructured", calibration_ids)
    if model in _VIEWED:
        raise ValueError("the model is already inside a compressed_view: views of one model do not nest")
    matrices = weight_matrices(model)
    norms: list[torch.Tensor | None] = [None] * len(matrices)
    if score == "wanda":
        norms = input_feature_norms(model, calibration_ids)
    names = {module: name for name, module in model.named_modules()}
    hooks = _offload_hooks(model)
    kept: dict[int, torch.Tensor] = {}
    offloaded: dict[object, dict[str, object]] = {}
    for i, matrix in enumerate(matrices):
        if not matrix.module.weight.is_meta:
            with torch.no_grad():
                kept[i] = _setting_rows(matrix, setting, group_size, norms[i], matrix.module.weight)
            continue
        hook, key = _offloaded_weight(model, names[matrix.module], hooks)
        offloaded.setdefault(hook, {})[key] = lambda value, m=matrix, n=norms[i]: _setting_rows(
            m, setting, group_size, n, value
        )
    dense: dict[int, torch.Tensor] = {}

    def swap_in(i: int):
        def hook(module, args):
            dense[i] = module.weight.data
            module.weight.data = kept[i]

        return hook

    def swap_back(i: int):
        def hook(module, args, output):
            module.weight.data = dense.pop(i)

        return hook

    with ExitStack() as stack:
        _VIEWED.add(model)
        stack.callback(_VIEWED.discard, model)
        for i in kept:
            stack.callback(matrices[i].module.register_forward_pre_hook(swap_in(i)).remove)
            stack.callback(matrices[i].module.register_forward_hook(swap_back(i)).remove)
        for hook, compress in offloaded.items():
            stack.callback(setattr, hook, "weights_map", hook.weights_map)
            hook.weights_map = _CompressedWeights(hook.weights_map, compress)
        try:
            yield model
        finally:
            for i, values in dense.items():  # a call that raised between its two hooks
                matrices[i].module.weight.data = values
            dense.clear()


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
    "compressed_view",
    "fake_quantize",
    "in_compressed_view",
    "input_feature_norms",
    "prune_weights",
    "pruning_mask",
    "quantize_weights",
    "settings_from",
    "weight_matrices",
]
