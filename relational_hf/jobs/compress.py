"""`compress_model`: one entry point for the project's compression methods (DESIGN.md 2.2a), the job that converts,
compresses and heals.

Methods:
- "relational": exact conversion to the relational pivot gauge (`convert.to_relational`), then activation-aware
  truncation of the invariants with a sensitivity-planned budget (`compress.lowrank.compress_relational`);
  optionally composed with a global-rotation slice of the residual stream first (option `slice_fraction`).
- "slice": exact conversion, then principal-gauge slicing with one rotation for the whole stream
  (`compress.slicing.slice_relational`), its width chosen to meet the requested size.
`remove` is the share of the SOURCE model's stored parameters (every stored tensor once, embeddings and head
included) to remove; the result stores at most (1 - remove) times as many. Healing (`heal_steps` > 0) is the LoRA
recovery fine-tune of `training.heal` (this module loads the Trainer and PEFT with it).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compress.budget import KINDS
from ..compress.distill import TEXT_OPTIONS, calibration_share, healing_stream, teacher_text
from ..compress.lowrank import compress_relational
from ..compress.options import LowRankOptions
from ..compress.slicing import slice_relational
from ..convert.relational import to_relational
from ..lm.metrics import perplexity
from ..modeling import RelationalForCausalLM
from ..params import relational_parameter_count, stored_parameters
from ..training.heal import heal
from ..training.heal_settings import HEAL_LOSSES

logger = logging.getLogger(__name__)

METHODS: tuple[str, ...] = ("relational", "slice")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _as_relational(model: nn.Module) -> RelationalForCausalLM:
    if isinstance(model, RelationalForCausalLM):
        return model
    return to_relational(model)


def _check_arguments(remove: float, method: str, calibration: Any, heal_steps: int, heal_loss: str) -> None:
    if isinstance(remove, bool) or not isinstance(remove, (int, float)) or not 0.0 < remove < 1.0:
        raise ValueError(f"`remove` must be a share of stored parameters in (0, 1), got {remove!r}")
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.shape[1] < 2:
        shape = tuple(calibration.shape) if isinstance(calibration, torch.Tensor) else type(calibration).__name__
        raise ValueError(f"`calibration` must be token ids of shape (N, T) with T >= 2, got {shape}")
    if isinstance(heal_steps, bool) or not isinstance(heal_steps, int) or heal_steps < 0:
        raise ValueError(f"`heal_steps` must be an integer >= 0, got {heal_steps!r}")
    if heal_loss not in HEAL_LOSSES:
        raise ValueError(f"`heal_loss` must be one of {', '.join(HEAL_LOSSES)}, got {heal_loss!r}")


def _slice_to_budget(model: RelationalForCausalLM, calibration: torch.Tensor, budget: int):
    """Global-rotation slice keeping the largest width d' whose stored size (closed form; slicing keeps a tied head
    tied and the final gain a vector, so only the width changes) is <= budget."""
    config = model.config
    d = config.hidden_size
    tied = config.tie_word_embeddings

    def size(width: int) -> int:
        c = copy.deepcopy(config)
        c.hidden_size = width
        return relational_parameter_count(c)

    low = max(config.head_dim, config.qk_rank)
    d_new = next((w for w in range(d - 1, low - 1, -1) if size(w) <= budget), None)
    if d_new is None:
        raise ValueError(f"no slice width >= {low} stores at most {budget:,} parameters; choose a smaller `remove`")
    sliced, rep = slice_relational(model, (d - d_new) / d, calibration)
    return sliced, {"hidden_size": d_new, "variance_kept": rep.variance_kept, "head_tied": tied}


def compress_model(
    model: nn.Module,
    tokenizer=None,
    *,
    remove: float,
    method: str = "relational",
    calibration: torch.Tensor,
    heal_steps: int = 0,
    heal_loss: str = "kd",
    heal_data: torch.Tensor | None = None,
    progress: bool = True,
    eval_windows: int = 8,
    evaluation: torch.Tensor | None = None,
    on_phase: Callable[[str], Any] | None = None,
    **options: Any,
) -> tuple[nn.Module, dict]:
    """Compress a causal LM (a Llama-family Transformers model or a `RelationalForCausalLM`) so that it stores at
    most (1 - remove) x its stored parameters, and report what was done.

    calibration: token ids (N, T) (e.g. `compress.eval.text_windows`). method: "relational" or "slice" (module
    docstring). heal_steps > 0: a LoRA recovery fine-tune of that many steps, merged back (`training.heal.heal`).
    heal_loss "kd" (default): distillation from `model` itself (KL to its next-token distributions) on `heal_data`,
    by default text `model` samples itself (`compress.distill.teacher_text`: heal_samples rows of heal_length tokens,
    seeded by heal_seed, chat prompts when `tokenizer` has a template), mixed with the calibration windows
    (`compress.distill.healing_stream`: a share heal_calibration_share of the blocks, default
    `DEFAULT_CALIBRATION_SHARE` = 0.5; 0 for that text alone, 1 for the windows alone). heal_loss "lm": the
    language-model loss on `heal_data` (default: the calibration windows, which a long run overfits). Options for
    "relational": the fields of `LowRankOptions` (e.g. correction="dense", mlp_step=64) and slice_fraction (a
    global-rotation slice first); heal options: heal_lr, heal_rank, heal_batch_size, heal_block_size, heal_seed,
    heal_samples, heal_length, heal_chat_share, heal_calibration_share; curves: the error curves of
    `lowrank.measure_error_curves` measured before on the same relational model, calibration and options (one
    measurement for several budgets). Returns (compressed RelationalForCausalLM, report) with report keys: method, remove, parameters_before/after/budget, stored (by kind, by layer), widths,
    calibration_perplexity_before/after (on the first `eval_windows` calibration windows), seconds, peak_rss_mib;
    with `evaluation` windows (N, T) and healing, eval_perplexity_compressed: their perplexity after compression and
    before healing (what the healing starts from). on_phase: called with "compress" and "heal" as each phase starts
    (the command line counts its idle cores again there).
    """
    _check_arguments(remove, method, calibration, heal_steps, heal_loss)
    start = time.perf_counter()
    source_stored = stored_parameters(model)["total"]
    budget = int(math.floor((1.0 - remove) * source_stored))
    rel = _as_relational(model).float().eval()
    probe = calibration[:eval_windows]
    ppl_before = perplexity(rel, probe)
    report: dict[str, Any] = {
        "method": method,
        "remove": remove,
        "parameters_before": source_stored,
        "parameters_budget": budget,
        "calibration_windows": list(calibration.shape),
    }
    heal_keys = {k: options.pop(k) for k in list(options) if k.startswith("heal_")}
    text_keys = {k[len("heal_") :]: heal_keys.pop(k) for k in list(heal_keys) if k[len("heal_") :] in TEXT_OPTIONS}
    if text_keys and (heal_loss != "kd" or heal_data is not None):
        names = ", ".join(sorted("heal_" + k for k in text_keys))
        raise ValueError(f"{names} shape the text the source generates, used only with heal_loss='kd' and no heal_data")
    share = heal_keys.pop("heal_calibration_share", None)
    if share is not None and heal_loss != "kd":
        raise ValueError("heal_calibration_share mixes the calibration windows into distillation: heal_loss='kd' only")
    share = calibration_share(share, "`heal_calibration_share`")
    if method == "slice":
        if on_phase is not None:
            on_phase("compress")
        out, info = _slice_to_budget(rel, calibration, budget)
        report["slice"] = info
    else:
        slice_fraction = float(options.pop("slice_fraction", 0.0))
        if not 0.0 <= slice_fraction < 1.0:
            raise ValueError(f"`slice_fraction` must be in [0, 1), got {slice_fraction}")
        curves = options.pop("curves", None)
        unknown = set(options) - set(LowRankOptions.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}; known: {sorted(LowRankOptions.__dataclass_fields__)}")
        opts = LowRankOptions(**options)
        if isinstance(opts.kinds, str):
            opts.kinds = tuple(k for k in opts.kinds.split(",") if k)
        if not set(opts.kinds) <= set(KINDS):
            raise ValueError(f"`kinds` must be a subset of {KINDS}, got {opts.kinds}")
        if on_phase is not None:
            on_phase("compress")
        if slice_fraction > 0:
            rel, slice_report = slice_relational(rel, slice_fraction, calibration)
            report["slice"] = {"hidden_size": slice_report.hidden_size_after, "variance_kept": slice_report.variance_kept}
        out, result = compress_relational(
            rel, calibration, budget, opts, count=lambda m: stored_parameters(m)["total"], progress=progress,
            curves=curves,
        )
        report["widths"] = result.widths
        report["plan_seconds"] = round(result.plan_seconds, 2)
        report["compress_seconds"] = round(result.compress_seconds, 2)
        if result.refits:
            report["refits"] = result.refits
        if result.qk_kept_full:
            report["qk_kept_full"] = result.qk_kept_full
        report["options"] = opts.as_report(rel.config, calibration)
    report["calibration_perplexity_before"] = ppl_before
    report["calibration_perplexity_after"] = perplexity(out, probe)
    if heal_steps > 0:
        if on_phase is not None:
            on_phase("heal")
        if evaluation is not None:
            report["eval_perplexity_compressed"] = perplexity(out, evaluation)
        text_settings: dict[str, Any] | str = "given" if heal_data is not None else "calibration windows"
        if heal_loss == "kd" and heal_data is None and share < 1.0:
            seed = heal_keys.get("heal_seed", 0)
            heal_data, text_settings = teacher_text(model, tokenizer, seed=seed, progress=progress, **text_keys)
        if heal_loss == "kd":
            heal_data, mix = healing_stream(heal_data, calibration, share)
            text_settings = (text_settings if isinstance(text_settings, dict) else {"text": text_settings}) | mix
        data = calibration if heal_data is None else heal_data
        teacher = model.eval() if heal_loss == "kd" else None
        out, heal_report = heal(
            out, data, steps=heal_steps, loss=heal_loss, teacher=teacher, progress=progress, **heal_keys
        )
        heal_report["tokens_available"] = int(data.numel())
        heal_report["text"] = text_settings
        report["heal"] = heal_report
        report["calibration_perplexity_healed"] = perplexity(out, probe)
    stored = stored_parameters(out)
    if stored["total"] > source_stored:
        raise RuntimeError(f"compression grew the model: {stored['total']:,} > {source_stored:,} stored parameters")
    report["parameters_after"] = stored["total"]
    report["removed_share"] = 1.0 - stored["total"] / source_stored
    report["stored"] = {"by_kind": stored["by_kind"], "by_layer": stored["by_layer"]}
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["peak_rss_mib"] = round(_peak_rss_mib(), 1)
    out.compression_report = copy.deepcopy(report)
    return out, report


def checkpoint_source(path: str | Path, *, trust_remote_code: bool = False):
    """The `compress.streamed.LayerSource` of a local safetensors checkpoint folder or GGUF file: a relational
    checkpoint is read as it is, a Llama-family one (a GGUF file dequantised tensor by tensor) is converted layer by
    layer as it is read (no relational copy on disk)."""
    from transformers import AutoConfig

    from ..compress.streamed import RelationalCheckpointLayers
    from ..convert.streaming import LlamaCheckpointLayers
    from ..modeling import RelationalConfig
    from ..shards import is_gguf_file

    if is_gguf_file(path):
        return LlamaCheckpointLayers(path, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if isinstance(config, RelationalConfig):
        return RelationalCheckpointLayers(path, trust_remote_code=trust_remote_code)
    return LlamaCheckpointLayers(path, trust_remote_code=trust_remote_code)


def compress_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    remove: float,
    calibration: torch.Tensor,
    evaluation: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    max_shard_size: int | str = "5GB",
    eval_windows: int = 8,
    trust_remote_code: bool = False,
    copy_tokenizer: bool = True,
    progress: bool = True,
    lock=None,
    report_extra: dict | None = None,
    evaluations: dict[str, torch.Tensor] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    **options: Any,
) -> dict:
    """`compress_model(method="relational")` of the safetensors checkpoint folder or GGUF file `src`, one decoder layer in memory
    at a time (`compress.streamed.compress_streamed`; a Llama-family source is converted layer by layer as it is
    read), written shard by shard to the new folder `out` through `relational_hf.outputs` (staged, moved into place
    when complete; a failure leaves `out` untouched): the model files, the tokenizer of `src`
    (`copy_tokenizer`) and `compression_report.json`. The result equals the in-memory path's to float tolerance.

    dtype: stored dtype of the result (default: the source's on disk); device: where each layer runs ("cuda" on a
    GPU; default CPU); evaluation: token ids (N, T) whose perplexity is reported before and after (one layer at a
    time too: eval_perplexity_before/after); evaluations: named token ids (N, T) each measured the same way, reported
