"""The command line a user runs to compress and repair a real model, timed, with its dense control beside it:

    relational-hf compress SRC OUT --remove 0.25 --calibration FILE --heal-steps 200 --eval HELD_OUT

SRC is SmolLM2-135M-Instruct (`python -m relational_hf.pretrained`), FILE the first 90% of the WikiText-2 validation
documents and HELD_OUT the last 10% (`relational_hf.lm.data.document_split`, whole documents on each side), written
into --workdir as text files. The command runs as its own process with the CLI's defaults (distillation from SRC on
text SRC samples itself, cached in OUT as heal_text.safetensors, and on the calibration windows, half of the blocks
from each; 20 held-out windows of 512 tokens); its wall time
and peak RSS are recorded (target: under 45 minutes on 2 cores, --eval's two evaluations included), with
OMP_NUM_THREADS set to the cores available (what the command chooses on an idle machine; left alone, it counts the
cores busy at the instant it starts, and a process winding down then made one timed run single-threaded). Then the
control: SRC, converted exactly to the relational form, healed with `relational_hf.training.heal.heal` with the
settings the command's report records, on the same cached teacher text and calibration windows, and measured on the same held-out windows
before and after. The healing must repair the compressed model (target: within x1.10 of the dense model) while leaving
the dense model within 2% of itself.

    python benchmarks/heal_cli.py --workdir DIR            # the timed command, then the control (about an hour)
    python benchmarks/heal_cli.py --workdir DIR --reuse    # the control only, on DIR/compressed of an earlier run
    python benchmarks/heal_cli.py --workdir DIR --heal-lr 1e-3 --tag lr1e-3   # the command with --heal-lr 1e-3
    python benchmarks/heal_cli.py --workdir DIR --control-from heal_cli_calibration64   # reuse an earlier control
    python benchmarks/heal_cli.py --workdir DIR --correction local --tag local   # the command with --correction local
    python benchmarks/heal_cli.py --workdir DIR --heal-on-calibration --tag calibration_text   # --heal-text FILE
    python benchmarks/heal_cli.py --workdir DIR --heal-batch-size 6 --tag batch6   # the command with --heal-batch-size 6

The control depends on SRC, the healing settings, the healing text and the evaluation windows alone, not on the
compressed model, so --control-from NAME takes it from results/NAME.json when these and the dense perplexity match
the command's report (refused otherwise, naming what differs).

Writes results/heal_cli.json and heal_cli.png (`heal_cli_TAG.*` with --tag; the command's own time and memory are
kept in DIR/command.json, so a --reuse run reports them too).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, corpus, save_figure, write_json

TARGET_SECONDS = 45 * 60


def _texts(workdir: Path) -> tuple[Path, Path]:
    """The calibration side (first 90% of the documents) and the held-out side (last 10%) as text files."""
    from relational_hf.lm.data import document_split

    first, last = document_split(corpus("wikitext-2").read_text(encoding="utf-8"), 0.1)
    paths = workdir / "wikitext2_first90.txt", workdir / "wikitext2_last10.txt"
    for path, text in zip(paths, (first, last), strict=True):
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    return paths


def _run_command(
    src: Path, out: Path, calibration: Path, held_out: Path, steps: int, remove: float, heal_lr: float | None,
    windows: int | None = None,
    heal_text: Path | None = None,
    correction: str | None = None,
    heal_batch_size: int | None = None,
) -> dict:
    from relational_hf.commands.main import available_cores

    command = [sys.executable, "-m", "relational_hf.commands", "compress", str(src), str(out), "--remove", str(remove)]
    command += ["--calibration", str(calibration), "--heal-steps", str(steps), "--eval", str(held_out)]
    extra = [] if heal_lr is None else ["--heal-lr", f"{heal_lr:g}"]
    extra += [] if windows is None else ["--calibration-windows", str(windows)]
    extra += [] if heal_text is None else ["--heal-text", str(heal_text)]
    extra += [] if correction is None else ["--correction", correction]
    extra += [] if heal_batch_size is None else ["--heal-batch-size", str(heal_batch_size)]
    # the command picks its torch threads from the cores idle when it starts, once for its whole run: a process still
    # winding down at that instant made one timed run single-threaded. The benchmark times the idle machine's choice.
    threads = os.environ.get("OMP_NUM_THREADS") or str(available_cores())
    start = time.perf_counter()
    subprocess.run(command + extra, check=True, env=dict(os.environ, OMP_NUM_THREADS=threads))
    line = f"relational-hf compress SRC OUT --remove {remove:g} --calibration FILE --heal-steps {steps} --eval HELD_OUT"
    shown = ["FILE" if part == str(heal_text) else part for part in extra]
    return {
        "line": " ".join([line, *shown]),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "cpus": os.cpu_count(),
        "threads": int(threads),
    }


def _control(
    src: Path, out: Path, held_out: Path, report: dict, calibration: Path, heal_text: Path | None = None
) -> dict:
    """The dense model through the same healing, on the same text (the cached teacher text, or `heal_text` tokenised
    as the command does, with the share of calibration windows the report records), measured on the same windows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relational_hf.compress.distill import healing_stream, load_teacher_text
    from relational_hf.compress.eval import text_windows
    from relational_hf.convert import to_relational
    from relational_hf.lm.metrics import perplexity
    from relational_hf.training.heal import heal

    tokenizer = AutoTokenizer.from_pretrained(src)
    window, windows = report["eval_windows"][1], report["eval_windows"][0]
    evaluation = text_windows(held_out, tokenizer, window=window, n=windows)
    teacher = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    dense = to_relational(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())
    before = perplexity(dense, evaluation, progress=True)
    settings = report["heal"]
    share = (settings.get("text") or {}).get("calibration_share", 0.0)
    if heal_text is not None:
        ids = text_windows(heal_text, tokenizer, window=window, n=1_000_000)
    else:
        ids = load_teacher_text(out / "heal_text.safetensors")[0] if share < 1.0 else None
    if share:
        windows = text_windows(calibration, tokenizer, window=window, n=report["calibration_windows"][0])
        ids, _ = healing_stream(ids, windows, share)
    healed, heal_report = heal(
        dense, ids, steps=settings["steps"], loss=settings["loss"], teacher=teacher, heal_lr=settings["learning_rate"],
        heal_rank=settings["lora_rank"], heal_batch_size=settings["batch_size"], heal_block_size=settings["block_size"],
    )  # fmt: skip
    return {
        "what": "SRC converted exactly to the relational form, healed with the command's settings and "
        + ("teacher text" if heal_text is None else "--heal-text FILE")
        + (f", {share:.0%} of it calibration windows" if share else ""),
        "perplexity_before": before,
        "perplexity_after": perplexity(healed, evaluation, progress=True),
        "heal": heal_report,
    }


