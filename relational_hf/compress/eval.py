"""Measuring compression: stored parameters (by kind and by layer), evaluation windows of a text, perplexity.

Stored parameters count every tensor a checkpoint of the model must hold, ONCE: tied tensors (the same storage
reached under two names) count once; buffers that only describe a layout (integer index buffers, boolean masks), the
gauge constants of a `GaugeFixedLinear` and non-persistent buffers (rotary frequencies) do not count; extra matrices
such as SliceGPT's shortcuts do. Pruned weights keep their dense storage here; `nonzero` counts their non-zeros.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from ..modeling import GaugeFixedLinear
from ..training.metrics import perplexity

logger = logging.getLogger(__name__)

PARAMETER_KINDS: tuple[str, ...] = ("embedding", "head", "attention_qk", "attention_vo", "mlp", "norms", "other")
TEXT_SPLITS: tuple[str, ...] = ("all", "first", "last")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def parameter_kind(name: str) -> str:
    """The kind of a stored tensor from its qualified name: embedding, head, attention_qk (queries, keys and their
    biases), attention_vo (values, outputs), mlp, norms (gains) or other (shortcut matrices and anything else)."""
    leaf = name.lower()
    if "embed" in leaf or leaf.startswith("wte") or ".wte." in leaf or ".wpe." in leaf:
        return "embedding"
    if leaf.startswith("lm_head") or ".lm_head." in leaf:
        return "head"
    if "shortcut" in leaf:
        return "other"
    if "norm" in leaf or re.search(r"(^|\.)ln_\w+\.", leaf):
        return "norms"
    if re.search(r"(q_proj|k_proj|\.wq\.|\.wk\.|query|key)", leaf):
        return "attention_qk"
    if re.search(r"(v_proj|o_proj|\.wv\.|\.wo\.|value|out_proj|attn\.c_proj|c_attn)", leaf):
        return "attention_vo"
    if re.search(r"(mlp|gate_proj|up_proj|down_proj|c_fc|feed_forward|ffn)", leaf):
        return "mlp"
    return "other"


def _stored_tensors(model: nn.Module):
    """(qualified name, tensor) for every stored tensor once (the first name under which its storage appears)."""
    seen: set[tuple[int, int, tuple]] = set()

    def first_time(t: torch.Tensor) -> bool:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            return False
        seen.add(key)
        return True

    for name, p in model.named_parameters(remove_duplicate=True):
        if first_time(p):
            yield name, p
    for module_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            if not (buf.is_floating_point() or buf.is_complex()):
                continue  # layout: indices, masks
            if isinstance(module, GaugeFixedLinear) and buf_name == "fixed_value":
                continue  # gauge constants, not data
            if first_time(buf):
                yield (f"{module_name}.{buf_name}" if module_name else buf_name), buf


def stored_parameters(model: nn.Module) -> dict:
    """Stored parameters of `model`: {"total": int, "by_kind": {kind: int}, "by_layer": [int per decoder layer],
    "nonzero": int}. Every stored tensor counts once (see the module docstring); "by_layer" sums the tensors whose
    name holds `layers.<i>.`; "nonzero" counts the non-zero entries (what a sparse format would store)."""
    by_kind = dict.fromkeys(PARAMETER_KINDS, 0)
    layers: dict[int, int] = defaultdict(int)
    total = nonzero = 0
    for name, t in _stored_tensors(model):
        n = t.numel()
        total += n
        nonzero += int(torch.count_nonzero(t.detach()))
        by_kind[parameter_kind(name)] += n
        m = _LAYER.search(name)
        if m:
            layers[int(m.group(1))] += n
    by_layer = [layers.get(i, 0) for i in range(max(layers) + 1)] if layers else []
    return {"total": total, "by_kind": by_kind, "by_layer": by_layer, "nonzero": nonzero}


class ModelGrewError(ValueError):
    """A compression method produced a model storing more parameters than its source."""


def check_not_grown(before: int | nn.Module, after: int | nn.Module, method: str = "compression") -> None:
    """Raise ModelGrewError when `after` stores more parameters than `before` (models or stored totals): no
    compression method may return a larger model than its source."""
    b = before if isinstance(before, int) else stored_parameters(before)["total"]
    a = after if isinstance(after, int) else stored_parameters(after)["total"]
    if a > b:
        raise ModelGrewError(
            f"{method} would store {a:,} parameters, more than the source's {b:,}; choose a larger reduction"
        )


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
) -> torch.Tensor:
    """Non-overlapping windows (n, window) of token ids of a text file (or a text given as a string).

    split "all": the whole text; "first": its first 1 - `fraction`, "last": its last `fraction`, cut at the WikiText
    top-level heading ` = Title = ` closest to that mark (`training.reference.document_split`; whole documents on
    each side; a text without headings is cut at a line). "first" windows are taken from the start, "last" windows
    from the start of the held-out part too. `n` (default: all that fit) caps the number of windows; a text too
    short for one window raises ValueError."""
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
        from ..training.reference import document_split  # heavy module (trainer, hub): imported on use

        first, last = document_split(text, fraction)
        text = first if split == "first" else last
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    available = len(ids) // window
    if available < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    count = available if n is None else min(n, available)
    if n is not None and n > available:
        logger.warning("asked for %d windows of %d tokens, the text has only %d", n, window, available)
    return torch.tensor(ids[: count * window], dtype=torch.long).view(count, window)


def perplexity_on_windows(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 4, progress: bool = False
) -> float:
    """exp of the mean next-token NLL over every predicted token of `windows` (n, T) (each window on its own, no
    context carried over), through the project's `training.metrics.perplexity`."""
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long:
        raise ValueError("windows must be a LongTensor of shape (n, T)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return perplexity(model, windows, batch_size=batch_size, progress=progress)


__all__ = [
    "PARAMETER_KINDS",
    "ModelGrewError",
    "check_not_grown",
    "TEXT_SPLITS",
    "parameter_kind",
    "perplexity_on_windows",
    "stored_parameters",
    "text_windows",
]
