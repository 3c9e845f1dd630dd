"""Compression of checkpoints larger than memory: `compress_relational` one decoder layer in memory at a time.

The mathematics is `compress.lowrank`'s, per layer (`layer_error_curves` for pass 1, `compress_layer` for pass 2,
`plan` between them) and `compress.sensitivity`'s for the Fisher directions, which a layer-streamed run gets by a
forward sweep that keeps each layer's input hidden states of the `plan_windows` planning windows (in temporary files,
so memory does not grow with depth), the gradients of
the sampled label sets at the head (`head_label_gradients`), and a backward sweep (`layer_fisher_step`) that measures
each layer's error curves as soon as its directions are known. So a layer is read three times (forward, backward,
compression) with sensitivity "fisher", twice otherwise.

Where the layers come from is a `LayerSource`: `RelationalCheckpointLayers` reads a relational safetensors
checkpoint; `relational_hf.convert.streaming.LlamaCheckpointLayers` converts each layer of a Llama-family checkpoint
on the fly (the exact conversion of `convert`), and of a GPT-2 / GPT-NeoX one (its embedding, position table, final
LayerNorm and head as the conversion writes them: `convert.layernorm_stream`) or a Gemma 3 one (its final 1 + w gain
in front of the tied head, as `convert` stores it). Learned positions, the input centring and Gemma's embedding scale
enter through `relational_embed`, the final norm's bias through `relational_head`, the plain MLP, the parallel
residual and the sandwich norms through the shared per-layer functions, and each layer runs with its own rotary table
and mask (`layer_inputs.layer_positions`: Gemma's sliding-window layers), as in memory. The compressed layers go to a
`shards.ShardWriter` as they are made.

Memory: one dense and one compressed layer (fp32), the embedding or the head while they are used (fp32), the hidden
states of the calibration windows (N x T x d fp32, twice with correction="dense"), in pass 1 with "fisher" the
gradients of the label sets (fisher_samples x plan_windows x T x d; the hidden states at each layer's input wait on
disk, L x plan_windows x T x d fp32), and the MLP statistics of one layer (d_ff x d_ff float64).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers.initialization import no_init_weights

from ..modeling import RelationalConfig, RelationalForCausalLM
from ..modeling.modeling_blocks import embed_input
from ..modeling.modeling_relational import RelationalDecoderLayer, RelationalRMSNorm
from ..params import stored_parameters
from ..shards import ShardWriter, open_checkpoint, trim_heap
from .budget import KINDS, WidthOption, check_budget, fixed_parameters, in_gauge
from .layer_inputs import layer_positions
from .lowrank import ErrorCurves, _batches, compress_layer, compressed_config, layer_error_curves, plan
from .options import LowRankOptions, LowRankResult
from .options import _check as check_options
from .sensitivity import head_label_gradients, layer_fisher_step

logger = logging.getLogger(__name__)

Head = Callable[[torch.Tensor], torch.Tensor]


class LayerSource(Protocol):
    """A relational causal LM read one piece at a time (the dense model a streamed compression starts from)."""

    config: RelationalConfig  # the relational form (full widths)
    stored_parameters: int  # stored parameters of the source checkpoint (what `remove` is a share of)
    storage_dtype: torch.dtype  # the floating dtype of the source on disk

    def layer(self, index: int, device: torch.device | str | None = None) -> nn.Module:
        """Decoder layer `index` as a `RelationalDecoderLayer` in fp32, eval mode, on `device`."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings (N, T, d) fp32 of token ids (N, T)."""

    def head(self, device: torch.device | str | None = None) -> Head:
        """The final norm and output head: hidden states (B, T, d) -> logits (B, T, V), fp32."""

    def static_tensors(self) -> Iterator[tuple[str, tuple[int, ...], Iterator[torch.Tensor]]]:
        """(name, shape, row blocks) of every tensor outside the decoder layers, in the relational model's names."""


def relational_head(
    norm_weight: torch.Tensor | None, head_weight: torch.Tensor, eps: float, norm_bias: torch.Tensor | None = None
) -> Head:
    """The top of a relational model as a function: gain-free RMS norm (times `norm_weight`, the final gain a tied
    head keeps; plus `norm_bias`, the final LayerNorm's bias a converted GPT-2 / GPT-NeoX keeps) and the output head
    `head_weight` (V, d), in fp32."""
    norm = RelationalRMSNorm(eps)
    if norm_weight is not None:
        norm.weight = nn.Parameter(norm_weight.float(), requires_grad=False)
    if norm_bias is not None:
        norm.bias = nn.Parameter(norm_bias.float(), requires_grad=False)
    weight = head_weight.float()
    return lambda x: F.linear(norm.to(x.device)(x), weight.to(x.device))


