"""Safetensors checkpoints read and written one tensor (or one layer) at a time.

`CheckpointReader` opens one file or the shards of `model.safetensors.index.json` with `safetensors.safe_open` per
request, so no mapping of the whole checkpoint stays resident; `meta_model` builds a model on the meta device and
`materialize` / `release` load and drop one submodule's tensors; `ShardWriter` writes tensors as they come into
shards named and indexed like `save_pretrained` (into a staging folder of `relational_hf.outputs`).
`checkpoint_files` is the one reader of `model.safetensors.index.json`. Used by streaming conversion
(`relational_hf.convert.streaming`), canonicalisation and analysis (`relational_hf.symmetry`).

`GGUFCheckpointReader` reads a GGUF file (llama.cpp's format) the same way: its tensors under the Transformers names
of the model its metadata describes, each dequantised on its own (rows of the embedding and head a block at a time),
read from the file rather than a memory map; `open_checkpoint` takes a `.gguf` file as well as a folder.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from .errors import invalid_config_error
from .renaming import renamed_names

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
_CAST_BLOCK_BYTES = 16 * 2**20  # a tensor cast while written: bytes per block


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


def parse_size(value: int | str, name: str = "max_shard_size") -> int:
    """Bytes from an int, a string of digits, or a size such as "5GB", "500MB", "2GiB" (Transformers' parser), > 0;
    ValueError naming `name` otherwise."""
    from transformers.utils.hub import convert_file_size_to_int

    text = value.strip() if isinstance(value, str) else value
    try:
        size = int(text) if isinstance(text, str) and text.isdigit() else convert_file_size_to_int(text)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"{name}: cannot read the size {value!r} (e.g. 5GB, 500MB, 2GiB)") from None
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{name}: a size must be positive, got {value!r}")
    return size


def checkpoint_files(path: str | os.PathLike) -> tuple[list[str], dict[str, str] | None]:
    """(weight file names, weight map) of a local safetensors checkpoint folder: the shards named by
    `model.safetensors.index.json` with its tensor -> shard map, or ["model.safetensors"] and None. Raises
    FileNotFoundError when there is neither, ValueError for an index without a weight map."""
    path = Path(path)
    index = path / SAFE_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index}: not a safetensors index (no weight_map): {err}") from None
        return files, weight_map
    if (path / SAFE_WEIGHTS_NAME).is_file():
        return [SAFE_WEIGHTS_NAME], None
    raise FileNotFoundError(f"{path}: no {SAFE_WEIGHTS_NAME} or {SAFE_INDEX_NAME}")


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
        files, weight_map = checkpoint_files(self.path)
        index = self.path / SAFE_INDEX_NAME
        self._info: dict[str, tuple[str, str, tuple[int, ...]]] = {}
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


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for an existing file named *.gguf."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" and path.is_file()


def read_gguf(path: str | os.PathLike):
    """`gguf.GGUFReader` of a GGUF file (its header parsed, the tensors memory-mapped, none read); OSError naming the
    file when it is not a readable GGUF file (the gguf package raises whatever its parser meets: struct, value and
    index errors on a truncated or foreign file)."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # noqa: BLE001 - any parse failure of the file is the same problem for the user
        raise OSError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None


class GGUFCheckpointReader:
    """The tensors of a GGUF file under the Transformers names of `model` (its meta-device model), with the interface
    of `CheckpointReader` (`parsed`: the file's `read_gguf` parse, when the caller has it). Names are mapped and the tensors put in Transformers' layout (e.g. Llama's query and key
    rows un-permuted) by Transformers' own GGUF tables (`transformers.modeling_gguf_pytorch_utils`); quantised
    tensors are dequantised with the `gguf` package to float32, one tensor (or one block of rows) per read, and the
    bytes are read from the file each time, so nothing of the file stays in memory. `dtype(name)` is float32 for a
    quantised tensor and the stored dtype for F32 / F16 / BF16 ones."""

    def __init__(self, path: str | os.PathLike, model: nn.Module, parsed=None) -> None:
        import gguf
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path = Path(path)
        self._gguf = gguf
        reader = parsed if parsed is not None else read_gguf(self.path)  # parsing a header takes seconds: reuse it
        arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
        self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
        to_hf = get_gguf_hf_weights_map(model, self._processor)
        plain = {
            gguf.GGMLQuantizationType.F32: torch.float32,
            gguf.GGMLQuantizationType.F16: torch.float16,
            gguf.GGMLQuantizationType.BF16: torch.bfloat16,
        }
        self._info: dict[str, tuple] = {}
        for tensor in reader.tensors:
            if tensor.name not in to_hf:
                continue  # e.g. rope frequency tables that no model loads
            stored = tensor.data  # a view of the memory map: its shape and dtype, no data read
            shape = tuple(int(n) for n in reversed(tensor.shape))
            dtype = plain.get(tensor.tensor_type, torch.float32)
            self._info[to_hf[tensor.name]] = (tensor, stored.dtype, stored.shape, shape, dtype)
        del reader

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def keys(self) -> list[str]:
        return list(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[self._check(name)][3]

    def dtype(self, name: str) -> torch.dtype:
        return self._info[self._check(name)][4]

    def _check(self, name: str) -> str:
        if name not in self._info:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the GGUF file")
        return name

    def _read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start..stop of the stored tensor (its first dimension: rows of the Transformers layout), dequantised."""
        import numpy as np

        tensor, raw_dtype, raw_shape, shape, dtype = self._info[self._check(name)]
        stop = raw_shape[0] if stop is None else min(stop, raw_shape[0])
        row = math.prod(raw_shape[1:]) if len(raw_shape) > 1 else 1
        raw = np.fromfile(
            self.path,
            dtype=raw_dtype,
            count=(stop - start) * row,
            offset=int(tensor.data_offset) + start * row * raw_dtype.itemsize,
        ).reshape(stop - start, *raw_shape[1:])
        plain = (self._gguf.GGMLQuantizationType.F32, self._gguf.GGMLQuantizationType.F16)
        values = raw if tensor.tensor_type in plain else self._gguf.dequantize(raw, tensor.tensor_type)  # BF16: fp32
        values = self._processor.process(weights=values, name=tensor.name).weights
        out = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        return out.reshape((stop - start, *shape[1:]) if stop - start != shape[0] else shape)

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, each dequantised (float32) or in its stored float dtype."""
        return {name: self._read(name) for name in names}

    def rows(self, name: str, block_bytes: int = _BLOCK_BYTES) -> Iterator[torch.Tensor]:
        """Row blocks of a 2-D tensor (about `block_bytes` of float32 each), read and dequantised one block at a time."""
        shape = self.shape(name)
        step = max(1, block_bytes // max(1, math.prod(shape[1:]) * 4))
        for start in range(0, shape[0], step):
            yield self._read(name, start, start + step)


def meta_model(config, *, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of `config` on the meta device (nothing allocated), in eval mode."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return model.eval()


def listing(names: list[str], shown: int = 6) -> str:
    """ "a, b, c and 4 more": the first `shown` of `names` for a one-line message."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


#: tensors a checkpoint may hold that no model loads (rotary tables that older Transformers versions saved)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_complete(model: nn.Module, reader: CheckpointReader) -> None:
    """`ValueError` in one line, naming the tensors, unless the checkpoint holds exactly the persistent tensors of
    the meta-device `model` its config describes, in their shapes: a missing tensor (of tied tensors one copy
    suffices), a tensor the model does not have (e.g. a config whose `num_hidden_layers` is smaller than the
    weights'), or a tensor of another shape. Without this check a layer-by-layer reader would report on the
    config's model instead of the checkpoint's, or fail deep inside the work."""
    names = checkpoint_names(model, reader)
    tied: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        tied.setdefault(id(tensor), []).append(name)
    state = model.state_dict(keep_vars=True)
    missing = sorted(group[0] for group in tied.values() if not any(name in names for name in group))
    found = set(names.values())
    unexpected = sorted(k for k in reader.keys() if k not in found and not k.endswith(IGNORED_SUFFIXES))
    shapes = sorted(
        f"{ckpt} {list(reader.shape(ckpt))} (config: {list(state[name].shape)})"
        for name, ckpt in names.items()
        if tuple(reader.shape(ckpt)) != tuple(state[name].shape)
    )
    problems = [
        f"{label} ({len(keys)}): {listing(keys)}"
        for label, keys in (("missing tensors", missing), ("unexpected tensors", unexpected), ("other shapes", shapes))
        if keys
    ]
    if problems and renamed_names(model, reader)[1]:  # tensors Transformers splits, fuses or stacks while loading
        raise ValueError(
            f"{reader.path}: Transformers converts some tensors of this checkpoint while loading (e.g. "
            f"{renamed_names(model, reader)[1][0]}): no layer-by-layer reader reads them; load the whole model instead"
        )
    if problems:
        raise ValueError(
            f"{reader.path}: the weights do not match the model its config.json describes; {'; '.join(problems)}. "
            "Was config.json edited (e.g. num_hidden_layers) or a weights file replaced or cut short?"
        )


def open_checkpoint(path: str | os.PathLike, *, trust_remote_code: bool = False, check: bool = True):
    """(reader, config, meta-device model) of a local safetensors checkpoint folder or GGUF file, checked to agree
    (`check_complete`; `check=False`: the caller checks, after its own checks of the model, e.g. that its family is
    supported): the one way the layer-by-layer readers open a checkpoint."""
    from transformers import AutoConfig

    if is_gguf_file(path):
        path = Path(path)
        parsed = read_gguf(path)  # a file the GGUF parser cannot read: OSError naming it, before Transformers parses it
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=trust_remote_code)
        model = meta_model(config, trust_remote_code=trust_remote_code)
        reader = GGUFCheckpointReader(path, model, parsed)
    else:
        reader = CheckpointReader(path)
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as err:
            raise invalid_config_error(err, path) or err from None
        model = meta_model(config, trust_remote_code=trust_remote_code)
    if check:
        check_complete(model, reader)
    return reader, config, model


def checkpoint_names(model: nn.Module, reader: CheckpointReader, prefix: str = "") -> dict[str, str]:
    """state_dict name (under `prefix`) -> checkpoint name, for the model's persistent tensors under `prefix`,
    accepting checkpoints saved without the base-model prefix (e.g. "layers.0..." for "model.layers.0...") and
    the names Transformers renames while loading (`renamed_names`: GPT-NeoX saves its head as "embed_out")."""
    base = getattr(model, "base_model_prefix", "") or ""
    renamed = renamed_names(model, reader)[0]
    out = {}
    module = model.get_submodule(prefix) if prefix else model
    for local in module.state_dict(keep_vars=True):
        full = f"{prefix}.{local}" if prefix else local
        if full in reader:
            out[local] = full
        elif base and full.startswith(base + ".") and full[len(base) + 1 :] in reader:
            out[local] = full[len(base) + 1 :]
        elif full in renamed:
            out[local] = renamed[full]
    return out


@torch.no_grad()
def materialize(
    model: nn.Module,
    reader: CheckpointReader,
    prefix: str,
    *,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    buffers: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Load the tensors of the submodule `prefix` of a meta-device `model` from the checkpoint (assigned, so the
    module holds exactly these tensors; `dtype` casts floating ones) and return the submodule. `release` frees it.
    `buffers` (a dict the caller keeps, empty at first): the casts are written into the tensors it holds from the
    previous call, by local name and shape, instead of new ones (layer after layer of one shape: no new memory for
    the page faults of a fresh allocation); the caller must hold no other reference to them by then."""
    module = model.get_submodule(prefix) if prefix else model
    names = checkpoint_names(model, reader, prefix)
    expected = [k for k, v in module.state_dict(keep_vars=True).items()]
    missing = [k for k in expected if k not in names]
    if missing and strict:
        where = f"{prefix}." if prefix else ""
        raise ValueError(f"{reader.path}: tensor {where}{missing[0]} is missing from the checkpoint")
    tensors = reader.get(names.values())
    state = {}
    for local, name in names.items():
        t = tensors.pop(name)
        if dtype is None or not t.is_floating_point():
            state[local] = t
        elif buffers is None:
            state[local] = t.to(dtype)
        else:
            buffer = buffers.get(local)
            if buffer is None or buffer.shape != t.shape or buffer.dtype != dtype:
                buffer = buffers[local] = torch.empty(t.shape, dtype=dtype)
            state[local] = buffer.copy_(t)
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
        module.register_parameter(attr, nn.Parameter(tensors[name], requires_grad=params[local].requires_grad))


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
        self._scratch: torch.Tensor | None = None  # the block buffer of casts in `add`
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
        nbytes = math.prod(shape) * _element_bytes(dtype)
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

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Write one whole tensor, stored as `dtype` (None: its own). A cast goes through a block buffer the writer
        keeps (`_CAST_BLOCK_BYTES`), so it costs no new memory of the tensor's size."""
        dtype = dtype or tensor.dtype
        self.begin(name, tuple(tensor.shape), dtype)
        if not tensor.numel():
            self._pending = None
        elif dtype == tensor.dtype:
            self.write(tensor)
        else:
            flat = tensor.detach().reshape(-1)
            step = max(1, _CAST_BLOCK_BYTES // max(flat.element_size(), _element_bytes(dtype)))
            for start in range(0, flat.numel(), step):
                part = flat[start : start + step]
                if self._scratch is None or self._scratch.device != part.device:
                    self._scratch = torch.empty(_CAST_BLOCK_BYTES, dtype=torch.uint8, device=part.device)
                block = self._scratch[: part.numel() * _element_bytes(dtype)].view(dtype)
                self.write(block.copy_(part))

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


def gguf_to_safetensors(
    path: str | os.PathLike,
    directory: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Write the GGUF file `path` as a safetensors checkpoint (shards, index, config.json) into the new folder
    `directory`, one tensor dequantised at a time (`GGUFCheckpointReader`), in `dtype` (None: float32 for quantised
    tensors, the stored dtype for the others). A working copy for loaders that need safetensors (Accelerate's disk
    offload); nothing of the file is held whole. Returns `directory`."""
    reader, config, model = open_checkpoint(path)
    directory = Path(directory)
    directory.mkdir(parents=True)
    writer = ShardWriter(directory, parse_size(max_shard_size), 4096 + 200 * len(reader.keys()))
    for name in reader.keys():
        writer.add(name, reader.get([name])[name], dtype)
    writer.finish(sum(p.numel() for p in model.parameters()))
    config.save_pretrained(directory)
    return directory


def _int_bits(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.bool else torch.iinfo(dtype).bits


def _element_bytes(dtype: torch.dtype) -> int:
    return (torch.finfo(dtype).bits if dtype.is_floating_point else _int_bits(dtype)) // 8