as `compress.eval.eval_table` under "eval" (instead of `evaluation`; the first of them also as
eval_windows and eval_perplexity_before/after); report_extra: entries added to
the report; write_extra: called with the staged folder to write files of the caller's into it (they land with the
model, or not at all); options: the fields of
    `LowRankOptions` except `fisher_metric`. No healing (it trains the whole model): heal the result in memory if it
    fits. Returns the report (also in the folder), with per-layer seconds and the peak resident memory."""
    from ..compress.options import LowRankOptions
    from ..compress.streamed import RelationalCheckpointLayers, compress_streamed, streamed_perplexity
    from ..convert.streaming import _copy_tokenizer, _write_metadata
    from ..outputs import check_new_output, write_new_output
    from ..shards import ShardWriter, parse_dtype, parse_size

    _check_arguments(remove, "relational", calibration, 0, "kd")
    unknown = set(options) - set(LowRankOptions.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; known: {sorted(LowRankOptions.__dataclass_fields__)}")
    check_new_output(out, "OUT", source=src)
    start = time.perf_counter()
    source = checkpoint_source(src, trust_remote_code=trust_remote_code)
    opts = LowRankOptions(**options)
    budget = int(math.floor((1.0 - remove) * source.stored_parameters))
    write_dtype = parse_dtype(dtype) or source.storage_dtype
    report: dict[str, Any] = {
        "method": "relational",
        "remove": remove,
        "parameters_before": source.stored_parameters,
        "parameters_budget": budget,
        "calibration_windows": list(calibration.shape),
    }
    if evaluation is not None:
        report["eval_windows"] = list(evaluation.shape)
        report["eval_perplexity_before"] = streamed_perplexity(source, evaluation, device=device, progress=progress)
    evaluations = dict(evaluations or {})
    if evaluation is not None and evaluations:
        raise ValueError("give `evaluation` or `evaluations`, not both (the first of `evaluations` is reported as both)")
    eval_before = {
        name: streamed_perplexity(source, ids, device=device, progress=progress) for name, ids in evaluations.items()
    }
    first = next(iter(evaluations), None)
    if first is not None:
        report["eval_windows"] = list(evaluations[first].shape)
        report["eval_perplexity_before"] = eval_before[first]

    def write(stage: Path) -> None:
        names = 64 * source.config.num_hidden_layers + 16
        writer = ShardWriter(stage, parse_size(max_shard_size), 4096 + 2 * names * 200)
        config, result, streamed = compress_streamed(
            source, calibration, budget, writer, opts, dtype=write_dtype, device=device, eval_windows=eval_windows,
            progress=progress,
        )
        writer.finish(streamed["parameters_after"])
        with torch.device("meta"):
            meta = RelationalForCausalLM(config)
        _write_metadata(meta, config, write_dtype, stage)
        if copy_tokenizer:
            _copy_tokenizer(Path(src), stage, trust_remote_code)
        report.update(
            widths=result.widths,
            plan_seconds=round(result.plan_seconds, 2),
            compress_seconds=round(result.compress_seconds, 2),
            **({"refits": result.refits} if result.refits else {}),
            **({"qk_kept_full": result.qk_kept_full} if result.qk_kept_full else {}),
            options=opts.as_report(source.config, calibration),
            **streamed,
        )
        report["removed_share"] = 1.0 - report["parameters_after"] / source.stored_parameters
        if evaluation is not None:
            written = RelationalCheckpointLayers(stage, trust_remote_code=trust_remote_code)
            report["eval_perplexity_after"] = streamed_perplexity(written, evaluation, device=device, progress=progress)
        if evaluations:
            from ..compress.eval import eval_table

            written = RelationalCheckpointLayers(stage, trust_remote_code=trust_remote_code)
            after = {n: streamed_perplexity(written, ids, device=device, progress=progress) for n, ids in evaluations.items()}
            report["eval"] = eval_table(eval_before, after, {n: list(ids.shape) for n, ids in evaluations.items()})
            report["eval_perplexity_after"] = after[first]
        report.update(report_extra or {})
        if write_extra is not None:
            write_extra(stage)
        report["seconds"] = round(time.perf_counter() - start, 2)
        report["peak_rss_mib"] = round(_peak_rss_mib(), 1)
        (stage / "compression_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    write_new_output(out, write, command="compress", kind="relational", lock=lock)
    return report


__all__ = ["METHODS", "checkpoint_source", "compress_checkpoint", "compress_model"]