def relational_embed(config: RelationalConfig, rows: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """The stream's first state (N, T, d) fp32 of windows starting at position 0, from their token embedding rows
    (N, T, d) as the relational model stores them and its learned position table (P, d; None without one): what the
    model's forward computes (`modeling_blocks.embed_input`: scaled by `embedding_scale`, positions added, the input
    centred with `embedding_centring`)."""
    positions = None if table is None else nn.Embedding.from_pretrained(table[: rows.shape[1]].float())
    return embed_input(config, rows.float(), positions, torch.arange(rows.shape[1])[None])


class RelationalCheckpointLayers:
    """`LayerSource` of a relational safetensors checkpoint folder (one file or shards)."""

    def __init__(self, path: str | Path, *, trust_remote_code: bool = False) -> None:
        self.reader, config, model = open_checkpoint(path, trust_remote_code=trust_remote_code)
        if not isinstance(model, RelationalForCausalLM):
            raise ValueError(f"{path}: not a relational checkpoint ({type(model).__name__})")
        self.config: RelationalConfig = config
        self.stored_parameters = stored_parameters(model)["total"]
        self.storage_dtype = self.reader.dtype("model.embed_tokens.weight")
        self._tied = config.tie_word_embeddings

    def layer(self, index: int, device=None) -> nn.Module:
        prefix = f"model.layers.{index}."
        with no_init_weights():
            layer = RelationalDecoderLayer(self.config, index)
        names = [prefix + k for k in layer.state_dict()]
        tensors = self.reader.get(names)
        layer.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items()}, strict=True)
        return layer.float().eval().to(device)

    def _optional(self, name: str) -> torch.Tensor | None:
        return self.reader.get([name])[name] if name in self.reader else None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.reader.get(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
        return relational_embed(self.config, weight[ids], self._optional("model.embed_positions.weight"))

    def head(self, device=None) -> Head:
        name = "model.embed_tokens.weight" if self._tied else "lm_head.weight"
        weight, eps = self.reader.get([name])[name], self.config.rms_norm_eps
        return relational_head(self._optional("model.norm.weight"), weight, eps, self._optional("model.norm.bias"))

    def static_tensors(self):
        names = ["model.embed_tokens.weight", "model.embed_positions.weight", "model.norm.weight", "model.norm.bias"]
        names += [] if self._tied else ["lm_head.weight"]
        for name in names:
            if name in self.reader:
                yield name, self.reader.shape(name), self.reader.rows(name)


def _check(source: LayerSource, calibration: torch.Tensor, opts: LowRankOptions) -> None:
    if opts.fisher_metric:
        raise ValueError("`fisher_metric` is not available layer by layer (it keeps a d x d metric per sublayer)")
    check_options(source.config, calibration, opts)


def _nll(head: Head, hidden: torch.Tensor, ids: torch.Tensor, batch_size: int) -> tuple[float, int]:
    """Summed next-token NLL and count of the model whose last hidden states are `hidden` on `ids`."""
    total, count = 0.0, 0
    for s in _batches(hidden.shape[0], batch_size):
        logits = head(hidden[s])[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), ids[s, 1:].to(logits.device), reduction="sum")
        total += float(nll.double())
        count += logits.shape[0] * logits.shape[1]
    return total, count


def _perplexity(head: Head, hidden: torch.Tensor, ids: torch.Tensor, batch_size: int) -> float:
    total, count = _nll(head, hidden, ids, batch_size)
    return math.exp(total / count) if total / count < 709.0 else math.inf


@torch.no_grad()
def streamed_perplexity(
    source: LayerSource, ids: torch.Tensor, *, batch_size: int = 4, device=None, progress: bool = False
) -> float:
    """exp(mean next-token NLL) of the model of `source` on token ids (N, T), one layer in memory at a time."""
    positions = layer_positions(source.config, ids.shape[1], device=device)
    h = source.embed(ids).to(device)
    for i in tqdm(range(source.config.num_hidden_layers), desc="perplexity", disable=not progress):
        layer = source.layer(i, device)
        for s in _batches(h.shape[0], batch_size):
            h[s] = _run(layer, h[s], positions[i])
        del layer
        trim_heap()
    return _perplexity(source.head(device), h, ids, batch_size)


