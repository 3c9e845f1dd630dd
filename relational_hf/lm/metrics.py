"""Evaluation metrics, computed here (Evaluate's metric scripts are fetched from the Hub). The one home of
perplexity for the trainer, the converter and the analysis tools."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm


def _batches(
    input_ids: torch.Tensor | Sequence[torch.Tensor], attention_mask: torch.Tensor | None, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (N, T) token ids, got shape {tuple(input_ids.shape)}")
        for start in range(0, input_ids.shape[0], batch_size):
            mask = None if attention_mask is None else attention_mask[start : start + batch_size]
            yield input_ids[start : start + batch_size], mask
    else:  # a sequence of (T,) or (B, T) tensors of any lengths, each evaluated as its own batch
        for ids in input_ids:
            yield (ids.unsqueeze(0) if ids.dim() == 1 else ids), None


@torch.no_grad()
def token_nll(
    model: nn.Module,
    input_ids: torch.Tensor | Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) and the number of predicted tokens. A target counts when it
    and the token before it are real (attention_mask 1). Eval mode while it runs; the training flag is restored."""
    # a model dispatched by Accelerate (device_map with CPU / disk offload) holds meta parameters; its hooks move the
    # inputs to each module's execution device, so any real device will do for them
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        n = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) else len(input_ids)
        steps = math.ceil(n / batch_size) if isinstance(input_ids, torch.Tensor) else n
        for ids, mask in tqdm(
            _batches(input_ids, attention_mask, batch_size),
            total=steps,
            desc="evaluating",
            disable=not progress,
            leave=False,
        ):
            ids = ids.to(device)
            mask = None if mask is None else mask.to(device)
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
            valid = torch.ones_like(nll, dtype=torch.bool) if mask is None else (mask[:, 1:] * mask[:, :-1]).bool()
            total += nll[valid].double().sum().item()
            count += int(valid.sum())
    finally:
        model.train(was_training)
    return total, count


def perplexity(
    model: nn.Module,
    input_ids: torch.Tensor | Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> float:
    """exp(mean next-token NLL) of a causal LM over (N, T) token ids (or a sequence of id tensors)."""
    total, count = token_nll(model, input_ids, attention_mask, batch_size, progress)
    if count == 0:
        raise ValueError("no target token to evaluate (sequences shorter than 2 real tokens)")
    mean = total / count
    return math.exp(mean) if mean < 709.0 else (math.inf if mean == mean else math.nan)  # exp overflows past 709
