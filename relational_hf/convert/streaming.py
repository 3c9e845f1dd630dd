"""Big checkpoints on one machine: conversion and analysis one decoder layer at a time (DESIGN.md 2.2, 4).

A Llama / Mistral / Qwen2 checkpoint stored as safetensors (one file, or shards listed in
`model.safetensors.index.json`) is never loaded whole. The model is built on the meta device (no memory), and
one layer at a time is materialised from the shards with `safetensors.safe_open` (each file opened and closed per
layer, so no mapping of the whole checkpoint stays resident), converted with the same per-layer functions as the
in-memory converter (`relational.convert_layer`: gains folded, QK / VO / SwiGLU moved to the pivot gauge, float64
products, float32 gauge maths), checked against the source layer on random hidden states, and written to the
output shard before the next layer is read. Embedding and head are copied (the head folded with the final gain) in
row blocks. Memory is one layer's working set, independent of depth.

Output names and layout come from the relational model itself: a `RelationalDecoderLayer` is loaded with the
converted weights and its `state_dict()` is written under the layer's prefix in `RelationalForCausalLM`, so the
file holds exactly what `save_pretrained` of the in-memory model would (source dtype kept on disk unless `dtype`
is given). The output is staged in a hidden sibling folder and renamed at the end: a failed or interrupted run
leaves no folder that looks like a checkpoint.

Streaming analysis (`redundancy_report_from_checkpoint` in `relational_hf.symmetry.report`) uses the same reader
and the meta-device model (`meta_model`, `materialize`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.dynamic_module_utils import custom_object_save
from transformers.initialization import no_init_weights

from ..architectures import get_adapter
from ..modeling import RelationalConfig, RelationalForCausalLM
from ..modeling.modeling_relational import RelationalDecoderLayer, RelationalRotaryEmbedding
from .relational import (
    _FIXED_GROUPS,
    ConversionError,
    ConversionReport,
    _check_supported,
    _sliding_window,
    convert_layer,
    fold_head,
    relational_config_for,
    relative_difference,
    source_layer_tensors,
)

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BLOCK_BYTES = 64 * 2**20  # embedding / head rows copied per block


def is_safetensors_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` is a local folder with config.json and safetensors weights (one file or an index)."""
    p = Path(path)
    return (
        p.is_dir()
        and (p / "config.json").is_file()
        and ((p / SAFE_INDEX_NAME).is_file() or (p / SAFE_WEIGHTS_NAME).is_file())
    )


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """ "float32" / "bfloat16" / "float16" (or a torch dtype, or None / "auto": keep the source's) -> torch dtype."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPE_NAMES)}; got {name!r}")
    return _DTYPE_NAMES[name]


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "2GiB"."""
    if isinstance(value, int):
        size = value
    else:
        text = value.strip().upper()
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
        for unit, factor in units.items():
            if text.endswith(unit):
                try:
                    size = int(float(text[: -len(unit)]) * factor)
                except ValueError:
                    raise ValueError(f"max_shard_size: cannot read {value!r} (e.g. 5GB, 500MB)") from None
                break
        else:
            try:
                size = int(text)
            except ValueError:
                raise ValueError(f"max_shard_size: cannot read {value!r} (e.g. 5GB, 500MB)") from None
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {value!r}")
    return size


# ----------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------