def _run(layer: nn.Module, hidden: torch.Tensor, positions: tuple) -> torch.Tensor:
    """The decoder layer's output on `hidden`, with its own `positions` (`layer_inputs.layer_positions`)."""
    cos, sin, mask, pos = positions
    rope = cos is not None
    return layer(hidden, attention_mask=mask, position_embeddings=(cos, sin) if rope else None, position_ids=pos)


@torch.no_grad()
def measure_error_curves_streamed(
    source: LayerSource, calibration: torch.Tensor, opts: LowRankOptions, *, device=None, progress: bool = True,
    seconds: list[dict] | None = None,
) -> tuple[ErrorCurves, torch.Tensor]:
    """Pass 1 of `compress_relational` one layer at a time (module docstring): the same error curves as
    `lowrank.measure_error_curves` (to float tolerance; sensitivity "fisher" draws the same labels). Returns the
    curves and the dense model's last hidden states on the planning windows. `seconds` receives per layer
    {"measure": s} (and "fisher" with sensitivity "fisher")."""
    config = source.config
    opts = opts.resolved(config, calibration)
    n_layers = config.num_hidden_layers
    plan_ids = calibration[: opts.plan_windows]
    positions = layer_positions(config, plan_ids.shape[1], device=device)  # each layer's own (sliding windows)
    weights = opts.layer_weights or [1.0] * n_layers
    seconds = seconds if seconds is not None else [{} for _ in range(n_layers)]
    options: dict[tuple[int, str], list[WidthOption]] = {}
    h = source.embed(plan_ids).to(device)
    if opts.sensitivity != "fisher":
        for li in tqdm(range(n_layers), desc="measuring error curves", disable=not progress):
            start = time.perf_counter()
            layer = source.layer(li, device)
            kinds, h = layer_error_curves(config, layer, h, opts, positions[li], weight=weights[li], release=True)
            options.update({(li, kind): o for kind, o in kinds.items()})
            del layer
            trim_heap()
            seconds[li]["measure"] = time.perf_counter() - start
        return ErrorCurves(options), h
    with tempfile.TemporaryDirectory(prefix="relational-hf-activations-") as spill:
        # each layer's input on the planning windows goes to disk (memory independent of depth), read back once
        def path(li: int) -> str:
            return os.path.join(spill, f"input-{li}.pt")

        for li in tqdm(range(n_layers), desc="forward (Fisher)", disable=not progress):
            start = time.perf_counter()
            torch.save(h.cpu(), path(li))
            layer = source.layer(li, device)
            h = torch.cat([_run(layer, h[s], positions[li]) for s in _batches(h.shape[0], opts.batch_size)])
            del layer
            trim_heap()
            seconds[li]["fisher"] = time.perf_counter() - start
        last = h
        grads = head_label_gradients(source.head(device), last, samples=opts.fisher_samples, batch_size=opts.batch_size)
        for li in tqdm(reversed(range(n_layers)), total=n_layers, desc="measuring error curves", disable=not progress):
            start = time.perf_counter()
            layer = source.layer(li, device)
            x = torch.load(path(li)).to(device)
            os.remove(path(li))
            run = functools.partial(_run, positions=positions[li])
            grads, dirs = layer_fisher_step(layer, run, x, grads, batch_size=opts.batch_size)
            seconds[li]["fisher"] += time.perf_counter() - start
            start = time.perf_counter()
            dirs = {k: v.to(device) for k, v in dirs.items()}
            kinds, _ = layer_error_curves(
                config, layer, x, opts, positions[li], directions=dirs, weight=weights[li], release=True
            )
            options.update({(li, kind): o for kind, o in kinds.items()})
            del layer, dirs, x
            trim_heap()
            seconds[li]["measure"] = time.perf_counter() - start
    return ErrorCurves(options), last


