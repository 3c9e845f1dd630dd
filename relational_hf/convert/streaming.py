"""Big checkpoints on one machine: conversion and analysis one decoder layer at a time (DESIGN.md 2.2, 4).

A Llama / Mistral / Qwen2 checkpoint stored as safetensors (one file, or shards listed in
`model.safetensors.index.json`) is never loaded whole. The model is built on the meta device (no memory), and
one layer at a time is materialised in fp32 from the shards with `safetensors.safe_open` (each file opened and
closed per layer, so no mapping of the whole checkpoint stays resident), run on random hidden states (the check's
reference), converted with the same per-layer functions as the in-memory converter (`relational.convert_layer`:
gains folded in place, exactly; QK / VO / SwiGLU moved to the pivot gauge, gauge blocks and products with an inverse
in float64), checked against those outputs, and written to the output shard before the next layer is read. Embedding and head are copied (the head folded with the final gain) in
row blocks. Memory is one layer's working set, independent of depth.

Output names and layout come from the relational model itself: a `RelationalDecoderLayer` is loaded with the
converted weights and its `state_dict()` is written under the layer's prefix in `RelationalForCausalLM`, so the
file holds exactly what `save_pretrained` of the in-memory model would (source dtype kept on disk unless `dtype`
is given). The output is written through `relational_hf.outputs` (staged beside, moved into place when complete): a
failed or interrupted run leaves no folder that looks like a checkpoint.

Streaming analysis (`redundancy_report_from_checkpoint` in `relational_hf.symmetry.report`) uses the same reader
and the meta-device model (`meta_model`, `materialize`), both in `relational_hf.shards`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save
from transformers.initialization import no_init_weights

from ..architectures import get_adapter
from ..modeling import RelationalConfig, RelationalForCausalLM
from ..modeling.modeling_relational import RelationalDecoderLayer, RelationalRotaryEmbedding
from ..outputs import OutputLock, check_new_output, save_tokenizer, write_new_output
from ..shards import (
    ShardWriter,
    check_complete,
    checkpoint_names,
    drop_caches,
    is_safetensors_checkpoint,
    materialize,
    materialize_small,
    open_checkpoint,
    parse_dtype,
    parse_size,
    release,
    trim_heap,
)
from .families import fixed_groups
from .gemma import GEMMA_NOTE, is_gemma_config, is_gemma_family, norm_gain
from .layernorm import (
    LAYERNORM_NOTE,
    centred,
    centred_rows,
    is_layernorm_family,
    norm_parameters,
    remaining_after_folding,
    untied_final_bias,
)
from .layernorm_stream import LayerNormEnds
from .preflight import layer_pivot_obstructions, raise_obstructions
from .relational import (
    ConversionError,
    ConversionReport,
    PhaseTimes,
    _check_supported,
    _sliding_window,
    convert_layer,
    fold_head,
    relational_config_for,
    relative_difference,
    source_layer_tensors,
)

logger = logging.getLogger(__name__)


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
    rotary = getattr(get_adapter(model).base_model(), "rotary_emb", None)  # None: no rotary positions (GPT-2)
    return None if rotary is None else type(rotary)(config=model.config)


def _layer_rotary(rotary, config, index: int):
    """The rotary embedding layer `index` reads, as a function of (hidden, positions): Gemma 3's takes the layer's type
    (one table per type: `rope_type` is a dict by type); a relational model with `sliding_rope_parameters` has one for
    its sliding layers (`rotary` is then the pair (full, sliding))."""
    if isinstance(rotary, tuple):
        full, sliding = rotary
        return sliding if sliding is not None and config.layer_sliding(index) else full
    if rotary is not None and isinstance(getattr(rotary, "rope_type", None), dict):
        kind = config.layer_types[index]
        return lambda hidden, positions: rotary(hidden, positions, kind)
    return rotary


@torch.no_grad()
def _layer_outputs(layer: nn.Module, hidden: torch.Tensor, rotary) -> torch.Tensor:
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    embeddings = None if rotary is None else rotary(hidden, positions)
    out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=embeddings)
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
    lock: OutputLock | None = None,
    times: PhaseTimes | None = None,
) -> ConversionReport:
    """Convert the safetensors checkpoint folder `src` (Llama / Mistral / Qwen2) to a relational checkpoint `out`
    one decoder layer at a time; returns the ConversionReport (also written to out/conversion_report.json).

    Per layer: its tensors read from the shards in fp32, `convert_layer` (the in-memory converter's per-layer maths,
    consuming them), and, for the layers chosen by `verify_layers` (None: all; n: n evenly spaced; 0: none), the
    source layer (run before its weights are folded) and the converted layer on the same random hidden states
    (1 x `verify_length` x d, fp32): max |difference| must be
    <= `tolerance` x max(1, max |output|), else `ConversionError`. The layer's `state_dict()` is written in
    `dtype` (None: the source's dtype on disk). Embedding and head are copied in row blocks (head x final gain when
    untied). Shards of at most `max_shard_size` bytes ("5GB"), named and indexed like `save_pretrained`; config,
    generation config, the code files for trust_remote_code and the tokenizer (`copy_tokenizer`) are written
    beside. Everything is written through `relational_hf.outputs.write_new_output` (`lock`: the caller's lock on
    `out`): `out` must not exist or be empty (`UsageError` otherwise), and a failure leaves `out` untouched.

    `times` (a `PhaseTimes`, optional) receives where the wall time went, in seconds: "open" (reading the config,
    the index and the small tensors, the checks of the model), "read" (each layer's tensors from the shards, in fp32),
    "preflight" (does the pivot gauge exist), "fold", "gauge_attention", "gauge_mlp" (`convert_layer`),
    "check_forward" (the per-layer check: both layers run on the same hidden states), "write" (each layer's tensors cast and written),
    "embedding_head" (copied in row blocks), "finish" (closing the shards, the report, config and tokenizer) and
    "publish" (fsync of the staged folder, its marker and the rename into place)."""
    from tqdm.auto import tqdm

    times = times if times is not None else PhaseTimes()
    opened = time.perf_counter()

    src, out = Path(src), Path(out)
    out_dtype = parse_dtype(dtype)
    max_shard_bytes = parse_size(max_shard_size)
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0 (relative to the output scale), got {tolerance}")
    if verify_length < 1:
        raise ValueError(f"verify_length must be >= 1, got {verify_length}")
    if not is_safetensors_checkpoint(src):
        raise FileNotFoundError(f"{src}: not a local checkpoint folder with config.json and safetensors weights")
    check_new_output(out, "OUT", source=src)
    reader, config, source = open_checkpoint(src, trust_remote_code=trust_remote_code, check=False)
    _check_supported(source)
    check_complete(source, reader)
    materialize_small(source, reader)
    dimensions = _group_dimensions(source)
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

    layernorm = is_layernorm_family(source)  # checked on mean-free hidden states, outputs compared centred
    notes = [LAYERNORM_NOTE] if layernorm else [GEMMA_NOTE] if is_gemma_family(source) else []
    window = None if is_gemma_family(source) else _sliding_window(config)  # Gemma 3's windows are held
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

    written: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    results: dict = {"worst": (0.0, 1.0, 0.0)}
    start = time.perf_counter()
    times["open"] = times.get("open", 0.0) + start - opened

    def write(stage: Path) -> None:
        writer = ShardWriter(stage, max_shard_bytes, header_reserve)

        def emit(name: str, tensor: torch.Tensor) -> None:
            dtype = write_dtype if tensor.is_floating_point() else tensor.dtype
            writer.add(name, tensor, dtype)  # cast block by block while written
            written[name] = (tuple(tensor.shape), expected.get(name, (None, dtype))[1])

        def emit_rows(name: str, key: str, fold_gain: torch.Tensor | None = None, centre: bool = False) -> None:
            shape = reader.shape(key)
            writer.begin(name, shape, write_dtype)
            for block in reader.rows(key):
                if centre:  # a LayerNorm family's untied embedding, made mean-free
                    writer.write(centred_rows(block, write_dtype))
                else:
                    writer.write(
                        block.to(write_dtype) if fold_gain is None else fold_head(block, fold_gain, write_dtype)
                    )
            written[name] = (shape, expected.get(name, (None, None))[1])

        dst_modules = {id(m): n for n, m in target.named_modules()}
        with times("embedding_head"):
            emit_rows(dst_modules[id(dst_adapter.embedding())] + ".weight", embed_key, centre=layernorm and not tie)
            for slot in adapter.embedding_slots()[1:] if layernorm else ():  # learned positions (GPT-2's wpe)
                emit_rows("model.embed_positions.weight", embed_name[src_names[id(slot.param)]], centre=not tie)
        layers: dict[bool, nn.Module] = {}  # one target layer per structure (with or without rotary), reused
        generator = torch.Generator().manual_seed(0)
        buffers: dict[str, torch.Tensor] = {}  # the fp32 source tensors, reused layer after layer
        src_rotary = _rotary(source) if verify else None
        local = rconfig.sliding_rope_parameters
        dst_rotary = None
        if verify:  # (full, sliding) tables: Gemma 3's sliding layers have their own rotary base
            dst_rotary = (RelationalRotaryEmbedding(rconfig), local and RelationalRotaryEmbedding(rconfig, local))
        for i in tqdm(range(len(src_layers)), desc="convert layers", disable=not progress):
            with times("read"):  # in fp32 once (into the previous layer's tensors): the check's source, then the input
                block = materialize(source, reader, src_prefixes[i], dtype=torch.float32, buffers=buffers)
            with times("preflight"):
                raise_obstructions(layer_pivot_obstructions(source, i, src_layers[i]))  # a zeroed head, named
            if i in verify:  # the source layer's outputs first: its weights are then folded in place
                with times("check_forward"):
                    hidden = torch.randn(1, length, rconfig.hidden_size, generator=generator)
                    hidden = centred(hidden) if layernorm else hidden
                    reference = _layer_outputs(block, hidden, _layer_rotary(src_rotary, config, i))
                    reference = centred(reference) if layernorm else reference
            tensors = source_layer_tensors(adapter, src_layers[i])
            release(block)  # `tensors` holds the only references: convert_layer consumes them as it goes
            if rconfig.layer_rope(i) not in layers:
                with no_init_weights():
                    layers[rconfig.layer_rope(i)] = RelationalDecoderLayer(rconfig, i).float().eval()
            layer = layers[rconfig.layer_rope(i)]
            convert_layer(layer, tensors, times, consume=True)
            if i in verify:
                with times("check_forward"):
                    converted = _layer_outputs(layer, hidden, _layer_rotary(dst_rotary, rconfig, i))
                    result = relative_difference(reference, converted)
                results["worst"] = max(results["worst"], result, key=lambda r: r[2])
                if not result[2] <= tolerance:
                    raise ConversionError(
                        f"layer {i}: converted layer's outputs differ from the source layer's by {result[0]:.3g} = "
                        f"{result[2]:.3g} x the output scale {result[1]:.3g} > tolerance {tolerance:g}"
                    )
            drop_caches(layer)
            with times("write"):
                for key, tensor in layer.state_dict().items():
                    emit(f"{dst_prefixes[i]}.{key}", tensor)
            trim_heap()
        del layer, layers
        with times("embedding_head"):
            final_key = embed_name[src_names[id(adapter.final_norm().weight)]]
            g_final = norm_gain(adapter, adapter.final_norm(), reader.get([final_key])[final_key])  # Gemma: 1 + w
            if layernorm:  # the final LayerNorm's gain and bias kept (tied head), or gain folded and bias / gain
                bias_key = embed_name[src_names[id(adapter.final_norm().bias)]]
                beta = reader.get([bias_key])[bias_key]
                emit("model.norm.bias", beta if tie else untied_final_bias(g_final, beta))
                if tie:
                    emit("model.norm.weight", g_final)
                else:
                    head_key = embed_name[src_names[id(adapter.output_head().weight)]]
                    emit_rows("lm_head.weight", head_key, fold_gain=g_final)
            elif tie:
                emit(dst_modules[id(dst_adapter.final_norm())] + ".weight", g_final)
            else:
                head_key = embed_name[src_names[id(adapter.output_head().weight)]]
                emit_rows(dst_modules[id(dst_adapter.output_head())] + ".weight", head_key, fold_gain=g_final)
        finish = time.perf_counter()
        # every parameter written once with its shape (buffers: whatever the layer's own state_dict holds)
        params = {n: tuple(p.shape) for n, p in target.named_parameters()}
        mismatch = sorted(k for k, shape in params.items() if written.get(k, (None,))[0] != shape)
        if mismatch:
            raise ConversionError(
                f"streamed tensors do not match RelationalForCausalLM's parameters (e.g. {mismatch[0]!r})"
            )
        writer.finish(sum(p.numel() for p in target.parameters()))
        report = _report(source, target, tie, results["worst"], length, tolerance, notes, dimensions)
        _write_metadata(target, rconfig, write_dtype, stage)
        if copy_tokenizer:
            _copy_tokenizer(src, stage, trust_remote_code)
        (stage / "conversion_report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
        results["report"] = report
        results["written"] = time.perf_counter()
        times["finish"] = times.get("finish", 0.0) + results["written"] - finish

    write_new_output(out, write, command="convert", kind="relational", lock=lock)
    times["publish"] = times.get("publish", 0.0) + time.perf_counter() - results["written"]
    report, worst = results["report"], results["worst"]
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

    reader, config, model = open_checkpoint(path, trust_remote_code=trust_remote_code)
    if is_gemma_config(config):  # its embedding scale and sliding-window layers are not applied here
        raise ValueError(f"layerwise_logits: {path}: Gemma 3 and its conversion are not computed layer by layer yet")
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


class LlamaCheckpointLayers:
    """`compress.streamed.LayerSource` of a Llama / Mistral / Qwen2 (or GPT-2 / GPT-NeoX: the ends as
    `layernorm_stream.LayerNormEnds` holds them; or Gemma 3) safetensors checkpoint or GGUF file (each tensor
    dequantised as it is read, `shards.GGUFCheckpointReader`): each decoder layer read in fp32 and converted to the relational pivot gauge when it is asked for (`convert_layer`, the exact conversion
    of `stream_to_relational`), the embedding, final gain and head as `stream_to_relational` writes them (an untied
    head with the final gain folded in; Gemma's gain as 1 + w, `gemma.norm_gain`, its embedding scale applied by
    `compress.streamed.relational_embed` from the relational config). Nothing is converted ahead: a layer-streamed
    compression of a Llama checkpoint needs no relational copy on disk."""

    def __init__(self, path: str | os.PathLike, *, pivot_scale: float | None = None, trust_remote_code: bool = False):
        from ..params import stored_parameters

        reader, config, source = open_checkpoint(path, trust_remote_code=trust_remote_code, check=False)
        _check_supported(source)
        check_complete(source, reader)
        self.stored_parameters = stored_parameters(source)["total"]
        materialize_small(source, reader)
        self._reader, self._source = reader, source
        self._adapter = get_adapter(source)
        self._tied = self._adapter.head_tied()
        self.config = relational_config_for(source, tie=self._tied, pivot_scale=pivot_scale)
        names = checkpoint_names(source, reader)
        params = {id(p): n for n, p in source.named_parameters()}
        self._embed_key = names[params[id(self._adapter.embedding().weight)]]
        self._head_key = None if self._tied else names[params[id(self._adapter.output_head().weight)]]
        self._final_gain = norm_gain(self._adapter, self._adapter.final_norm())
        self.storage_dtype = reader.dtype(self._embed_key)
        self._layers = self._adapter.layers()
        self._prefixes = _layer_prefixes(source, [lr.block for lr in self._layers])
        self._ends = LayerNormEnds(source, reader, self.config) if is_layernorm_family(source) else None

    def layer(self, index: int, device=None) -> nn.Module:
        block = materialize(self._source, self._reader, self._prefixes[index], dtype=torch.float32)
        raise_obstructions(layer_pivot_obstructions(self._source, index, self._layers[index]))
        tensors = source_layer_tensors(self._adapter, self._layers[index])
        release(block)
        with no_init_weights():
            layer = RelationalDecoderLayer(self.config, index)
        convert_layer(layer, tensors, consume=True)
        drop_caches(layer)
        return layer.float().eval().to(device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        from ..compress.streamed import relational_embed

        if self._ends is not None:  # GPT-2 / GPT-NeoX: positions, centring (`layernorm_stream`)
            return self._ends.embed(ids)
        rows = self._reader.get([self._embed_key])[self._embed_key][ids]
        return relational_embed(self.config, rows, None)  # Gemma 3: times its embedding scale

    def _head_weight(self) -> torch.Tensor:
        if self._tied:
            return self._reader.get([self._embed_key])[self._embed_key]
        return fold_head(self._reader.get([self._head_key])[self._head_key], self._final_gain)

    def head(self, device=None):
        from ..compress.streamed import relational_head

        if self._ends is not None:
            return self._ends.head(device)
        gain = self._final_gain if self._tied else None
        return relational_head(gain, self._head_weight(), self.config.rms_norm_eps)

    def static_tensors(self):
        if self._ends is not None:
            yield from self._ends.static_tensors()
            return
        yield "model.embed_tokens.weight", self._reader.shape(self._embed_key), self._reader.rows(self._embed_key)
        if self._tied:
            yield "model.norm.weight", tuple(self._final_gain.shape), iter([self._final_gain])
        else:
            blocks = (fold_head(b, self._final_gain) for b in self._reader.rows(self._head_key))
            yield "lm_head.weight", self._reader.shape(self._head_key), blocks


def _group_dimensions(source) -> tuple[dict[str, int], dict[str, int]]:
    """(removed, remaining) orbit dimensions by group, counted while the source's small tensors (norm gains, QK-norm
    gains, biases) are loaded: the layers release theirs as they are converted."""
    from ..symmetry.groups import symmetry_groups

    groups, _ = symmetry_groups(source)
    removed: dict[str, int] = {}
    remaining: dict[str, int] = {}
    fixed = fixed_groups(source)
    for g in groups:
        bucket = removed if g.name in fixed else remaining
        bucket[g.name] = bucket.get(g.name, 0) + g.dimension()
    return removed, remaining_after_folding(source, remaining)  # no gain, bias or centring left in the norms


def _report(source, target, tie, worst, length, tolerance, notes, dimensions) -> ConversionReport:
    removed, remaining = dimensions
    gains, kept = norm_parameters(source, tie)
    report = ConversionReport(
        source_class=type(source).__name__,
        source_parameters=sum(p.numel() for p in source.parameters()),
        source_norm_gain_parameters=gains,
        removed_orbit_dimensions=removed,
        relational_parameters=sum(p.numel() for p in target.parameters()),
        max_logit_difference=worst[0],
        verified_sequence_length=length,
        kept_final_gain=kept,
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

    from ..loading import usable_tokenizer
    from ..shards import is_gguf_file

    where = (
        {"pretrained_model_name_or_path": src.parent, "gguf_file": src.name}
        if is_gguf_file(src)
        else {"pretrained_model_name_or_path": src}
    )
    try:
        tokenizer = usable_tokenizer(AutoTokenizer.from_pretrained(**where, trust_remote_code=trust_remote_code), src)
    except (OSError, ValueError, TypeError):
        logger.info("no tokenizer at %s; the converted checkpoint has none", src)
        return
    save_tokenizer(tokenizer, directory)


__all__ = ["LlamaCheckpointLayers", "layerwise_logits", "stream_to_relational"]
