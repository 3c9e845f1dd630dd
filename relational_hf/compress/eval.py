"""Measuring compression: stored parameters (by kind and by layer), evaluation windows of a text, perplexity.

Stored parameters count every tensor a checkpoint of the model must hold, ONCE: tied tensors (the same storage
reached under two names) count once; buffers that only describe a layout (integer index buffers, boolean masks), the
gauge constants of a `GaugeFixedLinear` and non-persistent buffers (rotary frequencies) do not count; extra matrices
such as SliceGPT's shortcuts do. Pruned weights keep their dense storage here; `nonzero` counts their non-zeros.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from ..lm.data import document_split
from ..lm.metrics import perplexity
from ..params import (  # noqa: F401  (the counting lives with the parameter formulas; public here too)
    PARAMETER_KINDS,
    ModelGrewError,
    check_not_grown,
    parameter_kind,
    stored_parameters,
)

logger = logging.getLogger(__name__)

TEXT_SPLITS: tuple[str, ...] = ("all", "first", "last")


def _read_text(path_or_text: str | os.PathLike) -> tuple[str, str]:
    """(text, description): a path of an existing file is read, any other string is the text itself."""
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str) and "\n" not in path_or_text and len(path_or_text) < 4096
    ):
        path = Path(path_or_text)
        if path.is_file():
            return path.read_text(encoding="utf-8"), str(path)
        if isinstance(path_or_text, os.PathLike):
            raise FileNotFoundError(f"text file not found: {path}")
    return str(path_or_text), "given text"


def text_windows(
    path_or_text: str | os.PathLike,
    tokenizer,
    window: int = 512,
    n: int | None = None,
    split: str = "all",
    fraction: float = 0.1,
    spread: bool = False,
    short_ok: bool = False,
) -> torch.Tensor:
    """Non-overlapping windows (n, window) of token ids of a text file (or a text given as a string).

    split "all": the whole text; "first": its first 1 - `fraction`, "last": its last `fraction`, cut at the WikiText
    top-level heading ` = Title = ` closest to that mark (`relational_hf.lm.data.document_split`; whole documents on
    each side; a text without headings is cut at a line). "first" windows are taken from the start, "last" windows
    from the start of the held-out part too. `n` (default: all that fit) caps the number of windows; with `spread`
    the n windows are spread evenly over the whole (split) text instead of being its first n (more documents for the
    same number of tokens). A text too short for one window raises ValueError; one with fewer than n windows gives
    what it has, with a warning unless `short_ok` (a caller that makes up for it from other texts)."""
    if split not in TEXT_SPLITS:
        raise ValueError(f"split must be one of {', '.join(TEXT_SPLITS)}, got {split!r}")
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an integer >= 2 tokens, got {window!r}")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive number of windows or None, got {n!r}")
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    text, _ = _read_text(path_or_text)
    if split != "all":

        first, last = document_split(text, fraction)
        text = first if split == "first" else last
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return id_windows(torch.tensor(ids, dtype=torch.long), window, n, spread, short_ok)


def id_windows(
    ids: torch.Tensor, window: int, n: int | None = None, spread: bool = False, short_ok: bool = False
) -> torch.Tensor:
    """Non-overlapping windows (n, window) of a sequence of token ids (any shape, read in order), from its start;
    `n`, `spread` and `short_ok` as in `text_windows`. Too few ids for one window raise ValueError."""
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an integer >= 2 tokens, got {window!r}")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive number of windows or None, got {n!r}")
    ids = ids.reshape(-1).long()
    available = ids.numel() // window
    if available < 1:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of {window}")
    count = available if n is None else min(n, available)
    if n is not None and n > available and not short_ok:
        logger.warning("asked for %d windows of %d tokens, the text has only %d", n, window, available)
    windows = ids[: available * window].view(available, window)
    if spread and count < available:
        return windows[torch.linspace(0, available - 1, count).round().long()]
    return windows[:count]


def perplexity_on_windows(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 4, progress: bool = False
) -> float:
    """exp of the mean next-token NLL over every predicted token of `windows` (n, T) (each window on its own, no
    context carried over), through the project's `relational_hf.lm.metrics.perplexity`."""
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long:
        raise ValueError("windows must be a LongTensor of shape (n, T)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return perplexity(model, windows, batch_size=batch_size, progress=progress)


def shared_windows(windows: torch.Tensor, others: torch.Tensor) -> int:
    """How many rows of `windows` (N, T) are also rows of `others` (M, T): evaluation windows that the compression
    fitted on measure the fit, not held-out quality (0 when the window lengths differ)."""
    if windows.dim() != 2 or others.dim() != 2 or windows.shape[1] != others.shape[1]:
        return 0
    seen = {row.numpy().tobytes() for row in others.long().cpu()}
    return sum(row.numpy().tobytes() in seen for row in windows.long().cpu())


def eval_table(before: dict[str, float], after: dict[str, float], windows: dict[str, list[int]]) -> dict:
    """The compression report's per-text evaluation: for each named text (e.g. each --eval file) its windows, its
    perplexity before and after and their ratio, and the worst ratio with its text's name (what a user who serves
    more than one kind of text gets at worst)."""
    texts = {
        name: {
            "windows": list(windows[name]),
            "perplexity_before": before[name],
            "perplexity_after": after[name],
            "ratio": after[name] / before[name] if before[name] else float("nan"),
        }
        for name in before
    }
    worst = max(texts, key=lambda n: texts[n]["ratio"]) if texts else None
    return {"texts": texts, "worst_ratio": texts[worst]["ratio"] if worst else None, "worst_text": worst}


__all__ = [
    "PARAMETER_KINDS",
    "eval_table",
    "ModelGrewError",
    "check_not_grown",
    "TEXT_SPLITS",
    "id_windows",
    "parameter_kind",
    "perplexity_on_windows",
    "shared_windows",
    "stored_parameters",
    "text_windows",
]
