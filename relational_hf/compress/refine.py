"""Refinement of a compressed SwiGLU block by gradient descent on its own calibration target.

The closed-form refit (`truncation.mlp_refit`) finds the best W_down for the kept units with W_gate and W_up fixed.
`refine_mlp` then moves all three of the kept maps together, by a few epochs of Adam on the same weighted
least-squares objective: sum over tokens of w_t |MLP(x_t) - y_t|^2, with the refit's target y and token weights w.
The last calibration windows are held back from the descent: the weights kept are those of the epoch (the given
weights counting as epoch 0) with the smallest error on them, so the refinement never returns a block that fits them
worse than the given one did. (`compress.lowrank` gives the closed form fitted on every window, the held-back ones
included, so this choice leans towards the closed form.) Deterministic for a given seed. It neither truncates nor
plans: the widths are those it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Adam's rate of the refinement. On SmolLM2 at 25%, 1e-4 gained less in a probe, and at 1e-3 29 of 30 layers kept the
#: closed form (held-out 52.55 against 50.85; `benchmarks/results/compress_refine_lr1e-3.json`).
DEFAULT_REFINE_LR = 3e-4
#: tokens a step of the refinement: 1,024 rather than 2,048 (the same tokens seen, the same time an epoch when timed
#: alternately): held out on SmolLM2 at 25%, 50.39 against 50.85 on the benchmark's split, 27.62 against 27.99 on the
#: reverse one (`benchmarks/results/compress_refine1024.json`, `compress_reverse_refine1024.json`).
DEFAULT_REFINE_BATCH_TOKENS = 1024


@dataclass
class RefineOptions:
    """Settings of `refine_mlp`: epochs over the training windows, Adam's learning rate, the number of calibration
    windows held back (the last ones) and the tokens per step."""

    epochs: int = 4
    lr: float = DEFAULT_REFINE_LR
    held_out: int = 16
    batch_tokens: int = DEFAULT_REFINE_BATCH_TOKENS
    seed: int = 0


def check_refine(
    epochs: int, lr: float, held_out: int, windows: int | None = None, batch_tokens: int = DEFAULT_REFINE_BATCH_TOKENS
) -> None:
    """ValueError in one line for refinement settings that cannot run (`windows`: calibration windows available)."""
    if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise ValueError(f"`refine_batch_tokens` must be a number of tokens >= 1, got {batch_tokens!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"`refine_epochs` must be a number of epochs >= 0, got {epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or lr != lr or lr == float("inf"):
        raise ValueError(f"`refine_lr` must be a finite learning rate > 0, got {lr!r}")
    if isinstance(held_out, bool) or not isinstance(held_out, int) or held_out < 1:
        raise ValueError(f"`refine_holdout` must be a number of calibration windows >= 1, got {held_out!r}")
    if epochs and windows is not None and held_out >= windows:
        raise ValueError(
            f"`refine_holdout` ({held_out}) must leave calibration windows to train on (of {windows}): "
            "give more calibration windows or hold fewer back"
        )


def swiglu(weights: dict[str, torch.Tensor], act: Callable, x: torch.Tensor) -> torch.Tensor:
    """act(x W_gate^T) * (x W_up^T) W_down^T for weights {"gate", "up", "down"} in Linear layout."""
    return F.linear(act(F.linear(x, weights["gate"])) * F.linear(x, weights["up"]), weights["down"])


def weighted_error(
    weights: dict[str, torch.Tensor], act: Callable, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
    batch_tokens: int = 4096,
) -> float:
    """sum_t w_t |MLP(x_t) - y_t|^2 over tokens (rows of x, y; w per row), in float64, without gradients."""
    total = 0.0
    with torch.no_grad():
        for a in range(0, x.shape[0], batch_tokens):
            err = (swiglu(weights, act, x[a : a + batch_tokens]) - y[a : a + batch_tokens]).pow(2).sum(-1)
            total += float((err.double() * w[a : a + batch_tokens].double()).sum())
    return total


def refine_mlp(
    weights: dict[str, torch.Tensor], act: Callable, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None,
    windows: int, opts: RefineOptions,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Refine the kept SwiGLU maps {"gate", "up", "down"} (Linear layout) on inputs x (windows x T, d) — the normed
    hidden states the block reads — towards targets y (same shape) with token weights w (rows; None: 1).

    The rows of the last `opts.held_out` windows are held back; Adam runs `opts.epochs` epochs over the others in
    steps of `opts.batch_tokens` rows (a seeded random order of whole steps), and the weights of the epoch with the
    smallest held-back error are returned, the given weights when no epoch improves on them. Returns (weights in
    their given dtype, record: held-back error before and after, the epoch kept)."""
    check_refine(opts.epochs, opts.lr, opts.held_out, windows, opts.batch_tokens)
    rows = x.shape[0]
    if rows % windows:
        raise ValueError(f"{rows} rows are not {windows} windows of equal length")
    w = torch.ones(rows, dtype=x.dtype, device=x.device) if w is None else w.reshape(-1).to(x.dtype)
    cut = (windows - opts.held_out) * (rows // windows)
    held = (x[cut:], y[cut:], w[cut:])
    params = {k: v.detach().float().clone().requires_grad_(True) for k, v in weights.items()}
    before = weighted_error(params, act, *held)
    best, best_epoch, best_state = before, 0, None
    steps = max(cut // opts.batch_tokens, 1)
    size = cut // steps
    optimiser = torch.optim.Adam(params.values(), lr=opts.lr)
    generator = torch.Generator().manual_seed(opts.seed)
    with torch.enable_grad():
        for epoch in range(1, opts.epochs + 1):
            for i in torch.randperm(steps, generator=generator).tolist():
                s = slice(i * size, (i + 1) * size)
                err = (swiglu(params, act, x[s].float()) - y[s].float()).pow(2).sum(-1)
                loss = (err * w[s].float()).sum() / size
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
            error = weighted_error(params, act, *held)
            if error < best:
                best, best_epoch = error, epoch
                best_state = {k: v.detach().clone() for k, v in params.items()}
    kept = weights if best_state is None else {k: best_state[k].to(weights[k].dtype) for k in weights}
    record = {"refine_held_out_error_before": before, "refine_held_out_error_after": best, "refine_epoch": best_epoch}
    return kept, record


__all__ = [
    "DEFAULT_REFINE_BATCH_TOKENS",
    "DEFAULT_REFINE_LR",
    "RefineOptions",
    "check_refine",
    "refine_mlp",
    "swiglu",
    "weighted_error",
]
