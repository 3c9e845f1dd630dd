"""Compression of a real checkpoint at equal stored size: SmolLM2-135M-Instruct, perplexity against stored parameters.

Model: `relational_hf.pretrained.smollm2_checkpoint()` (SmolLM2-135M-Instruct, fp32, tied head), on the CPU.
Text: WikiText-2 validation (`../shared/data/wikitext-2/valid.txt`), cut by `relational_hf.compress.eval.text_windows`
at the ` = Title = ` heading closest to the 90% mark (whole documents on each side, `relational_hf.lm.data.document_split`):
calibration = the first `--calibration-windows` non-overlapping windows of `--window` tokens from the start of the
first 90% of the documents; evaluation = the first `--eval-windows` windows of the last 10% of the documents
(held out, never seen in calibration). Perplexity = exp(mean next-token NLL over every predicted token of the
windows), `compress.eval.perplexity_on_windows`; stored parameters = `compress.eval.stored_parameters` (every stored
tensor once: tied head once, shortcuts and untied heads counted).

Methods at each target share r of stored parameters removed (10/20/25/30%):
- magnitude / wanda: unstructured pruning of the decoder-layer weights (`compress.baselines.prune_to_target`), sparsity
  chosen so that the non-zeros are (1 - r) of the dense count; they keep their dense storage (both reported);
- magnitude-2:4 / wanda-2:4: the fixed 2:4 pattern (50% of decoder weights), one cell each;
- slicegpt: the SliceGPT reimplementation (`compress.baselines.slicegpt`) keeping SmolLM2's head tied (its final gain
  becomes a d' gain vector), at the widest d' storing at most (1 - r) of the dense count (bisection on the count);
- slicegpt-untied: the same with the head untied as the paper stores it (+V d' parameters, so a narrower d');
- slice, relational: the project's methods through `relational_hf.jobs.compress_model` (recorded as not
  available when that module is missing; rerun with `--methods slice relational --resume`);
- relational-residual: the relational method with the previous default plan (`sensitivity="token"`: widths chosen by
  the error each truncation adds to the residual stream, relative to each token's residual energy), for comparison;
- relational-greedy: the relational method keeping SwiGLU units in the order of forward selection for the refit
  (`mlp_order="greedy"`, `compress.truncation.greedy_unit_order`) instead of each unit's own score;
- relational-fisher-metric: the relational method choosing the VO subspace and ranking the SwiGLU units by their
  error in the Fisher metric of the sublayer's output (`fisher_metric=True`) instead of the Euclidean norm;
- relational-holdout: the relational method holding back the last 16 calibration windows to choose each layer's
  refit (its ridge and its blend of the dense and local targets, `refit_holdout=16`), then refitting on all of them;
- relational-blend: the relational method refitting every layer's W_down to the fixed blend 0.5 of the two targets
  (`refit_blend=0.5`, no window held back): the blend most layers chose with `relational-holdout` on both splits;
- relational-blend0.25: the same with a quarter of the dense trajectory's step in the target (`refit_blend=0.25`);
- relational-ridge3e-3: the default (blend 0.5) with the refit's relative ridge 3e-3 instead of 1e-2 (`ridge=3e-3`),
  the ridge `relational-holdout` chose most often;
- relational-refine: the default, then 4 epochs of Adam (3e-4) on each layer's kept SwiGLU maps against the refit's
  own target, the epoch kept by the error on the last eighth of the calibration windows (`refine_epochs=4`);
  relational-refine8 the same with 8 epochs; relational-refine-lr1e-3 the default (which refines on a model as small as
  SmolLM2) with the refinement's learning rate 1e-3 instead of 3e-4 (`refine_lr=1e-3`);
- relational-pivot: the default written in the pivot gauge (`gauge="pivot"`, the budget counted in it: the pivot
  entries are not stored, so the same size keeps a little more width); every other relational variant writes the
  free gauge, the default since the speed measurements (`compress_speed.py`): the cells measured before it are
  pivot-gauge cells (their report's options have no `gauge`);
- relational-zero-prior: the default with the refit's ridge pulling W_down towards zero (`refit_prior="zero"`), the
  default before the ridge pulled it towards the kept units' own W_down columns; the cells measured before that
  change have no `refit_prior` in their report's options and are zero-prior cells.
- relational-greedy-refine: the default with both options that fit the calibration text harder, forward selection of
  the SwiGLU units and 4 epochs of refinement (`mlp_order="greedy"`, `refine_epochs=4`); since the automatic choices
  (`mlp_order="auto"`, `refine_epochs=None`, the defaults) the relational method itself takes both on SmolLM2;
- relational-score: the relational method with the automatic choices pinned to the cheap settings, each unit's own
  score and no refinement (`mlp_order="score"`, `refine_epochs=0`): the default before the automatic choices, and
  what `auto` gives models too wide for them.

`--split reverse` is the robustness protocol: calibration on the first windows of the LAST 90% of the documents,
evaluation on the first windows of the FIRST 10% (so a method chosen on the default split is checked on text it was
not chosen on); its results go to their own file (`--tag`).

    python benchmarks/compress.py                      # full benchmark (see the JSON for the wall time)
    python benchmarks/compress.py --quick              # 2 layers, short windows: about a minute
    python benchmarks/compress.py --methods slice relational --resume
    python benchmarks/compress.py --markdown           # the README table from the JSON
    python benchmarks/compress.py --merge OTHER/compress.json   # add cells measured by a concurrent run
    python benchmarks/compress.py --methods relational --targets 0.25 --calibration-windows 64 --tag calibration64
    python benchmarks/compress.py --methods dense relational relational-residual slicegpt \
        --targets 0.1 0.2 0.25 0.3 0.4 0.5 --calibration-windows 64 --tag curve      # the quality curve

Writes <out-dir>/compress.json and compress.png (`compress_quick.*` with --quick), after every cell (atomically).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common import RESULTS, command_line, corpus, log_axis_in_plain_numbers, machine, without_paths
from domains import DESCRIPTIONS, DOMAINS, ratios

logger = logging.getLogger("compress")

METHODS = (
    "dense",
    "slicegpt",
    "wanda",
    "magnitude",
    "wanda-2:4",
    "magnitude-2:4",
    "slicegpt-untied",
    "slice",
    "relational",
    "relational-residual",
    "relational-greedy",
    "relational-fisher-metric",
    "relational-holdout",
    "relational-blend",
    "relational-blend0.25",
    "relational-ridge3e-3",
    "relational-refine",
    "relational-refine8",
    "relational-refine-lr1e-3",
    "relational-pivot",
    "relational-zero-prior",
    "relational-greedy-refine",
    "relational-score",
    "relational-norefine",
)
PROJECT_METHODS = METHODS[METHODS.index("slice") :]
# compress_model options of a method variant
PROJECT_OPTIONS = {
    "relational-residual": {"sensitivity": "token"},
    "relational-greedy": {"mlp_order": "greedy"},
    "relational-fisher-metric": {"fisher_metric": True},
    "relational-holdout": {"refit_holdout": 16},
    "relational-blend": {"refit_blend": 0.5},
    "relational-blend0.25": {"refit_blend": 0.25},
    "relational-ridge3e-3": {"ridge": 3e-3},
    "relational-refine": {"refine_epochs": 4},
    "relational-refine8": {"refine_epochs": 8},
    "relational-refine-lr1e-3": {"refine_lr": 1e-3},
    "relational-pivot": {"gauge": "pivot"},
    "relational-zero-prior": {"refit_prior": "zero"},
    "relational-greedy-refine": {"mlp_order": "greedy", "refine_epochs": 4},
    "relational-score": {"mlp_order": "score", "refine_epochs": 0},
    "relational-norefine": {"refine_epochs": 0},
}
#: calibration texts (`--calibration-text`): the benchmark's WikiText-2 windows (the user's text), text the source
#: samples itself (data-free), half of each, or a mixture of domains (WikiText-2, Tiny Shakespeare's first 90%, the
#: first 90% of the standard-library files, the source's own text: a quarter each)
#: "wikitext+added-self" keeps every WikiText-2 window and adds half as many sampled by the source (a third of the
#: total: the user's text loses no window to the mixture)
CALIBRATIONS = ("wikitext", "self", "wikitext+self", "domains", "wikitext+added-self")
SPLITS = ("forward", "reverse")
FIXED_PATTERN = ("magnitude-2:4", "wanda-2:4")
TARGETS = (0.1, 0.2, 0.25, 0.3)


def cell_key(method: str, target: float | None, calibration: str = "wikitext") -> str:
    key = method if target is None else f"{method}@{target:g}"
    return key if calibration == "wikitext" or method == "dense" else f"{key}~{calibration}"


def write_atomically(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def load_model(quick: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relational_hf.pretrained import smollm2_checkpoint

    folder = smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if quick:  # the first two decoder layers only
        model.model.layers = model.model.layers[:2]
        model.config.num_hidden_layers = 2
    return model, tokenizer


def protocol_windows(
    tokenizer, window: int, n_cal: int, n_eval: int, quick: bool, threads: int, split: str = "forward"
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(calibration windows, evaluation windows, protocol description) of the module docstring's protocol; `split`
    "reverse" calibrates on the last 90% of the documents and evaluates on the first 10%."""
    from relational_hf.compress.eval import text_windows

    text = corpus("wikitext-2")
    if split == "forward":
        calibration = text_windows(text, tokenizer, window=window, n=n_cal, split="first")
        evaluation = text_windows(text, tokenizer, window=window, n=n_eval, split="last")
        cal_part, eval_part, cut = "the first 90%", "the last 10%", "90%"
    else:
        calibration = text_windows(text, tokenizer, window=window, n=n_cal, split="last", fraction=0.9)
        evaluation = text_windows(text, tokenizer, window=window, n=n_eval, split="first", fraction=0.9)
        cal_part, eval_part, cut = "the last 90%", "the first 10%", "10%"
    protocol = {
        "model": "SmolLM2-135M-Instruct" + (" (first 2 layers)" if quick else ""),
        "text": f"WikiText-2 validation split, cut at the ' = Title = ' heading closest to {cut} (document_split)",
        "calibration": f"first {calibration.shape[0]} windows of {window} tokens of {cal_part} of the documents",
        "evaluation": f"first {evaluation.shape[0]} windows of {window} tokens of {eval_part} of the documents",
        "window": window,
        "calibration_windows": calibration.shape[0],
        "eval_windows": evaluation.shape[0],
        "threads": threads,
        "perplexity": "relational_hf.compress.eval.perplexity_on_windows (exp of mean token NLL, windows independent)",
        "stored_parameters": "relational_hf.compress.eval.stored_parameters (each stored tensor once)",
    }
    return calibration, evaluation, protocol


