"""Evaluation of models that do not fit in memory: Accelerate's big-model loading with disk offload."""

from __future__ import annotations

import os
import resource
import shutil
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ..shards import parse_dtype
from .metrics import perplexity


def load_offloaded(
    path: str | os.PathLike,
    *,
    max_memory: dict[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """A causal LM too big for memory, loaded with Accelerate's big-model loading: `device_map="auto"` fills the
    accelerators, then the CPU up to `max_memory` (e.g. {"cpu": "8GiB"}; default: what is free), and offloads the
    remaining decoder layers to disk (`offload_folder`; a temporary folder removed with the model when None).
    Layers are never split (`_no_split_modules`). The placement is in `model.hf_device_map`; forward passes move
    each offloaded layer in when it runs, so evaluation works at the cost of reading it each time."""
    import tempfile
    import weakref

    temporary = offload_folder is None
    folder = Path(tempfile.mkdtemp(prefix="relational-offload-")) if temporary else Path(offload_folder)
    kwargs = dict(device_map="auto", offload_folder=str(folder), trust_remote_code=trust_remote_code)
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    torch_dtype = parse_dtype(dtype)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except BaseException:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if temporary:
        weakref.finalize(model, shutil.rmtree, str(folder), True)
    return model.eval()


def offloaded_perplexity(
    path: str | os.PathLike,
    input_ids: torch.Tensor,
    *,
    max_memory: dict[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> tuple[float, dict[str, str]]:
    """exp(mean next-token NLL) (`relational_hf.lm.metrics.perplexity`) of the checkpoint at `path` on token
    ids (N, T), with the model loaded by `load_offloaded`; returns (perplexity, device map used)."""
    model = load_offloaded(path, max_memory=max_memory, offload_folder=offload_folder, dtype=dtype)
    device_map = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    return perplexity(model, input_ids, batch_size=batch_size, progress=progress), device_map


def device_map_summary(device_map: dict[str, str]) -> dict[str, int]:
    """How many modules of a device map sit on each device ({} for a model loaded whole: everything on its device)."""
    return dict(sorted(Counter(str(v) for v in device_map.values()).items()))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes; Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
