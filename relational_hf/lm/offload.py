"""Evaluation of models that do not fit in memory: Accelerate's big-model loading with disk offload."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ..loading import from_pretrained_checked
from ..shards import parse_dtype
from .metrics import perplexity


@contextlib.contextmanager
def shards_read_not_mapped():
    """Within the context, Transformers reads the safetensors shards it loads for the CPU with `pread` instead of
    memory-mapping them. Its loader maps every shard for the whole load and reads each tensor through the map, so a
    checkpoint loaded with disk offload became resident as file pages in full (a 13.5 GB checkpoint: 14 GB of
    VmHWM for a model held in 1.6 GiB of weights) although only one tensor at a time is needed. Read with `pread`, a
    tensor costs its own (anonymous) memory while it is cast and placed, and nothing of the file stays resident.
    Where this safetensors has no `pread` backend or Transformers opens its shards otherwise, loading is unchanged."""
    from transformers import modeling_utils

    safe_open = getattr(modeling_utils, "safe_open", None)
    if safe_open is None or not _has_pread_backend():
        yield
        return

    def pread_open(filename, framework="pt", device="cpu", backend=None, **kwargs):
        if str(device) == "cpu" and backend in (None, "mmap"):
            backend = "pread"
        if backend is None:
            return safe_open(filename, framework=framework, device=device, **kwargs)
        return safe_open(filename, framework=framework, device=device, backend=backend, **kwargs)

    modeling_utils.safe_open = pread_open
    try:
        yield
    finally:
        modeling_utils.safe_open = safe_open


def _has_pread_backend() -> bool:
    """Whether this safetensors can read a file with `pread` (`safe_open(..., backend="pread")`, 0.8 and later)."""
    import safetensors

    try:
        version = tuple(int(part) for part in safetensors.__version__.split(".")[:2])
    except ValueError:
        return False
    return version >= (0, 8)


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
    each offloaded layer in when it runs, so evaluation works at the cost of reading it each time. The shards are
    read, not memory-mapped (`shards_read_not_mapped`), so loading holds one tensor of the checkpoint at a time."""
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
        with shards_read_not_mapped():
            model = from_pretrained_checked(AutoModelForCausalLM, str(path), **kwargs)
    except BaseException:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if temporary:
        weakref.finalize(model, shutil.rmtree, str(folder), True)
    return model.eval()


#: why a GGUF file cannot be offloaded
GGUF_NOT_OFFLOADED = (
    "--max-memory / --offload-folder need a Transformers checkpoint or a local GGUF file; a GGUF file on the Hub loads "
    "whole (download it first)"
)


def load_model(
    source,
    *,
    max_memory: int | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = "float32",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, dict[str, str]]:
    """(model in eval mode, device map) of a `loading.ModelSource` (or anything `resolve_model_source` accepts), as
    the commands with --max-memory / --offload-folder load it: offloaded (`load_offloaded`, at most `max_memory` bytes
    of weights on the CPU) when either is given, whole (`loading.load_model_from`) otherwise. A local GGUF file to
    offload is first written as a safetensors working copy in `dtype`, one tensor dequantised at a time
    (`shards.gguf_to_safetensors`, in the offload folder; removed with the model), since Accelerate offloads from
    safetensors. The device map says where each module sits ({"": device} for a model in one piece). ValueError for
    offloading a GGUF file that is not on this machine."""
    import tempfile
    import weakref

    from ..loading import ModelSource, load_model_from, resolve_model_source
    from ..shards import gguf_to_safetensors

    if not isinstance(source, ModelSource):
        source = resolve_model_source(source)
    if max_memory is None and offload_folder is None:
        model = load_model_from(source, dtype=dtype, trust_remote_code=trust_remote_code).eval()
        return model, {"": str(next(model.parameters()).device)}
    location, copy = source.location, None
    if source.gguf_file is not None:
        if not source.local:
            raise ValueError(GGUF_NOT_OFFLOADED)
        if offload_folder is not None:
            Path(offload_folder).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="relational-gguf-", dir=offload_folder))
        copy = root
        try:
            location = gguf_to_safetensors(
                Path(source.location) / source.gguf_file, root / "model", dtype=parse_dtype(dtype)
            )
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
    try:
        model = load_offloaded(
            location,
            max_memory=None if max_memory is None else {"cpu": max_memory},
            offload_folder=offload_folder,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
        )
    except BaseException:
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)
        raise
    if copy is not None:
        weakref.finalize(model, shutil.rmtree, str(copy), True)
    device_map = {k: str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()}
    return model, device_map or {"": "cpu"}  # everything fitted in max_memory: Accelerate placed it whole


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


def device_map_line(device_map: dict[str, str]) -> str:
    """Where a model sits, in words: "the whole model on cpu", or "cpu: 2 module(s), disk: 3 module(s)"."""
    if list(device_map) == [""]:
        return f"the whole model on {device_map['']}"
    return ", ".join(f"{device}: {count} module(s)" for device, count in device_map_summary(device_map).items())


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes; Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
