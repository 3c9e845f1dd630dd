"""Measure the geometry of the updates a model writes (DESIGN.md section 3): `decompose` for one batch,
`decompose_dataset` streaming a data set, `collect_updates` for the raw (y, z) pairs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from ..lm.metrics import model_device
from .sites import SITES, check_sites, select_layers, tap_sites
from .statistics import DirectionalReport, Moments, select_tokens

Batch = torch.Tensor | Mapping[str, torch.Tensor]


def unpack_batch(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids, attention_mask or None) on `device` from a (B, T) id tensor or a mapping with those keys."""
    if isinstance(batch, Mapping):
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids, mask = batch, None
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    return ids.to(device), None if mask is None else mask.to(device)


class _Recorder:
    """An update function for `tap_sites` that keeps the real-token (y, z) of each site and layer as moments or
    as tensors; never edits."""

    def __init__(self, keep_vectors: bool = False) -> None:
        self.keep_vectors = keep_vectors
        self.valid: torch.Tensor | None = None
        self.moments: dict[tuple[str, int], Moments] = {}
        self.vectors: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, site: str, layer: int, y: torch.Tensor, z: torch.Tensor) -> None:
        y, z = select_tokens(y.detach(), self.valid), select_tokens(z.detach(), self.valid)
        if self.keep_vectors:
            self.vectors.setdefault((site, layer), []).append((y, z))
        else:
            self.moments.setdefault((site, layer), Moments()).add(y, z)


@torch.no_grad()
def _run(model: nn.Module, batches: Iterable[Batch], sites, layers, recorder: _Recorder, progress: bool, total):
    """Forward every batch (eval mode, no cache) with `recorder` tapping `sites`; restores the training flag."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        with tap_sites(model, sites, recorder, layers):
            for batch in tqdm(batches, desc="decomposing", disable=not progress, total=total, leave=False):
                ids, mask = unpack_batch(batch, device)
                recorder.valid = None if mask is None else mask.bool()
                model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        model.train(was_training)


def decompose_dataset(
    model: nn.Module,
    batches: Iterable[Batch],
    sites: str | Iterable[str] = SITES,
    layers: Iterable[int] | None = None,
    progress: bool = True,
    total: int | None = None,
) -> DirectionalReport:
    """Per-layer statistics of the updates y at each site, pooled over all real tokens of a stream of batches.

    Each batch is a (B, T) tensor of token ids or a mapping with "input_ids" and optional "attention_mask"
    (padding positions are excluded). Sites (DESIGN.md section 3):
    - "residual_attention": y = attention output after W_O, z = the residual h entering the sublayer;
    - "residual_mlp": y = MLP output, z = the residual entering the MLP;
    - "block": y = layer output - layer input, z = layer input;
    - "value": per head before W_O, y = o_t = sum_s A_ts v_s, z = v_t;
    - "value_exclude_self": y = c_t = o_t - A_tt v_t, z = v_t.
    For each (site, layer): mean |y_par|/|y_perp|, mean |y_par|^2/|y|^2, mean and std of alpha = y.z/|z|^2, mean
    cos(z, z + y); zero updates are skipped and |y_perp| ~ 0 vectors left out of the ratio (see `statistics`).
    Forward hooks only, removed afterwards also on error. Residual sites leave the model's computation untouched;
    value sites run the eager attention kernel of `sites.attention_hooks` (bit-identical to an eager model, equal
    to float rounding for sdpa/flash kernels) and see o_t before a relational model's own value-parallel removal.
    `progress` shows a tqdm bar; `total` is its length when `batches` has none.
    """
    sites = check_sites(sites, SITES)
    chosen = [roles.index for roles in select_layers(model, layers)]
    recorder = _Recorder()
    _run(model, batches, sites, chosen, recorder, progress, total)
    return DirectionalReport(
        {site: [recorder.moments.get((site, i), Moments()).summary(i) for i in chosen] for site in sites}
    )


def decompose(
    model: nn.Module,
    input_ids: torch.Tensor,
    sites: str | Iterable[str] = SITES,
    attention_mask: torch.Tensor | None = None,
    layers: Iterable[int] | None = None,
) -> DirectionalReport:
    """`decompose_dataset` on one batch: input_ids (B, T), attention_mask (B, T) with 0 at padding."""
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    return decompose_dataset(model, [batch], sites=sites, layers=layers, progress=False)


def collect_updates(
    model: nn.Module,
    input_ids: torch.Tensor,
    sites: str | Iterable[str] = SITES,
    attention_mask: torch.Tensor | None = None,
    layers: Iterable[int] | None = None,
) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The raw updates: {site: {layer: (y, z)}}, each (N, e) over real tokens (times heads at value sites), with
    y and z as defined in `decompose_dataset`. Memory grows with the batch: meant for small inputs."""
    sites = check_sites(sites, SITES)
    chosen = [roles.index for roles in select_layers(model, layers)]
    recorder = _Recorder(keep_vectors=True)
    _run(model, [{"input_ids": input_ids, "attention_mask": attention_mask}], sites, chosen, recorder, False, 1)
    return {
        site: {i: tuple(torch.cat(parts) for parts in zip(*recorder.vectors[(site, i)])) for i in chosen}
        for site in sites
    }