class CheckpointReader:
    """Tensors of a local safetensors checkpoint (one file or an index of shards), read on demand.

    Files are opened with `safe_open` for each batch of reads and closed afterwards, so the memory map of a 13 GB
    checkpoint never stays resident: a batch costs the tensors it returns."""

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self._safe_open = safe_open
        index = self.path / SAFE_INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError) as err:
                raise ValueError(f"{index}: not a safetensors index (no weight_map): {err}") from None
        elif (self.path / SAFE_WEIGHTS_NAME).is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"{self.path}: no {SAFE_WEIGHTS_NAME} or {SAFE_INDEX_NAME}")
        self._info: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        files = sorted(set(weight_map.values())) if weight_map is not None else [SAFE_WEIGHTS_NAME]
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise FileNotFoundError(f"{file}: shard listed in {SAFE_INDEX_NAME} is missing")
            try:
                with safe_open(str(file), framework="pt") as st:
                    for key in st.keys():
                        sl = st.get_slice(key)
                        self._info[key] = (name, sl.get_dtype(), tuple(sl.get_shape()))
            except Exception as err:  # safetensors raises its own error type for truncated or corrupt files
                raise OSError(f"{file}: not a readable safetensors file ({err})") from None
        if weight_map is not None:
            missing = sorted(k for k, f in weight_map.items() if self._info.get(k, (f,))[0] != f)
            if missing:
                raise OSError(f"{index}: {len(missing)} tensor(s) not found in their shard, e.g. {missing[0]!r}")

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def keys(self) -> list[str]:
        return list(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[self._check(name)][2]

    def dtype(self, name: str) -> torch.dtype:
        return _TORCH_DTYPES[self._info[self._check(name)][1]]

    def _check(self, name: str) -> str:
        if name not in self._info:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        return name

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors (copies in their stored dtype), each file opened once and closed afterwards."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self._info[self._check(name)][0], []).append(name)
        out = {}
        for file, keys in by_file.items():
            with self._safe_open(str(self.path / file), framework="pt") as st:
                for key in keys:
                    out[key] = st.get_tensor(key)
        return out

    def rows(self, name: str, block_bytes: int = _BLOCK_BYTES) -> Iterator[torch.Tensor]:
        """Row blocks of a 2-D tensor (about `block_bytes` each), read one block at a time."""
        file, _, shape = self._info[self._check(name)]
        row_bytes = max(1, math.prod(shape[1:]) * torch.finfo(self.dtype(name)).bits // 8)
        step = max(1, block_bytes // row_bytes)
        for start in range(0, shape[0], step):
            with self._safe_open(str(self.path / file), framework="pt") as st:
                yield st.get_slice(name)[start : start + step]


def meta_model(config, *, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of `config` on the meta device (nothing allocated), in eval mode."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return model.eval()


def checkpoint_names(model: nn.Module, reader: CheckpointReader, prefix: str = "") -> dict[str, str]:
    """state_dict name (under `prefix`) -> checkpoint name, for the model's persistent tensors under `prefix`,
    accepting checkpoints saved without the base-model prefix (e.g. "layers.0..." for "model.layers.0...")."""
    base = getattr(model, "base_model_prefix", "") or ""
    out = {}
    module = model.get_submodule(prefix) if prefix else model
    for local in module.state_dict(keep_vars=True):
        full = f"{prefix}.{local}" if prefix else local
        if full in reader:
            out[local] = full
        elif base and full.startswith(base + ".") and full[len(base) + 1 :] in reader:
            out[local] = full[len(base) + 1 :]
    return out


@torch.no_grad()
def materialize(
    model: nn.Module, reader: CheckpointReader, prefix: str, *, dtype: torch.dtype | None = None, strict: bool = True
) -> nn.Module:
    """Load the tensors of the submodule `prefix` of a meta-device `model` from the checkpoint (assigned, so the
    module holds exactly these tensors; `dtype` casts floating ones) and return the submodule. `release` frees it."""
    module = model.get_submodule(prefix) if prefix else model
    names = checkpoint_names(model, reader, prefix)
    expected = [k for k, v in module.state_dict(keep_vars=True).items()]
    missing = [k for k in expected if k not in names]
    if missing and strict:
        where = f"{prefix}." if prefix else ""
        raise KeyError(f"{reader.path}: tensor {where}{missing[0]!r} is missing from the checkpoint")
    tensors = reader.get(names.values())
    state = {}
    for local, name in names.items():
        t = tensors.pop(name)
        state[local] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    module.load_state_dict(state, strict=False, assign=True)
    return module


def trim_heap() -> None:
    """Return freed heap memory to the system (glibc `malloc_trim`; a no-op elsewhere). Per-layer work frees
    tensors of tens of MB that glibc keeps in its heap otherwise, so the resident size would creep up layer by
    layer even though nothing is alive."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release(module: nn.Module) -> None:
    """Move a materialised submodule back to the meta device (its memory is freed), dropping the per-module caches
    of derived tensors (attributes named ``*_cache``, e.g. an assembled gauge-fixed weight) that would keep it."""
    module.to("meta")
    drop_caches(module)


def drop_caches(module: nn.Module) -> None:
    """Forget the per-module caches of derived tensors (attributes named ``*_cache``, e.g. an assembled gauge-fixed
    weight kept for decoding) so that they do not hold memory between layers."""
    for m in module.modules():
        for key in [k for k in vars(m) if k.endswith("_cache")]:
            del m.__dict__[key]


@torch.no_grad()
def materialize_small(model: nn.Module, reader: CheckpointReader) -> None:
    """Load every tensor of at most one dimension (norm gains, biases, QK-norm gains) into a meta-device model:
    the few values the symmetry counts depend on (e.g. equal entries of a final gain), d per norm."""
    names = checkpoint_names(model, reader)
    params = dict(model.named_parameters())
    small = {k: v for k, v in names.items() if k in params and params[k].ndim <= 1}
    tensors = reader.get(small.values())
    for local, name in small.items():
        owner, _, attr = local.rpartition(".")
        module = model.get_submodule(owner)
        old = module._parameters[attr]
        module._parameters[attr] = nn.Parameter(tensors[name], requires_grad=old.requires_grad)


# ----------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------


class ShardWriter:
    """Write safetensors shards tensor by tensor (never a whole shard in memory).

    The header of each shard is reserved at its start (a JSON header may be padded with spaces, safetensors format)
    and filled in when the shard closes; tensors are appended as raw little-endian bytes, a tensor may arrive in
    row blocks. `finish` renames the shards as `save_pretrained` names them and writes the index."""

    def __init__(self, directory: Path, max_shard_bytes: int, header_reserve: int) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.header_reserve = (header_reserve + 7) // 8 * 8
        self.shards: list[tuple[Path, dict]] = []
        self._file = None
        self._header: dict = {}
        self._offset = 0
        self._pending: tuple[str, int] | None = None  # name, bytes still expected
        self.total_bytes = 0

    def _open(self) -> None:
        self._close()
        path = self.directory / f".shard-{len(self.shards):05d}.tmp"
        self._file = open(path, "wb")  # noqa: SIM115 - closed in _close
        self._file.write(b"\0" * (8 + self.header_reserve))
        self._header = {"__metadata__": {"format": "pt"}}
        self._offset = 0
        self.shards.append((path, self._header))

    def _close(self) -> None:
        if self._file is None:
            return
        blob = json.dumps(self._header, separators=(",", ":")).encode("utf-8")
        if len(blob) > self.header_reserve:
            raise RuntimeError(f"safetensors header of {len(blob)} bytes exceeds the {self.header_reserve} reserved")
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self.header_reserve) + blob + b" " * (self.header_reserve - len(blob)))
        self._file.close()
        self._file = None

    def begin(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Start tensor `name`; its bytes follow through `write`."""
        if self._pending is not None:
            raise RuntimeError(f"tensor {self._pending[0]!r} is incomplete")
        nbytes = math.prod(shape) * (torch.finfo(dtype).bits if dtype.is_floating_point else _int_bits(dtype)) // 8
        if self._file is None or (self._offset > 0 and self._offset + nbytes > self.max_shard_bytes):
            self._open()
        self._header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [self._offset, self._offset + nbytes],
        }
        self._pending = (name, nbytes)

    def write(self, tensor: torch.Tensor) -> None:
        """Append the bytes of `tensor` (a whole tensor or the next row block of the current one)."""
        name, left = self._pending
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes > left:
            raise RuntimeError(f"tensor {name!r}: more bytes written than its shape holds")
        self._file.write(memoryview(data))
        self._offset += data.nbytes
        self.total_bytes += data.nbytes
        self._pending = (name, left - data.nbytes) if left > data.nbytes else None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write one whole tensor."""
        self.begin(name, tuple(tensor.shape), tensor.dtype)
        if tensor.numel():
            self.write(tensor)
        else:
            self._pending = None

    def finish(self, total_parameters: int) -> dict[str, str]:
        """Close the last shard, rename the shards (model.safetensors, or model-0000i-of-0000N.safetensors with an
        index) and return the weight map."""
        if self._pending is not None:
            raise RuntimeError(f"tensor {self._pending[0]!r} is incomplete")
        self._close()
        n = len(self.shards)
        weight_map = {}
        for i, (path, header) in enumerate(self.shards):
            final = SAFE_WEIGHTS_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update({k: final for k in header if k != "__metadata__"})
        if n > 1:
            index = {
                "metadata": {"total_parameters": total_parameters, "total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.directory / SAFE_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return weight_map


def _int_bits(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.bool else torch.iinfo(dtype).bits


def staging_dir(out: Path) -> Path:
    """A fresh hidden sibling of `out` to stage a checkpoint in (renamed to `out` when complete)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.partial-{os.getpid()}-{time.monotonic_ns()}"
    stage.mkdir()
    return stage


def check_output_dir(out: Path) -> None:
    """Refuse an existing OUT that is not an empty folder (nothing is overwritten or deleted)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose a new output folder (nothing was written)")


def publish(stage: Path, out: Path) -> None:
    """Rename the completed `stage` folder to `out` (an empty `out` folder is replaced)."""
    check_output_dir(out)
    if out.is_dir():
        out.rmdir()
    os.replace(stage, out)


# ----------------------------------------------------------------------------------------------------------------
# Streaming conversion
# ----------------------------------------------------------------------------------------------------------------


def _layer_prefixes(model: nn.Module, layers: list[nn.Module]) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in layers]


def _verify_indices(num_layers: int, verify_layers: int | None) -> set[int]:
    if verify_layers is None or verify_layers >= num_layers:
        return set(range(num_layers))
    if verify_layers <= 0:
        return set()
    if verify_layers == 1:
        return {0}
    return {round(i * (num_layers - 1) / (verify_layers - 1)) for i in range(verify_layers)}


def _rotary(model: nn.Module):
    """A CPU instance of the source model's rotary embedding (the meta model's has no values)."""
    rotary = get_adapter(model).base_model().rotary_emb
    return type(rotary)(config=model.config)


@torch.no_grad()
def _layer_outputs(layer: nn.Module, hidden: torch.Tensor, rotary) -> torch.Tensor:
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    cos, sin = rotary(hidden, positions)
    out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    return out[0] if isinstance(out, tuple) else out


def stream_to_relational(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    pivot_scale: float | None = None,
    tolerance: float = 1e-4,
    verify_layers: int | None = None,
    verify_length: int = 16,
    max_shard_size: int | str = "5GB",
    trust_remote_code: bool = False,
    copy_tokenizer: bool = True,
    progress: bool = True,
) -> ConversionReport:
    """Convert the safetensors checkpoint folder `src` (Llama / Mistral / Qwen2) to a relational checkpoint `out`
    one decoder layer at a time; returns the ConversionReport (also written to out/conversion_report.json).

    Per layer: its tensors read from the shards, `convert_layer` (the in-memory converter's per-layer maths), then,
    for the layers chosen by `verify_layers` (None: all; n: n evenly spaced; 0: none), the source layer and the
    converted layer run on the same random hidden states (1 x `verify_length` x d, fp32): max |difference| must be
    <= `tolerance` x max(1, max |output|), else `ConversionError`. The layer's `state_dict()` is written in
    `dtype` (None: the source's dtype on disk). Embedding and head are copied in row blocks (head x final gain when
    untied). Shards of at most `max_shard_size` bytes ("5GB"), named and indexed like `save_pretrained`; config,
    generation config, the code files for trust_remote_code and the tokenizer (`copy_tokenizer`) are written
    beside. Everything is staged in a hidden sibling folder renamed to `out` at the end; `out` must not exist or be
    empty (FileExistsError otherwise), and a failure removes the staging folder and leaves `out` untouched."""
    from tqdm.auto import tqdm

    src, out = Path(src), Path(out)
    out_dtype = parse_dtype(dtype)
    max_shard_bytes = parse_size(max_shard_size)
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0 (relative to the output scale), got {tolerance}")
    if verify_length < 1:
        raise ValueError(f"verify_length must be >= 1, got {verify_length}")
    if not is_safetensors_checkpoint(src):
        raise FileNotFoundError(f"{src}: not a local checkpoint folder with config.json and safetensors weights")
    check_output_dir(out)
    reader = CheckpointReader(src)
    config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code)
    source = meta_model(config, trust_remote_code=trust_remote_code)
    _check_supported(source)
    materialize_small(source, reader)
    adapter = get_adapter(source)
    tie = adapter.head_tied()
    rconfig = relational_config_for(source, tie=tie, pivot_scale=pivot_scale)
    with torch.device("meta"), no_init_weights():
        target = RelationalForCausalLM(rconfig)
    if tie and target.lm_head.weight is not target.model.embed_tokens.weight:
        target.lm_head.weight = target.model.embed_tokens.weight
    expected = {k: (tuple(v.shape), v.dtype) for k, v in target.state_dict().items()}
    if tie:
        expected.pop("lm_head.weight", None)

    notes = []
    window = _sliding_window(config)
    length = verify_length if window is None else min(verify_length, window)
    if window is not None:
        notes.append(
            f"{type(source).__name__} uses sliding-window attention (window {window}); the relational model attends "
            f"to the full context, so the two agree only on sequences of at most {window} tokens"
        )
    embed_name = checkpoint_names(source, reader)
    src_names = {id(p): n for n, p in source.named_parameters()}
    embed_key = embed_name[src_names[id(adapter.embedding().weight)]]
    source_dtype = reader.dtype(embed_key)
    write_dtype = out_dtype or source_dtype

    src_layers = adapter.layers()
    src_prefixes = _layer_prefixes(source, [lr.block for lr in src_layers])
    dst_adapter = get_adapter(target)
    dst_prefixes = _layer_prefixes(target, [lr.block for lr in dst_adapter.layers()])
    verify = _verify_indices(len(src_layers), verify_layers)
    header_reserve = 4096 + 2 * sum(len(k) + 160 for k in expected)

    stage = staging_dir(out)
    written: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    worst = (0.0, 1.0, 0.0)
    start = time.perf_counter()
    try:
        writer = ShardWriter(stage, max_shard_bytes, header_reserve)

        def emit(name: str, tensor: torch.Tensor) -> None:
            t = tensor.to(write_dtype) if tensor.is_floating_point() else tensor
            writer.add(name, t)
            written[name] = (tuple(t.shape), expected.get(name, (None, t.dtype))[1])

        def emit_rows(name: str, key: str, fold_gain: torch.Tensor | None = None) -> None:
            shape = reader.shape(key)
            writer.begin(name, shape, write_dtype)
            for block in reader.rows(key):
                writer.write(block.to(write_dtype) if fold_gain is None else fold_head(block, fold_gain, write_dtype))
            written[name] = (shape, expected.get(name, (None, None))[1])

        dst_modules = {id(m): n for n, m in target.named_modules()}
        emit_rows(dst_modules[id(dst_adapter.embedding())] + ".weight", embed_key)
        with no_init_weights():
            layer = RelationalDecoderLayer(rconfig, 0).float().eval()
        generator = torch.Generator().manual_seed(0)
        src_rotary = _rotary(source) if verify else None
        dst_rotary = RelationalRotaryEmbedding(rconfig) if verify else None
        for i in tqdm(range(len(src_layers)), desc="convert layers", disable=not progress):
            block = materialize(source, reader, src_prefixes[i])  # stored dtype
            tensors = source_layer_tensors(adapter, src_layers[i])
            release(block)  # `tensors` holds the only references: convert_layer drops them as it goes
            convert_layer(layer, tensors)
            if i in verify:  # read again (from the page cache, usually) rather than kept during the conversion
                block = materialize(source, reader, src_prefixes[i], dtype=torch.float32)
                hidden = torch.randn(1, length, rconfig.hidden_size, generator=generator)
                result = relative_difference(
                    _layer_outputs(block, hidden, src_rotary), _layer_outputs(layer, hidden, dst_rotary)
                )
                worst = max(worst, result, key=lambda r: r[2])
                if not result[2] <= tolerance:
                    raise ConversionError(
                        f"layer {i}: converted layer's outputs differ from the source layer's by {result[0]:.3g} = "
                        f"{result[2]:.3g} x the output scale {result[1]:.3g} > tolerance {tolerance:g}"
                    )
                release(block)
            drop_caches(layer)
            for key, tensor in layer.state_dict().items():
                emit(f"{dst_prefixes[i]}.{key}", tensor)
            trim_heap()
        del layer
        final_key = embed_name[src_names[id(adapter.final_norm().weight)]]
        g_final = reader.get([final_key])[final_key]
        if tie:
            emit(dst_modules[id(dst_adapter.final_norm())] + ".weight", g_final)
        else:
            head_key = embed_name[src_names[id(adapter.output_head().weight)]]
            emit_rows(dst_modules[id(dst_adapter.output_head())] + ".weight", head_key, fold_gain=g_final)
        # every parameter written once with its shape (buffers: whatever the layer's own state_dict holds)
        params = {n: tuple(p.shape) for n, p in target.named_parameters()}
        mismatch = sorted(k for k, shape in params.items() if written.get(k, (None,))[0] != shape)
        if mismatch:
            raise ConversionError(
                f"streamed tensors do not match RelationalForCausalLM's parameters (e.g. {mismatch[0]!r})"
            )
        writer.finish(sum(p.numel() for p in target.parameters()))
        report = _report(source, target, tie, worst, length, tolerance, notes)
        _write_metadata(target, rconfig, write_dtype, stage)
        if copy_tokenizer:
            _copy_tokenizer(src, stage, trust_remote_code)
        (stage / "conversion_report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
        publish(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    logger.info(
        "streamed %s (%d layers) to %s in %.1f s; max relative layer difference %.3g",
        report.source_class,
        len(src_layers),
        out,
        time.perf_counter() - start,
        worst[2],
    )
    return report


@torch.no_grad()
def layerwise_logits(
    path: str | os.PathLike,
    input_ids: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    progress: bool = False,
) -> torch.Tensor:
    """Logits (N, T, V) of the causal LM checkpoint folder `path` on `input_ids` (N, T), computed one decoder layer
    at a time (each layer read from the shards, applied to the hidden states of all sequences, released), in
    `dtype`: memory is one layer, the hidden states and the head, whatever the depth. Causal attention, positions
    0..T-1, no padding. Works for any family the adapters know whose layers take (hidden, position_embeddings)."""
    from tqdm.auto import tqdm

    reader = CheckpointReader(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = meta_model(config, trust_remote_code=trust_remote_code)
    adapter = get_adapter(model)
    modules = {id(m): n for n, m in model.named_modules()}
    head = adapter.output_head()
    head_name = modules[id(adapter.embedding() if adapter.head_tied() else head)]  # before ties are broken
    embedding = materialize(model, reader, modules[id(adapter.embedding())], dtype=dtype)
    hidden = embedding(input_ids)
    release(embedding)
    rotary = _rotary(model)
    rotary.to(dtype)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    cos, sin = rotary(hidden, positions)
    for roles in tqdm(adapter.layers(), desc="layers", disable=not progress):
        block = materialize(model, reader, modules[id(roles.block)], dtype=dtype)
        out = block(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        hidden = out[0] if isinstance(out, tuple) else out
        release(block)
        trim_heap()
    norm = materialize(model, reader, modules[id(adapter.final_norm())], dtype=dtype)
    hidden = norm(hidden)
    release(norm)
    weight = materialize(model, reader, head_name, dtype=dtype).weight
    logits = torch.nn.functional.linear(hidden, weight, getattr(head, "bias", None))
    release(model.get_submodule(head_name))
    return logits


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
    """exp(mean next-token NLL) (`relational_hf.training.metrics.perplexity`) of the checkpoint at `path` on token
    ids (N, T), with the model loaded by `load_offloaded`; returns (perplexity, device map used)."""
    from ..training.metrics import perplexity

    model = load_offloaded(path, max_memory=max_memory, offload_folder=offload_folder, dtype=dtype)
    device_map = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    return perplexity(model, input_ids, batch_size=batch_size, progress=progress), device_map


def _report(source, target, tie: bool, worst, length: int, tolerance: float, notes: list[str]) -> ConversionReport:
    from ..symmetry.groups import symmetry_groups

    adapter = get_adapter(source)
    groups, _ = symmetry_groups(source)
    removed: dict[str, int] = {}
    remaining: dict[str, int] = {}
    for g in groups:
        bucket = removed if g.name in _FIXED_GROUPS else remaining
        bucket[g.name] = bucket.get(g.name, 0) + g.dimension()
    remaining.pop("norm_gain", None)
    gain_final = adapter.final_norm().weight
    gains = (
        sum(norm.weight.numel() for layer in adapter.layers() for norm in (layer.attention_norm, layer.mlp_norm))
        + gain_final.numel()
    )
    report = ConversionReport(
        source_class=type(source).__name__,
        source_parameters=sum(p.numel() for p in source.parameters()),
        source_norm_gain_parameters=gains,
        removed_orbit_dimensions=removed,
        relational_parameters=sum(p.numel() for p in target.parameters()),
        max_logit_difference=worst[0],
        verified_sequence_length=length,
        kept_final_gain=gain_final.numel() if tie else 0,
        logit_scale=worst[1],
        relative_logit_difference=worst[2],
        tolerance=tolerance,
        verified_on="random hidden states, layer by layer (outputs, not logits)",
        remaining_symmetries=remaining,
        notes=notes,
    )
    if report.relational_parameters != report.expected_parameters:
        raise ConversionError(
            f"converted model stores {report.relational_parameters:,} parameters, expected {report.expected_parameters:,}"
        )
    return report


def _write_metadata(target: RelationalForCausalLM, config: RelationalConfig, dtype: torch.dtype, directory: Path):
    """config.json (with dtype and architectures), generation_config.json and the code files, as save_pretrained."""
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(target).__name__]
    if target.is_remote_code():
        custom_object_save(target, directory, config=config)
    config.save_pretrained(directory)
    if target.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(directory)


def _copy_tokenizer(src: Path, directory: Path, trust_remote_code: bool) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        logger.info("no tokenizer at %s; the converted checkpoint has none", src)
        return
    tokenizer.save_pretrained(directory)


__all__ = [
    "CheckpointReader",
    "ShardWriter",
    "check_output_dir",
    "drop_caches",
    "checkpoint_names",
    "is_safetensors_checkpoint",
    "layerwise_logits",
    "load_offloaded",
    "offloaded_perplexity",
    "materialize",
    "materialize_small",
    "meta_model",
    "parse_dtype",
    "parse_size",
    "publish",
    "release",
    "staging_dir",
    "trim_heap",
    "stream_to_relational",
]