#: What the control depends on: the healing settings and the teacher text's settings (its seconds aside).
_CONTROL_KEYS = ("loss", "steps", "lora_rank", "learning_rate", "batch_size", "block_size")


def _control_inputs(report: dict) -> dict:
    heal = report.get("heal") or {}
    text = heal.get("text")
    text = {k: v for k, v in text.items() if k != "seconds"} if isinstance(text, dict) else text
    return {"heal": {k: heal.get(k) for k in _CONTROL_KEYS}, "text": text, "eval_windows": report.get("eval_windows")}


def _reused_control(path: Path, report: dict) -> dict:
    """The control of an earlier result whose healing settings, teacher text and evaluation windows are this run's;
    ValueError naming what differs otherwise."""
    earlier = json.loads(path.read_text())
    old, new = _control_inputs(earlier["command_report"]), _control_inputs(report)
    differ = [k for k in new if old[k] != new[k]]
    dense_old, dense_new = earlier["control"]["perplexity_before"], report.get("eval_perplexity_before")
    if dense_new is None or abs(dense_old / dense_new - 1) > 1e-4:
        differ.append(f"dense perplexity ({dense_old} against {dense_new})")
    if differ:
        raise ValueError(f"{path.name} was measured with other {', '.join(differ)}: run the control instead")
    return {**earlier["control"], "reused_from": path.name}


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, c = payload["command_report"], payload["control"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    labels = ["dense", "dense + healing\n(control)", "compressed", "compressed\n+ healing"]
    values = [
        c["perplexity_before"],
        c["perplexity_after"],
        r["eval_perplexity_compressed"],
        r["eval_perplexity_after"],
    ]
    colors = ["tab:gray", "tab:green", "tab:orange", "tab:blue"]
    if values[2] is None:  # a command run before the report held it
        del labels[2], values[2], colors[2]
    ax.bar(labels, values, color=colors)
    dense = c["perplexity_before"]
    ax.axhline(1.10 * dense, color="red", linestyle="--", label="target x1.10 of dense")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2f} (x{v / dense:.2f})", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("held-out WikiText-2 perplexity")
    lr = r["heal"]["learning_rate"]
    text = "the calibration text" if "healing: the calibration text" in payload["texts"] else "text SRC samples itself"
    settings = r["heal"].get("text")  # a dict since the reports record the text's settings
    share = settings.get("calibration_share") if isinstance(settings, dict) else None
    if share == 1.0:
        text = "the calibration windows"
    elif share:
        text += f" ({share:.0%} calibration windows)"
    ax.set_title(f"{payload['steps']} distillation steps (lr {lr:g}) on {text}, {payload['remove']:.0%} removed", fontsize=10)
    ax.legend()
    bx.bar(["command"], [payload["command_run"]["wall_seconds"] / 60], color="tab:purple")
    bx.axhline(TARGET_SECONDS / 60, color="red", linestyle="--", label="target 45 min")
    bx.set_ylabel("minutes")
    bx.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where the texts, OUT and the timing are kept (required)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--remove", type=float, default=0.25)
    parser.add_argument("--heal-lr", type=float, default=None, help="--heal-lr for the command (default: its own)")
    parser.add_argument("--calibration-windows", type=int, default=None, help="for the command (default: its own)")
    parser.add_argument("--heal-batch-size", type=int, default=None, help="for the command (default: its own)")
    parser.add_argument(
        "--correction", choices=("dense", "local", "none"), default=None, help="for the command (default: its own)"
    )
    parser.add_argument(
        "--heal-on-calibration", action="store_true", help="--heal-text FILE for the command: distil on the calibration text"
    )
    parser.add_argument("--tag", default=None, help="write results/heal_cli_TAG.json instead")
    parser.add_argument("--reuse", action="store_true", help="the control only, on DIR/compressed of an earlier run")
    parser.add_argument("--control-from", metavar="NAME", help="take the control from results/NAME.json (see above)")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    if args.heal_lr is not None and not 0.0 < args.heal_lr < 1.0:
        parser.error("--heal-lr must be in (0, 1)")
    if args.heal_batch_size is not None and args.heal_batch_size < 1:
        parser.error("--heal-batch-size must be >= 1")
    name = "heal_cli" + (f"_{args.tag}" if args.tag else "")
    json_path = RESULTS / f"{name}.json"
    if args.plot_only:
        plot(json.loads(json_path.read_text()), json_path.with_suffix(".png"))
        return 0
    if args.workdir is None:
        parser.error("--workdir is required (where the texts, OUT and the timing are kept)")
    if args.control_from and not (RESULTS / f"{args.control_from}.json").is_file():  # before any model or text loads
        parser.error(f"--control-from {args.control_from}: no results/{args.control_from}.json")
    from relational_hf.pretrained import smollm2_checkpoint

    src = Path(smollm2_checkpoint())
    args.workdir.mkdir(parents=True, exist_ok=True)
    calibration, held_out = _texts(args.workdir)
    out, timing = args.workdir / "compressed", args.workdir / "command.json"
    if not args.reuse:
        if out.exists():
            parser.error(f"{out} exists: pass --reuse to measure the control on it, or another --workdir")
        run = _run_command(
            src, out, calibration, held_out, args.steps, args.remove, args.heal_lr, args.calibration_windows,
            calibration if args.heal_on_calibration else None, args.correction, args.heal_batch_size,
        )  # fmt: skip
        timing.write_text(json.dumps(run, indent=2))
    if not timing.is_file() or not (out / "compression_report.json").is_file():
        parser.error(f"--reuse: {args.workdir} holds no finished command run (command.json, compressed/)")
    report = json.loads((out / "compression_report.json").read_text())
    command = json.loads(timing.read_text())
    if args.control_from:
        try:
            control = _reused_control(RESULTS / f"{args.control_from}.json", report)
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--control-from {args.control_from}: {error}")
    else:
        control = _control(src, out, held_out, report, calibration, calibration if args.heal_on_calibration else None)
    keys = ("parameters_before", "parameters_after", "removed_share", "eval_windows", "eval_perplexity_before",
            "eval_perplexity_after", "eval_perplexity_compressed", "heal", "widths")  # fmt: skip
    payload = {
        "steps": args.steps,
        "remove": args.remove,
        "texts": "calibration: the first 90% of the WikiText-2 validation documents; held out: the last 10%"
        + ("; healing: the calibration text" if args.heal_on_calibration else "; healing: text SRC samples itself"),
        "command_run": command,  # the timed command line ("command" is the benchmark's own, `write_json`)
        "target_seconds": TARGET_SECONDS,
        "command_report": {k: report.get(k) for k in keys},
        "control": control,
    }
    write_json(name, payload)
    plot(payload, json_path.with_suffix(".png"))
    dense = control["perplexity_before"]
    print(
        f"command: {command['wall_seconds'] / 60:.1f} min (target 45), peak RSS {command['peak_rss_mib']:,.0f} MiB; held-out "
        f"perplexity dense {dense:.2f}, compressed {report.get('eval_perplexity_compressed')} -> healed "
        f"{report['eval_perplexity_after']:.2f} (x{report['eval_perplexity_after'] / dense:.2f}); control: dense healed "
        f"{control['perplexity_after']:.2f} ({control['perplexity_after'] / dense - 1:+.1%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
