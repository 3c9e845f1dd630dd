"""Evaluation metrics computed here (Evaluate's metric scripts are fetched from the Hub)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def token_nll(model, blocks: torch.Tensor, batch_size: int = 8, progress: bool = False) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) and the number of predicted tokens over (N, T) blocks."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        batches = range(0, blocks.shape[0], batch_size)
        for start in tqdm(batches, desc="evaluating", disable=not progress, leave=False):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids).logits[:, :-1].float()  # (B, T-1, V)
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
            total += nll.item()
            count += ids[:, 1:].numel()
    finally:
        model.train(was_training)
    return total, count


def perplexity(model, blocks: torch.Tensor, batch_size: int = 8, progress: bool = False) -> float:
    """exp(mean token NLL) of a causal LM over (N, T) blocks of token ids."""
    total, count = token_nll(model, blocks, batch_size, progress)
    return math.exp(total / max(1, count))