_WANDA_NORMS: list = []  # one calibration pass for every Wanda cell
_CURVES: dict = {}  # the relational methods' error curves, measured once per method for every target


def calibration_windows(name: str, model, tokenizer, wikitext: torch.Tensor, cache_dir: Path) -> tuple[torch.Tensor, str]:
    """(windows, description) of calibration text `name` (`CALIBRATIONS`), as many windows as `wikitext` holds and as
    long. The source's own samples are drawn once (`compress.calibration.sampled_calibration`, its default seed) and
    kept in `cache_dir` for the other variants and later runs."""
    from domains import calibration_part

    from relational_hf.compress.calibration import interleave, mixed_calibration, sampled_calibration
    from relational_hf.compress.distill import load_teacher_text, model_fingerprint, save_teacher_text

    n, window = wikitext.shape
    if name == "wikitext":
        return wikitext, "the benchmark's WikiText-2 calibration windows"
    path = cache_dir / f"self_text_{n}x{window}.safetensors"
    sampled = None
    if path.is_file():
        sampled, settings = load_teacher_text(path)
        stale = settings.get("source") != model_fingerprint(model) or settings.get("prompts", "generic") != "calibration"
        if stale or sampled.shape != (n, window):
            sampled = None
    if sampled is None:
        sampled, settings = sampled_calibration(model, tokenizer, n=n, window=window)
        cache_dir.mkdir(parents=True, exist_ok=True)
        save_teacher_text(path, sampled, settings)
    if name == "self":
        return sampled, f"{n} windows the source samples itself (compress.calibration.sampled_calibration)"
    if name == "wikitext+self":
        mixed, _ = mixed_calibration(wikitext, 0.5, n=n, sampled=sampled)
        return mixed, "half the WikiText-2 windows, half the source's own samples, interleaved"
    if name == "wikitext+added-self":
        mixed, _ = mixed_calibration(wikitext, 1 / 3, sampled=sampled)
        return mixed, f"all {n} WikiText-2 windows and {n // 2} of the source's own samples, interleaved"
    quarter = n // 4
    parts = [
        wikitext[:quarter],
        calibration_part("shakespeare", tokenizer, window, quarter),
        calibration_part("python", tokenizer, window, quarter),
        sampled[: n - 3 * quarter],
    ]
    return interleave(parts), "a quarter each: WikiText-2, Tiny Shakespeare's first 90%, the standard library's first " \
        "90% of files, the source's own samples; interleaved"


