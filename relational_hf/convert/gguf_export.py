"""Relational checkpoints -> one GGUF file for llama.cpp (`relational-hf export SRC OUT.gguf --to gguf`).

`export_gguf(source, out)` writes the layout of `relational_hf.convert.gguf_layout` (architecture `llama`, or `deci`
for per-layer SwiGLU widths, `qwen3` for a per-head QK-norm, `smollm3` for every 4th layer without rotary, `gemma3`
for a Gemma 3 conversion with its sandwich norms and sliding-window metadata (`relational_hf.convert.gguf_families`);
heads padded exactly to one width; rows interleaved where llama.cpp's rope pairs adjacent coordinates; unit weights
for the gain-free norms; a tied head kept tied) and the tokenizer as vocabulary metadata
(`relational_hf.convert.gguf_vocab`), one tensor at a time: a safetensors checkpoint folder is read a decoder layer
at a time (`relational_hf.compress.streamed.RelationalCheckpointLayers`), so memory holds one layer and the
embedding, never the model. Everything that can be refused is refused before the file is opened (`GGUFExportError`,
one line). The file is written as a temporary sibling, fsynced and renamed over OUT (the rule of
`relational_hf.outputs`): a reader, or a crash, never sees half a GGUF file.

Types (`--outtype`): f32, f16 (default), bf16 (weight matrices; norms and biases stay f32, as llama.cpp's own
converter keeps them), q8_0 (matrices whose rows are a multiple of 32 long; the others, e.g. a compressed layer's
SwiGLU down map of width 75, are written f16 and named in the report).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .gguf_families import gemma3_metadata
from .gguf_layout import GGUFExportError, GGUFLayout, gguf_layout, layer_tensors, tensor_shapes
from .gguf_vocab import gguf_vocabulary

logger = logging.getLogger(__name__)

GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
#: row lengths llama.cpp's Q8_0 blocks take
Q8_0_BLOCK = 32


@dataclass
class GGUFExportReport:
    """What `export_gguf` wrote: architecture, type, head width D, the zeros the fixed head width added, tensors
    whose type fell back to f16, the file's size."""

    target: str
    arch: str
    outtype: str
    path: str
    file_bytes: int
    tensors: int
    head_dim: int
    feed_forward: list[int]
    padding_zeros: int
    tied_head: bool
    tokenizer: str
    fallback_f16: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        widths = sorted(set(self.feed_forward))
        ff = f"SwiGLU width {widths[0]}" if len(widths) == 1 else f"per-layer SwiGLU widths {self.feed_forward}"
        lines = [
            f"## Export to GGUF (`{self.arch}`, {self.outtype})",
            "",
            f"- {self.tensors} tensors, {self.file_bytes / 2**20:.1f} MiB; head width {self.head_dim}, {ff}"
            + (f"; {self.padding_zeros:,} zeros of head padding" if self.padding_zeros else ""),
            f"- head {'tied to the embedding (no output tensor)' if self.tied_head else 'untied (output tensor)'}; "
            f"tokenizer: {self.tokenizer}",
        ]
        if self.fallback_f16:
            lines.append(
                f"- {len(self.fallback_f16)} tensor(s) written f16: rows not a multiple of {Q8_0_BLOCK} long "
                f"(e.g. {self.fallback_f16[0]})"
            )
        lines += [f"- note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


class _ModelLayers:
    """Layers and static tensors of a relational model in memory (a source that is not a local safetensors folder)."""

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config

    def layer(self, index: int):
        return self.model.model.layers[index]

    def tensor(self, name: str) -> torch.Tensor | None:
        if name == "model.embed_tokens.weight":
            return self.model.model.embed_tokens.weight.detach()
        if name == "model.norm.weight":
            w = self.model.model.norm.weight
            return None if w is None else w.detach()
        return self.model.lm_head.weight.detach()


class _CheckpointLayers:
    """The same from a relational safetensors folder, a decoder layer at a time."""

    def __init__(self, path: str | os.PathLike, trust_remote_code: bool) -> None:
        from ..compress.streamed import RelationalCheckpointLayers

        self.source = RelationalCheckpointLayers(path, trust_remote_code=trust_remote_code)
        self.config = self.source.config

    def layer(self, index: int):
        return self.source.layer(index)

    def tensor(self, name: str) -> torch.Tensor | None:
        reader = self.source.reader
        return reader.get([name])[name] if name in reader else None


def require_gguf():
    """The `gguf` package, or `GGUFExportError` in one line saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise GGUFExportError(
            "GGUF export needs the gguf package: pip install 'relational-hf[real]' (or gguf)"
        ) from None
    return gguf


def tensor_type(shape: tuple[int, ...], outtype: str):
    """The GGML type a tensor of `shape` is written in for `outtype` (1-D tensors stay f32)."""
    from gguf import GGMLQuantizationType as T

    if len(shape) == 1 or outtype == "f32":
        return T.F32
    if outtype == "f16":
        return T.F16
    if outtype == "bf16":
        return T.BF16
    return T.Q8_0 if shape[-1] % Q8_0_BLOCK == 0 else T.F16


def encode_tensor(tensor: torch.Tensor, qtype) -> np.ndarray:
    """`tensor` as the array GGUF stores for `qtype` (f32 / f16 values, or the bytes of bf16 / q8_0 blocks)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    data = tensor.detach().to(torch.float32).cpu().contiguous().numpy()
    if qtype == T.F32:
        return data
    if qtype == T.F16:
        return data.astype(np.float16)
    return quantize(data, qtype)


def _tensor_info(writer, name: str, shape: tuple[int, ...], qtype) -> None:
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    if qtype in (T.F32, T.F16):
        dtype = np.float32 if qtype == T.F32 else np.float16
        writer.add_tensor_info(name, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
        return
    block, size = GGML_QUANT_SIZES[qtype]
    byte_shape = (*shape[:-1], shape[-1] // block * size)
    writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)


def _metadata(writer, layout: GGUFLayout, outtype: str, name: str, any_quantized: bool) -> None:
    from gguf import GGML_QUANT_VERSION, LlamaFileType

    file_type = {
        "f32": LlamaFileType.ALL_F32,
        "f16": LlamaFileType.MOSTLY_F16,
        "bf16": LlamaFileType.MOSTLY_BF16,
        "q8_0": LlamaFileType.MOSTLY_Q8_0,
    }[outtype]
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    if any_quantized:
        writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_vocab_size(layout.vocab_size)
    writer.add_context_length(layout.context_length)
    writer.add_embedding_length(layout.hidden_size)
    writer.add_block_count(layout.num_layers)
    if layout.arch == "deci":  # per-layer arrays; qwen3, smollm3 and gemma3 take one SwiGLU width (`gguf_families`)
        writer.add_feed_forward_length(list(layout.feed_forward))
        writer.add_head_count(layout.num_heads)
        writer.add_head_count_kv([layout.num_kv_heads] * layout.num_layers)
    else:
        writer.add_feed_forward_length(layout.feed_forward[0])
        writer.add_head_count(layout.num_heads)
        writer.add_head_count_kv(layout.num_kv_heads)
    writer.add_key_length(layout.head_dim)
    writer.add_value_length(layout.head_dim)
    writer.add_rope_dimension_count(layout.head_dim)
    writer.add_rope_freq_base(layout.rope_theta)
    writer.add_layer_norm_rms_eps(layout.rms_norm_eps)
    if layout.gemma3 is not None:
        gemma3_metadata(writer, layout.gemma3)


def _tensors(source, layout: GGUFLayout):
    """(name, float32 tensor) of every GGUF tensor in `tensor_shapes` order, one decoder layer alive at a time."""
    from ..shards import release, trim_heap

    config = source.config
    yield "token_embd.weight", source.tensor("model.embed_tokens.weight")
    for i in range(layout.num_layers):
        layer = source.layer(i)
        yield from layer_tensors(layer, i, layout, config.qk_rank).items()
        if isinstance(source, _CheckpointLayers):
            release(layer)
            trim_heap()
    gain = source.tensor("model.norm.weight")
    yield "output_norm.weight", torch.ones(layout.hidden_size) if gain is None else gain
    if not layout.tied:
        yield "output.weight", source.tensor("lm_head.weight")


def _open_source(source, trust_remote_code: bool):
    """A layer source: a relational model in memory, or a local relational safetensors folder (streamed)."""
    from torch import nn

    if isinstance(source, nn.Module):
        return _ModelLayers(source)
    return _CheckpointLayers(source, trust_remote_code)


def export_gguf(
    source,
    out: str | os.PathLike,
    *,
    outtype: str = "f16",
    tokenizer=None,
    config=None,
    name: str | None = None,
    trust_remote_code: bool = False,
    on_tensor: Callable[[str], None] | None = None,
    pad_mlp: bool = False,
) -> GGUFExportReport:
    """Write the relational model `source` (a `RelationalForCausalLM`, or a local relational safetensors folder,
    read a layer at a time) as the GGUF file `out` of type `outtype` (`GGUF_OUTTYPES`), with `tokenizer` (a
    Transformers fast tokenizer, or None: the file then holds no vocabulary, `tokenizer.ggml.model = none`).
    `config`: the source's config when the caller has read it (checked before the folder is opened). Refusals
    (`GGUFExportError`, one line) come before OUT is touched; OUT is replaced atomically. `pad_mlp`: per-layer
    SwiGLU widths in `qwen3` / `smollm3` / `gemma3` written at the widest layer's, padded with zero units
    (`gguf_layout.gguf_layout`; refused without it)."""
    gguf = require_gguf()

    from ..errors import UsageError
    from ..outputs.files import TAG, fsync_dir, publish_file, reporting_disk_full
    from ..outputs.paths import file_target

    if outtype not in GGUF_OUTTYPES:
        raise GGUFExportError(f"--outtype must be one of {', '.join(GGUF_OUTTYPES)}, got {outtype!r}")
    if config is None and not isinstance(source, (str, os.PathLike)):
        config = source.config
    if config is not None:
        gguf_layout(config, pad_mlp)  # refusals before anything is opened
    target = file_target(out, "OUT")
    if target.is_stream:
        raise UsageError(f"OUT {out}: a GGUF file is written to a file path, not to a stream (nothing was written)")
    layers = _open_source(source, trust_remote_code)
    layout = gguf_layout(layers.config, pad_mlp)
    vocabulary = None if tokenizer is None else gguf_vocabulary(tokenizer, layout.vocab_size)
    shapes = tensor_shapes(layout)
    types = {n: tensor_type(s, outtype) for n, s in shapes}
    F32, F16, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0
    fallback = [n for n, s in shapes if outtype == "q8_0" and len(s) > 1 and types[n] != Q8_0]
    path = target.path
    tmp = path.with_name(f".{path.name}.{TAG}-tmp-{secrets.token_hex(4)}")
    kept = f"{path.name} was not changed" if path.exists() else f"{path.name} was not written"
    written = 0
    try:
        with reporting_disk_full(path, kept):
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = gguf.GGUFWriter(tmp, layout.arch)
            _metadata(writer, layout, outtype, name or path.stem, any(t not in (F32, F16) for t in types.values()))
            if vocabulary is not None:
                vocabulary.write(writer)
            else:
                writer.add_tokenizer_model("none")
            for n, s in shapes:
                _tensor_info(writer, n, s, types[n])
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            expected = dict(shapes)
            for n, tensor in _tensors(layers, layout):
                if tuple(tensor.shape) != expected[n]:
                    raise GGUFExportError(f"{n}: shape {tuple(tensor.shape)}, the layout says {expected[n]}")
                writer.write_tensor_data(encode_tensor(tensor, types[n]))
                written += 1
                if on_tensor is not None:
                    on_tensor(n)
            writer.flush()
            for handle in writer.fout or []:
                os.fsync(handle.fileno())
            writer.close()
        publish_file(tmp, path)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()
    fsync_dir(path.parent)
    if written != len(shapes):
        raise GGUFExportError(f"wrote {written} of {len(shapes)} tensors")
    report = GGUFExportReport(
        target="gguf",
        arch=layout.arch,
        outtype=outtype,
        path=str(path),
        file_bytes=path.stat().st_size,
        tensors=len(shapes),
        head_dim=layout.head_dim,
        feed_forward=list(layout.feed_forward),
        padding_zeros=layout.padding_zeros,
        tied_head=layout.tied,
        tokenizer="none" if vocabulary is None else f"gpt2 BPE, pre {vocabulary.pre}, {len(vocabulary.tokens)} tokens",
        fallback_f16=fallback,
    )
    if vocabulary is not None:
        report.notes += vocabulary.notes
    if vocabulary is None:
        report.notes.append("no tokenizer: llama.cpp takes token ids only (tokenizer.ggml.model = none)")
    config = layers.config
    if config.qk_rank < layout.head_dim or any(r < layout.head_dim for r in layout.qk_ranks):
        report.notes.append(
            f"QK widths {sorted(set(layout.qk_ranks))} below the head width {layout.head_dim}: query/key heads padded "
            "with zero rows by rotary pair, W_Q scaled to llama.cpp's 1/sqrt(head width)"
        )
    if layout.mlp_padding:
        padded = sum(1 for units in layout.mlp_padding if units)
        report.notes.append(
            f"{padded} layer(s) padded with {sum(layout.mlp_padding):,} zero SwiGLU units to the width "
            f"{layout.feed_forward[0]} (llama.cpp's {layout.arch} holds one width): exact, "
            f"{3 * layout.hidden_size * sum(layout.mlp_padding):,} entries stored again"
        )
    logger.info("wrote %s (%s, %s, %d tensors)", path, layout.arch, outtype, len(shapes))
    return report


__all__ = ["GGUF_OUTTYPES", "GGUFExportReport", "encode_tensor", "export_gguf", "require_gguf", "tensor_type"]