@torch.no_grad()
def compress_streamed(
    source: LayerSource,
    calibration: torch.Tensor,
    budget: int,
    writer: ShardWriter,
    options: LowRankOptions | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    eval_windows: int = 8,
    progress: bool = True,
) -> tuple[RelationalConfig, LowRankResult, dict]:
    """`lowrank.compress_relational` of the model `source` gives, one layer in memory at a time, writing the
    compressed model's tensors to `writer` (stored as `dtype`, default the source's dtype on disk) as they are made.

    budget: the stored parameters the result may have. device: where each layer runs (e.g. "cuda"; default CPU).
    Returns (the compressed model's config, LowRankResult, a report: per-layer seconds, the calibration perplexity
    of the dense and the compressed model on the first `eval_windows` calibration windows, the written tensors'
    names and shapes). The caller finishes the writer and writes the config."""
    opts = options or LowRankOptions()
    if isinstance(opts.kinds, str):
        opts.kinds = tuple(k for k in opts.kinds.split(",") if k)
    _check(source, calibration, opts)
    opts = opts.resolved(source.config, calibration)  # the automatic choices, for this model and calibration
    config = source.config
    n_layers = config.num_hidden_layers
    dtype = dtype or source.storage_dtype
    result = LowRankResult(budget=budget)
    seconds: list[dict] = [{} for _ in range(n_layers)]
    with torch.device("meta"):
        dense_meta = RelationalForCausalLM(config)
    fixed = fixed_parameters(config, stored_parameters(dense_meta)["total"])
    written = in_gauge(config, opts.gauge)  # the budget is counted in the gauge the compression writes
    check_budget(written, budget, fixed, opts)
    t0 = time.perf_counter()
    curves, dense_last = measure_error_curves_streamed(
        source, calibration, opts, device=device, progress=progress, seconds=seconds
    )
    probe = calibration[: min(eval_windows, opts.plan_windows)]
    head = source.head(device)
    ppl_before = _perplexity(head, dense_last[: probe.shape[0]], probe, opts.batch_size)
    del dense_last, head
    widths = plan(written, curves, budget, fixed, result)
    new_config = compressed_config(written, widths)
    result.plan_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    written: dict[str, tuple[int, ...]] = {}

    def emit(name: str, tensor: torch.Tensor) -> None:
        writer.add(name, tensor, dtype if tensor.is_floating_point() else tensor.dtype)
        written[name] = tuple(tensor.shape)

    positions = layer_positions(config, calibration.shape[1], device=device)
    n = calibration.shape[0]
    h = torch.cat([source.embed(calibration[s]) for s in _batches(n, max(opts.batch_size, 64))]).to(device)
    h_dense = h.clone() if opts.correction == "dense" else None
    for li in tqdm(range(n_layers), desc="compressing layers", disable=not progress):
        start = time.perf_counter()
        dense = source.layer(li, device)
        with no_init_weights():
            target = RelationalDecoderLayer(new_config, li)
        target = target.float().eval().to(device)
        chosen = {kind: widths[kind][li] for kind in KINDS}
        record: dict[str, float] = {}
        h, h_dense = compress_layer(dense, target, h, h_dense, chosen, opts, positions[li], release=True, record=record)
        if record:
            result.refits.append(record)
        del dense
        for key, tensor in target.state_dict().items():
            emit(f"model.layers.{li}.{key}", tensor)
        del target
        trim_heap()
        seconds[li]["compress"] = time.perf_counter() - start
    probe = calibration[:eval_windows]
    ppl_after = _perplexity(source.head(device), h[: probe.shape[0]], probe, opts.batch_size)
    del h, h_dense
    for name, shape, blocks in source.static_tensors():
        writer.begin(name, tuple(shape), dtype)
        for block in blocks:
            writer.write(block.to(dtype))
        written[name] = tuple(shape)
    result.compress_seconds = time.perf_counter() - t1
    with torch.device("meta"):
        new_meta = RelationalForCausalLM(new_config)
    expected = {k: tuple(v.shape) for k, v in new_meta.state_dict().items()}
    if new_config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if expected != written:
        wrong = sorted(set(expected.items()) ^ set(written.items()))
        raise RuntimeError(f"streamed tensors do not match the compressed model's state (e.g. {wrong[0]!r})")
    report = {
        "streamed": True,
        "layer_seconds": [{k: round(v, 2) for k, v in s.items()} for s in seconds],
        "calibration_perplexity_before": ppl_before,
        "calibration_perplexity_after": ppl_after,
        "parameters_after": stored_parameters(new_meta)["total"],
        "stored": {k: stored_parameters(new_meta)[k] for k in ("by_kind", "by_layer")},
    }
    return new_config, result, report


__all__ = [
    "LayerSource",
    "RelationalCheckpointLayers",
    "compress_streamed",
    "relational_embed",
    "relational_head",
    "measure_error_curves_streamed",
    "streamed_perplexity",
]