def relational_curves(method: str, model, calibration: torch.Tensor, options: dict, key: str | None = None):
    """The error curves of pass 1 (`lowrank.measure_error_curves`) of a relational method, measured on the first
    call and reused for the other targets (they do not depend on the budget); (curves, seconds spent now). `key`
    names the method and calibration the curves belong to (default: the method)."""
    key = key or method
    if key in _CURVES:
        return _CURVES[key], 0.0
    from relational_hf.compress.lowrank import LowRankOptions, measure_error_curves
    from relational_hf.convert.relational import to_relational

    start = time.perf_counter()
    rel = to_relational(copy.deepcopy(model)).float().eval()
    _CURVES[key] = measure_error_curves(rel, calibration, LowRankOptions(**options), progress=True)
    return _CURVES[key], time.perf_counter() - start


def compress(
    method: str, target: float | None, model, tokenizer, calibration: torch.Tensor, curves_key: str | None = None
) -> tuple[object, dict]:
    """(compressed model, details) for one cell."""
    from relational_hf.compress.baselines import prune_to_target, slicegpt, wanda_feature_norms

    if method == "dense":
        from relational_hf.lm.metrics import perplexity

        return model, {"calibration_perplexity_after": perplexity(model, calibration[:8])}
    score, pattern = method.split("-") if method in FIXED_PATTERN else (method, "unstructured")
    if score == "wanda" and not _WANDA_NORMS:
        _WANDA_NORMS.extend(wanda_feature_norms(model, calibration))
    norms = _WANDA_NORMS if score == "wanda" else None
    if method in ("magnitude", "wanda"):
        return prune_to_target(model, method, "unstructured", remove=target, feature_norms=norms)
    if method in FIXED_PATTERN:
        return prune_to_target(model, score, pattern, calibration=calibration, feature_norms=norms)
    if method in ("slicegpt", "slicegpt-untied"):
        head = "untied" if method == "slicegpt-untied" else "auto"
        sliced, report = slicegpt(model, calibration, remove=target, head=head)
        return sliced, report.to_dict()
    if method in PROJECT_METHODS:
        from relational_hf.jobs import compress_model  # ImportError: recorded as not available

        options = dict(PROJECT_OPTIONS.get(method, {}))
        base = method.split("-")[0]
        measured = 0.0
        if base == "relational":
            options["curves"], measured = relational_curves(method, model, calibration, options, curves_key)
        compressed, report = compress_model(
            copy.deepcopy(model), tokenizer, remove=target, method=base, calibration=calibration, **options
        )
        report["error_curves"] = (
            f"measured for this cell in {measured:.0f} s" if measured else "measured once for this method (first cell)"
        )
        return compressed, report
    raise ValueError(f"unknown method {method!r}")


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = payload["cells"].get("dense", {})
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    by_method: dict[str, list] = {}
    for cell in payload["cells"].values():
        if cell.get("perplexity") is None or cell["method"] == "dense":
            continue
        pruned = cell["method"].startswith(("magnitude", "wanda"))
        x = cell["nonzero_parameters"] if pruned else cell["stored_parameters"]
        by_method.setdefault(cell["method"], []).append((x / 1e6, cell["perplexity"]))
    for method, points in sorted(by_method.items()):
        points.sort()
        label = f"{method} (non-zeros; dense storage)" if method.startswith(("magnitude", "wanda")) else method
        ax.plot(*zip(*points), marker="o", label=label, linestyle="--" if "2:4" in method else "-")
    if dense.get("perplexity"):
        ax.axhline(dense["perplexity"], color="black", linewidth=1, label=f"dense ({dense['perplexity']:.2f})")
        ax.axvline(dense["stored_parameters"] / 1e6, color="grey", linewidth=0.8, linestyle=":")
    ax.set_yscale("log")
    log_axis_in_plain_numbers(ax.yaxis)
    ax.set_xlabel("stored parameters (millions; non-zeros for pruning)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(payload["protocol"]["model"] + ", WikiText-2 held-out documents")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def name_of_runs(json_path: Path) -> str:
    """The folder beside the results that keeps a run's cached inputs (ignored by git: `*_runs/`)."""
    return f"{json_path.stem}_runs"


def plot_domains(payload: dict, path: Path) -> None:
    """Each cell's perplexity as a multiple of dense on each domain (bars), with the targets' x1.35 and x1.6 lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(k, c) for k, c in payload["cells"].items() if c.get("domain_ratios")]
    if not cells:
        return
    names = [d for d in DOMAINS if any(d in c["domain_ratios"] for _, c in cells)]
    fig, ax = plt.subplots(figsize=(max(7.5, 1.2 * len(cells) + 3), 4.8))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cells))]
        ax.bar(xs, [c["domain_ratios"].get(name, float("nan")) for _, c in cells], width, label=name)
    ax.axhline(1.6, color="red", linewidth=0.8, linestyle="--", label="x1.6 (worst-domain target)")
    ax.axhline(1.35, color="grey", linewidth=0.8, linestyle=":", label="x1.35 (WikiText-2 target)")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([k.replace("~", "\ncal: ") for k, _ in cells], fontsize=8)
    ax.set_yscale("log")
    log_axis_in_plain_numbers(ax.yaxis)
    ax.set_ylabel("held-out perplexity / dense")
    ax.set_title(payload["protocol"]["model"] + ": compressed / dense perplexity by domain")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def domain_markdown(payload: dict) -> str:
    """The per-domain table: dense perplexity per domain, then each cell's ratio to it and the worst ratio."""
    dense = payload["cells"].get("dense", {}).get("domains") or {}
    names = [d for d in DOMAINS if d in dense]
    if not names:
        return ""
    lines = [
        "| cell | calibration | " + " | ".join(names) + " | worst of four |",
        "|---|---|" + "---:|" * (len(names) + 1),
        "| dense | - | " + " | ".join(f"{dense[d]:.2f}" for d in names) + " | |",
    ]
    for key, cell in payload["cells"].items():
        r = cell.get("domain_ratios")
        if not r:
            continue
        lines.append(
            f"| {key.split('~')[0]} | {cell.get('calibration_text', 'wikitext')} | "
            + " | ".join(f"x{r[d]:.2f}" if d in r else "" for d in names)
            + (f" | x{r['worst']:.2f} |" if "worst" in r else " | |")
        )
    return "\n".join(lines)


def markdown(payload: dict) -> str:
    """The README table: one row per method and target."""
    dense = payload["cells"].get("dense", {})
    base = dense.get("perplexity")
    lines = [
        "| method | target removed | stored parameters | non-zeros | perplexity | x dense | calibration ppl | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def order(item):
        cell = item[1]
        return (METHODS.index(cell["method"]) if cell["method"] in METHODS else 99, cell.get("target") or 0)

    for _, cell in sorted(payload["cells"].items(), key=order):
        target = "-" if cell.get("target") is None else f"{cell['target']:.0%}"
        if cell.get("perplexity") is None:
            lines.append(f"| {cell['method']} | {target} | | | {cell.get('status', 'not run')} | | | |")
            continue
        rel = "" if not base else f"x{cell['perplexity'] / base:.2f}"
        cal = (cell.get("details") or {}).get("calibration_perplexity_after")
        text = cell.get("calibration_text", "wikitext")
        label = cell["method"] + ("" if text == "wikitext" or cell["method"] == "dense" else f" (calibration: {text})")
        lines.append(
            f"| {label} | {target} | {cell['stored_parameters']:,} | {cell['nonzero_parameters']:,} "
            f"| {cell['perplexity']:.2f} | {rel} | {'' if cal is None else f'{cal:.2f}'} "
            f"| {cell.get('compress_seconds', 0):.0f} |"
        )
    p = payload["protocol"]
    lines.append("")
    lines.append(
        f"{p['model']}; calibration: {p['calibration']}; evaluation: {p['evaluation']}. "
        f"Wall time {payload.get('wall_seconds', 0) / 60:.1f} min"
        + (f" in {len(payload['merged_runs'])} runs" if payload.get("merged_runs") else "")
        + f" ({p['threads']} threads) on a shared 2-core machine."
    )
    return "\n".join(lines)


def merge(json_path: Path, png_path: Path, others: list[Path], parser: argparse.ArgumentParser) -> int:
    """Add the measured cells of `others` to `json_path` (kept where both measured a cell); the protocols must agree
    on calibration and evaluation. Each run's command and wall time is listed under "merged_runs"."""
    if not json_path.is_file():
        parser.error(f"{json_path} does not exist: nothing to merge into")
    payload = json.loads(json_path.read_text())
    runs = payload.setdefault(
        "merged_runs", [{"command": payload.get("command"), "wall_seconds": payload.get("wall_seconds")}]
    )
    for other_path in others:
        other = json.loads(other_path.read_text())
        for field in ("model", "calibration", "evaluation"):
            if other["protocol"][field] != payload["protocol"][field]:
                parser.error(f"--merge: {other_path} has another {field}: {other['protocol'][field]!r}")
        for key, cell in other["cells"].items():
            if cell.get("perplexity") is not None and payload["cells"].get(key, {}).get("perplexity") is None:
                payload["cells"][key] = cell
        command = without_paths(other.get("command") or "")
        runs.append({"command": command, "wall_seconds": other.get("wall_seconds")})
    payload["wall_seconds"] = sum(r["wall_seconds"] or 0.0 for r in runs)
    write_atomically(json_path, payload)
    plot(payload, png_path)
    print(markdown(payload))
    return 0


def resumed_payload(previous: dict | None, protocol: dict, command: str) -> dict:
    """The JSON a run starts from: empty, or with --resume (`previous`: the earlier JSON) its measured cells and wall
    time, and the earlier runs' commands in `earlier_commands` (oldest first), so that a resumed file still names every
    command that measured its cells (each new cell also records its own). ValueError when `previous` was measured on
    other evaluation windows."""
    payload = {"protocol": protocol, "cells": {}, "command": command}
    if previous is None:
        return payload
    if previous.get("protocol", {}).get("evaluation") != protocol["evaluation"]:
        raise ValueError("was measured with another protocol")
    payload["cells"] = {k: v for k, v in previous["cells"].items() if v.get("perplexity") is not None}
    earlier_texts = previous.get("protocol", {}).get("calibration_texts") or {}
    if earlier_texts:  # the calibration texts of the kept cells stay described
        protocol["calibration_texts"] = earlier_texts | protocol.get("calibration_texts", {})
    payload["wall_seconds"] = previous.get("wall_seconds", 0.0)
    earlier = [*previous.get("earlier_commands", []), previous.get("command")]
    payload["earlier_commands"] = [c for c in earlier if c]
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, short windows (about a minute)")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        metavar="METHOD",
        help=f"of {', '.join(METHODS)}",
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        type=float,
        default=None,
        help="shares removed, in (0, 1) (default 0.1 0.2 0.25 0.3; quick 0.1)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--resume", action="store_true", help="keep the cells already measured in the JSON")
    parser.add_argument("--markdown", action="store_true", help="print the README table from the JSON and exit")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="add the measured cells of other runs' JSON files (same protocol, e.g. run concurrently) and exit",
    )
    parser.add_argument("--window", type=int, default=None, help="tokens per window (default 512; quick 128)")
    parser.add_argument("--calibration-windows", type=int, default=None, help="default 16 (quick 4)")
    parser.add_argument("--eval-windows", type=int, default=None, help="default 12 (quick 4)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--calibration-text", nargs="+", default=["wikitext"], choices=CALIBRATIONS, metavar="TEXT",
        help=f"calibration texts to measure each project method with, of {', '.join(CALIBRATIONS)} (default "
        "wikitext); cells of another text than wikitext are keyed METHOD@TARGET~TEXT",
    )
    parser.add_argument(
        "--domains", nargs="*", default=None, metavar="DOMAIN",
        help="evaluation domains besides the WikiText-2 windows, of " + ", ".join(DOMAINS[1:]) + " (default: all; "
        "none with an empty list); each cell reports its perplexity and ratio to dense on each",
    )
    parser.add_argument("--tag", default="", help="suffix of the result files (compress_TAG.json), e.g. for another protocol")
    parser.add_argument(
        "--split", choices=SPLITS, default="forward",
        help="forward: calibrate on the first 90%% of the documents, evaluate on the last 10%% (default); reverse: "
        "calibrate on the last 90%%, evaluate on the first 10%% (a robustness check; use its own --tag)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.targets is None:
        args.targets = [0.1] if args.quick else list(TARGETS)
    if any(not 0.0 < t < 1.0 for t in args.targets):
        parser.error("--targets must be shares in (0, 1)")
    name = "compress_quick" if args.quick else "compress"
    name = f"{name}_{args.tag}" if args.tag else name
    json_path, png_path = args.out_dir / f"{name}.json", args.out_dir / f"{name}.png"
    if args.markdown:
        if not json_path.is_file():
            parser.error(f"{json_path} does not exist: run the benchmark first")
        print(markdown(json.loads(json_path.read_text())))
        print(domain_markdown(json.loads(json_path.read_text())))
        return 0
    if args.merge:
        return merge(json_path, png_path, args.merge, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    window = args.window or (128 if args.quick else 512)
    n_cal = args.calibration_windows or (4 if args.quick else 16)
    n_eval = args.eval_windows or (4 if args.quick else 12)

    from relational_hf.compress.eval import perplexity_on_windows, stored_parameters

    model, tokenizer = load_model(args.quick)
    calibration, evaluation, protocol = protocol_windows(
        tokenizer, window, n_cal, n_eval, args.quick, args.threads, split=args.split
    )
    domains = list(DOMAINS[1:]) if args.domains is None else args.domains
    unknown = [d for d in domains if d not in DOMAINS[1:]]
    if unknown:
        parser.error(f"--domains: unknown {unknown}; known: {', '.join(DOMAINS[1:])}")
    domain_eval = {"wikitext": evaluation}
    from domains import domain_windows

    for name in domains:
        domain_eval[name] = domain_windows(name, model, tokenizer, window, evaluation.shape[0], evaluation)
    protocol["domains"] = {
        name: {"what": DESCRIPTIONS[name], "windows": list(ids.shape)} for name, ids in domain_eval.items()
    }
    cal_texts: dict[str, tuple[torch.Tensor, str]] = {}
    cache_dir = args.out_dir / f"{name_of_runs(json_path)}"
    for text in args.calibration_text:
        cal_texts[text] = calibration_windows(text, model, tokenizer, calibration, cache_dir)
    protocol["calibration_texts"] = {text: what for text, (_, what) in cal_texts.items()}
    previous = json.loads(json_path.read_text()) if args.resume and json_path.is_file() else None
    try:
        payload = resumed_payload(previous, protocol, command_line("compress.py", argv))
    except ValueError as err:
        parser.error(f"--resume: {json_path} {err}")
    payload["machine"] = machine()
    started = time.perf_counter()
    prior_wall = payload.get("wall_seconds", 0.0)
    cells = [
        (m, None if m in FIXED_PATTERN or m == "dense" else t, c)
        for m in args.methods
        for c in (args.calibration_text if m in PROJECT_METHODS else ["wikitext"])
        for t in (args.targets if m not in FIXED_PATTERN and m != "dense" else [None])
    ]
    seen = set()
    dense_total = stored_parameters(model)["total"]
    for method, target, text in cells:
        key = cell_key(method, target, text)
        if key in seen or (key in payload["cells"] and args.resume):
            continue
        seen.add(key)
        logger.info("cell %s", key)
        cell = {"method": method, "target": target, "calibration_text": text}
        t0 = time.perf_counter()
        curves_key = ("relational" if method == "relational-norefine" else method) + f"~{text}"
        try:
            compressed, details = compress(method, target, model, tokenizer, cal_texts[text][0], curves_key)
        except ImportError as err:
            cell.update(status="not available", error=str(err))
        except ValueError as err:  # a target the method cannot reach (e.g. pruning a 2-layer quick model)
            cell.update(status="not reachable", error=str(err))
        else:
            t1 = time.perf_counter()
            counts = stored_parameters(compressed)
            ppl = perplexity_on_windows(compressed, evaluation, batch_size=2, progress=True)
            by_domain = {"wikitext": ppl}
            for name in domains:
                by_domain[name] = perplexity_on_windows(compressed, domain_eval[name], batch_size=2, progress=True)
            dense_domains = payload["cells"].get("dense", {}).get("domains") or {}
            cell.update(
                domains=by_domain,
                domain_ratios=ratios(by_domain, dense_domains) if method != "dense" else {},
            )
            cell.update(
                status="ok",
                perplexity=ppl,
                stored_parameters=counts["total"],
                nonzero_parameters=counts["nonzero"],
                removed_share_stored=1 - counts["total"] / dense_total,
                removed_share_nonzero=1 - counts["nonzero"] / dense_total,
                by_kind=counts["by_kind"],
                compress_seconds=t1 - t0,
                eval_seconds=time.perf_counter() - t1,
                peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
                details=details,
                command=payload["command"],
            )
            del compressed
            logger.info("%s: %d stored, ppl %.3f; by domain %s", key, counts["total"], ppl, by_domain)
        if cell.get("perplexity") is None:
            logger.info("%s: %s (%s)", key, cell["status"], cell.get("error"))
        payload["cells"][key] = cell
        payload["wall_seconds"] = prior_wall + time.perf_counter() - started
        write_atomically(json_path, payload)
        plot(payload, png_path)
        if domains:
            plot_domains(payload, png_path.with_name(png_path.stem + "_domains.png"))
    payload["wall_seconds"] = prior_wall + time.perf_counter() - started
    write_atomically(json_path, payload)
    plot(payload, png_path)
    print(markdown(payload))
    print(domain_markdown(payload))
    logger.info("wrote %s and %s in %.1f min", json_path, png_path, (time.perf_counter() - started) / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
