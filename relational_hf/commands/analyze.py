"""The directional analysis of a causal LM on a text file (DESIGN.md section 3).

    relational-hf analyze MODEL_OR_DIR --text FILE [--out DIR] [--compression SETTING ...] [--max-memory 4GiB]

Writes `report.json`, `report.md` (the tables) and PNG figures to --out: the per-layer parallel ratio by site, the
Delta PPL of the all-layer sweeps, the per-layer edits (one layer at a time) and the compression errors; prints the
summary tables. The text is cut into rows of --seq-len tokens (at most --max-tokens); the first
--calibration-fraction of the rows calibrate Wanda, the rest are analysed.

Two edit protocols: all-layer edits scale a component at one site in every layer at once (--sweep-values);
per-layer edits scale it in one layer at a time (--per-layer-*), on the first --per-layer-tokens analysed tokens.
The unedited pass is computed once; a per-layer edit of layer l reruns only layers l..L-1 from the recorded input
of layer l (`relational_hf.directional.analysis`).

A model larger than memory: with --max-memory (and/or --offload-folder) the model is loaded with Accelerate's disk
offload (`relational_hf.lm.offload`), as `evaluate` loads it: the decoder layers beyond --max-memory of weights stay on
disk and are read in, one layer at a time, when they run; the compression settings are applied to each layer as it
comes in (`relational_hf.compress.ops.compressed_view`), never to a copy of the model. The results are the same as in
memory; the time grows with the passes (each reads the offloaded layers again). The recorded layer outputs of the
analysed rows (rows x seq-len x hidden size x layers values) stay in memory. A local GGUF file is first written as a
safetensors working copy, one tensor dequantised at a time (`relational_hf.lm.offload.load_model`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch

from ..compress.ops import COMPRESSION_SETTINGS, settings_from
from ..directional.sites import SITES
from ..errors import UsageError
from ..lm.offload import GGUF_NOT_OFFLOADED
from .checks import check_model_argument, check_token_ids, output_folder, read_token_ids, text_or_ids
from .options import (
    CommandArguments,
    EachInterval,
    Fraction,
    Length,
    LoadDtypeOptions,
    ModelSourceOptions,
    NonNegativeInt,
    OffloadOptions,
    OneOf,
    PositiveInt,
    finite_float,
    option,
    positional,
)

logger = logging.getLogger(__name__)

HELP = "update geometry, component sweeps and compression diagnostics of a model"
#: the word that skips a list option (--compression none, --per-layer-perpendicular none)
NONE = "none"
Sites = Annotated[list[str], OneOf(SITES)]  # the measured sites of `relational_hf.directional.sites`


@dataclass
class AnalyzePaths:
    model: str = positional("a saved model folder, a Hub id in the local cache, or a GGUF file", "MODEL_OR_DIR")


@dataclass
class AnalyzeOptions:
    _argument_group_name = "analysis"

    text: str | None = option(None, "UTF-8 text (or a .pt tensor of token ids) to analyse (required)", metavar="FILE")
    out: str = option("analysis", "output folder", metavar="DIR")
    max_tokens: PositiveInt = option(4096, "tokens of the text used", metavar="N")
    seq_len: Length = option(256, "tokens per row")
    batch_size: PositiveInt = option(8, "rows per forward pass")
    sites: Sites = option(list(SITES), "sites to measure and sweep", choices=SITES)
    sweep_values: Annotated[list[float], EachInterval(finite_float)] = option(
        [0.0, 0.5], "all-layer edits: scales s_par and s_perp tried at each site in every layer at once", metavar="S"
    )
    per_layer: bool = option(True, "also edit one layer at a time (--no-per-layer skips it)")
    per_layer_sites: Sites = option(
        ["residual_attention", "residual_mlp", "value_exclude_self"], "sites of the per-layer edits", choices=SITES
    )
    per_layer_values: list[str] = option(
        ["0", "0.5"], "per-layer edits: parallel scales s_par (none to skip)", metavar="S"
    )
    per_layer_perpendicular: list[str] = option(
        ["0"], "per-layer control: perpendicular scales s_perp (none to skip)", metavar="S"
    )
    per_layer_tokens: PositiveInt = option(
        512, "analysed tokens (whole rows, from the first) the per-layer edits are measured on", metavar="N"
    )
    compression: list[str] = option(
        list(COMPRESSION_SETTINGS),
        f"compression settings to compare, or none to skip (default: all of {', '.join(COMPRESSION_SETTINGS)})",
        metavar="SETTING",
    )
    calibration_fraction: Fraction = option(0.25, "share of the rows used to calibrate Wanda")
    group_size: PositiveInt = option(128, "quantisation group size")
    seed: NonNegativeInt = option(0, "seed of the calibration/evaluation split and of sampling")
    overwrite: bool = option(
        False, "write into an --out folder relational-hf did not write (its files of the report's names are replaced)"
    )


@dataclass
class AnalyzeArguments(
    CommandArguments, OffloadOptions, LoadDtypeOptions, ModelSourceOptions, AnalyzeOptions, AnalyzePaths
):
    POSITIONALS = AnalyzePaths
    PARSER_GROUPS = (AnalyzeOptions, OffloadOptions, ModelSourceOptions, LoadDtypeOptions)


Arguments = AnalyzeArguments


def _floats_or_none(flag: str, values: list[str]) -> list[float]:
    """Parse a list option of scales where the single word "none" means the empty list."""
    if [v.lower() for v in values] == [NONE]:
        return []
    out = []
    for v in values:
        try:
            number = float(v)
        except ValueError:
            raise UsageError(f"{flag} takes numbers or the single word 'none', got {v!r}") from None
        finite_float.check(number, flag)
        out.append(number)
    return out


def compression_settings(names: list[str] | None) -> list[str]:
    """The settings of --compression: "none" (alone) or nothing skips compression; other names are validated."""
    names = list(names or [])
    if any(n.lower() == NONE for n in names):
        if len(names) > 1:
            raise UsageError(f"--compression: 'none' cannot be combined with settings, got {' '.join(names)}")
        return []
    try:
        return settings_from(names)
    except ValueError as err:
        raise UsageError(f"--compression: {err}") from None


def check(args: AnalyzeArguments) -> tuple[list[str], list[tuple[str, list[float]]]]:
    """MODEL_OR_DIR exists (or is a Hub id); --text is UTF-8 text; sizes agree. Returns the compression settings and
    the per-layer edits."""
    if args.text is None:
        raise UsageError("--text is required: the UTF-8 text to analyse")
    args.model = check_model_argument(args.model, "MODEL_OR_DIR", gguf_file=args.gguf_file)
    text_or_ids(args.text, "--text")
    output_folder(args.out, "--out")
    output_folder(args.offload_folder, "--offload-folder")
    args.offload_budget()
    if args.max_tokens < args.seq_len:
        raise UsageError(f"--max-tokens {args.max_tokens} is smaller than one --seq-len row of {args.seq_len}")
    settings = compression_settings(args.compression)
    edits = [
        ("parallel", _floats_or_none("--per-layer-values", args.per_layer_values)),
        ("perpendicular", _floats_or_none("--per-layer-perpendicular", args.per_layer_perpendicular)),
    ]
    return settings, edits if args.per_layer else [(c, []) for c, _ in edits]


def _load(args: AnalyzeArguments):
    """(model, device map, token ids of the text)."""
    from ..lm.offload import load_model
    from ..loading import load_config_from, load_tokenizer_from, resolve_model_source, warn_beyond_context

    source = resolve_model_source(args.model, args.gguf_file)
    warn_beyond_context(load_config_from(source, trust_remote_code=args.trust_remote_code), {"--seq-len": args.seq_len})
    if args.offloading() and source.gguf_file is not None and not source.local:
        raise UsageError(GGUF_NOT_OFFLOADED)
    model, device_map = load_model(
        source,
        max_memory=args.offload_budget(),
        offload_folder=args.offload_folder,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
    )
    if Path(args.text).suffix == ".pt":
        ids = read_token_ids(Path(args.text), lambda: None, "--text")
        return model, device_map, check_token_ids(ids, model.get_input_embeddings().weight.shape[0], "--text")
    text = Path(args.text).read_text(encoding="utf-8")
    try:
        tokenizer = load_tokenizer_from(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        if model.config.vocab_size < 256:
            raise UsageError(f"{args.model} has no tokenizer ({err}) and fewer than 256 tokens for raw bytes") from err
        logger.warning("no tokenizer with %s (%s); using the UTF-8 bytes of the text as token ids", args.model, err)
        return model, device_map, torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return model, device_map, ids


def run(args: AnalyzeArguments) -> dict:
    """Run the analysis the flags ask for, write the JSON report, the markdown tables and the figures into the
    claimed --out folder (`relational_hf.outputs`: a folder of someone else's is refused unless --overwrite), print
    the tables; returns the report."""
    from ..outputs import OutputLock, unclaimed_on_failure

    settings, per_layer_edits = check(args)
    # one writer per folder, from before the work starts; a run that fails before writing leaves no folder behind
    with OutputLock(args.out), unclaimed_on_failure(args.out):
        return _run(args, settings, per_layer_edits)


#: the files `analyze` writes into --out
REPORT_FILES = ("report.json", "report.md", "parallel_ratio.png", "sweep.png", "per_layer.png", "compression.png")


def _run(args: AnalyzeArguments, settings: list[str], per_layer_edits: list) -> dict:
    from ..directional.analysis import directional_analysis, format_markdown, format_table
    from ..hub.card import stored_parameters
    from ..lm.data import lm_blocks
    from ..lm.offload import device_map_line, device_map_summary, peak_rss_bytes
    from ..outputs import atomic_write_text, check_owned_names, prepare_output_dir, record_files

    out = prepare_output_dir(
        args.out, overwrite=args.overwrite, command="analyze", kind="analysis", flag="--out", swaps=False
    )
    check_owned_names(out, list(REPORT_FILES), overwrite=args.overwrite)
    torch.manual_seed(args.seed)
    model, device_map, ids = _load(args)
    rows = lm_blocks(ids, args.seq_len, args.max_tokens)
    n_cal = min(round(args.calibration_fraction * rows.shape[0]), rows.shape[0] - 1) if settings else 0
    calibration = rows[:n_cal] if n_cal > 0 else rows  # a one-row text calibrates on what it analyses
    rows = rows[n_cal:]

    def save(report: dict, compression=None) -> None:
        atomic_write_text(out / "report.json", json.dumps(report, indent=2))
        atomic_write_text(out / "report.md", format_markdown(report, compression) + "\n")
        figures = [Path(path).name for path in report["figures"].values()]
        record_files(out, ["report.json", "report.md", *(f for f in figures if (out / f).is_file())])

    report, compression = directional_analysis(
        model,
        rows,
        out=out,
        sites=list(args.sites),
        sweep_values=list(args.sweep_values),
        per_layer_sites=list(args.per_layer_sites),
        per_layer_edits=per_layer_edits,
        per_layer_tokens=args.per_layer_tokens,
        compression=settings,
        calibration=calibration,
        group_size=args.group_size,
        batch_size=args.batch_size,
        save=save,
        description={
            "model": args.model,
            "text": str(args.text),
            "offloaded": args.offloading(),
            "device_map": device_map_summary(device_map),
        },
    )
    report["peak_rss_mib"] = round(peak_rss_bytes() / 2**20, 1)
    save(report, compression)
    print(format_table(report, compression))
    print(f"\nreport: {out / 'report.json'}, {out / 'report.md'}; figures: {', '.join(report['figures'].values())}")
    stored = stored_parameters(args.model)
    counted = "" if stored is None else f"; {stored:,} values stored in the checkpoint's safetensors"
    print(f"summary: perplexity {report['perplexity']:.3f} on {report['tokens_analysed']:,} tokens{counted}")
    print(f"device map: {device_map_line(device_map)}; peak RSS {report['peak_rss_mib']:.0f} MiB")
    return report
