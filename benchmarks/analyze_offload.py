"""The directional analysis of a checkpoint larger than the memory it may use: peak resident memory and time of
`relational-hf analyze --max-memory` (disk offload, `relational_hf.lm.offload`) against the same analysis with the
whole model in memory, side by side in one run, on a generated Llama-shaped bf16 checkpoint.

The checkpoint is the convert benchmark's (`benchmarks/convert.py` `generate_checkpoint`: random bf16 weights of the
named shape, 32k vocabulary, sharded safetensors). The text is `--text`'s UTF-8 bytes used as token ids (the generated
checkpoint has no tokenizer; the weights are random, so the figures of the report mean nothing: this measures memory
and time). Each analysis runs as its own `relational-hf analyze` process (its peak resident memory, VmHWM, is the
report's `peak_rss_mib`), one after the other; the results of the two must agree, and the benchmark checks that they do.

    python benchmarks/analyze_offload.py --size 7B --layers 8 --workdir DIR     # analyze_offload_7B_8layers.json/.png
    python benchmarks/analyze_offload.py --quick                                # the 10M shape, a few seconds

The analysis is kept short (--max-tokens, --seq-len, one sweep value, two compression settings by default): every
pass of it reads the offloaded layers again, so the time grows with the passes, the memory does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, SHARED_DATA, add_shape_arguments, save_figure, shape_tag, write_json
from convert import CONVERT_SIZES, generate_checkpoint

TARGET_MIB = 6 * 1024
DEFAULT_TEXT = SHARED_DATA / "wikitext-2" / "valid.txt"


def _analysis(src: Path, out: Path, text: Path, args, offload: str | None) -> dict:
    """One `relational-hf analyze` process; its report with the wall time."""
    command = [sys.executable, "-m", "relational_hf.commands", "analyze", str(src), "--text", str(text)]
    command += ["--out", str(out), "--dtype", args.dtype, "--max-tokens", str(args.max_tokens)]
    command += ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    command += ["--per-layer-tokens", str(args.seq_len), "--sweep-values", "0"]
    command += ["--per-layer-values", *args.per_layer_values]
    command += ["--compression", *args.compression]
    for flag, values in (
        ("--sites", args.sites),
        ("--per-layer-sites", args.per_layer_sites),
        ("--per-layer-perpendicular", args.per_layer_perpendicular),
    ):
        command += [flag, *values] if values is not None else []  # None: the command's default
    if offload is not None:
        command += ["--max-memory", offload]
    start = time.perf_counter()
    child = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    peaks = _watch_memory(child)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, command)
    report = json.loads((out / "report.json").read_text())
    report["wall_seconds"] = time.perf_counter() - start
    report["peak_rss_kinds_mib"] = peaks
    return report


def _watch_memory(child: subprocess.Popen, interval: float = 0.05) -> dict[str, float]:
    """Wait for `child`, sampling its /proc status every `interval` s: the largest anonymous and file-backed
    resident memory seen (MiB). VmHWM, the report's peak, counts both; the file-backed part (pages of memory-mapped
    files, such as the safetensors shards Transformers maps while it loads) is clean page cache the kernel takes back
    under pressure, the anonymous part is what the process really holds."""
    peaks = {"RssAnon": 0.0, "RssFile": 0.0}
    status = Path(f"/proc/{child.pid}/status")
    while child.poll() is None:
        try:
            for line in status.read_text().splitlines():
                key = line.split(":")[0]
                if key in peaks:
                    peaks[key] = max(peaks[key], int(line.split()[1]) / 1024)
        except (OSError, ValueError, IndexError):
            pass  # not Linux, or the process is ending
        time.sleep(interval)
    return {"anonymous": round(peaks["RssAnon"], 1), "file_backed": round(peaks["RssFile"], 1)}


def memory_limit() -> dict[str, float | None]:
    """The memory limit of this process's control group and its peak usage so far (bytes; cgroup v2 memory.max and
    memory.peak, or v1 memory.limit_in_bytes and memory.max_usage_in_bytes; None where there is none or it cannot be
    read). A run under a limit that completes shows the whole process tree, page cache included, fitted in it."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {"limit_bytes": None, "peak_usage_bytes": None}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, files = Path("/sys/fs/cgroup") / path.lstrip("/"), ("memory.max", "memory.peak")
        elif "memory" in controllers.split(","):  # v1
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            files = ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
        else:
            continue
        values = []
        for name in files:
            try:
                text = (base / name).read_text().strip()
                values.append(None if text == "max" or int(text) >= 2**62 else int(text))
            except (OSError, ValueError):
                values.append(None)
        if values[0] is not None:
            return {"limit_bytes": values[0], "peak_usage_bytes": values[1]}
    return {"limit_bytes": None, "peak_usage_bytes": None}


def _numbers(value, path: str = "") -> dict[str, float]:
    """The measured numbers of a report by where they sit (timings, memory and placement left out)."""
    skip = {"timings_s", "peak_rss_mib", "peak_rss_kinds_mib", "device_map", "offloaded", "figures", "wall_seconds"}
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() if key not in skip for k, v in _numbers(item, f"{path}/{key}").items()
        }
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _numbers(item, f"{path}/{i}").items()}
    return {path: float(value)} if isinstance(value, (int, float)) and not isinstance(value, bool) else {}


def _largest_difference(a: dict, b: dict) -> float:
    """The largest relative difference between the numbers of two reports (inf where they hold different numbers)."""
    x, y = _numbers(a), _numbers(b)
    if x.keys() != y.keys():
        return math.inf
    return max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-6) for k in x)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    names = list(runs)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.bar(names, [runs[n]["peak_rss_mib"] / 1024 for n in names], color="tab:gray", label="peak RSS (VmHWM)")
    kinds = [runs[n].get("peak_rss_kinds_mib") for n in names]
    if all(kinds):  # runs from before the memory kinds were sampled have none
        ax.bar(names, [k["anonymous"] / 1024 for k in kinds], width=0.4, color="tab:green", label="largest anonymous")
    limit = (payload.get("memory_cgroup") or {}).get("limit_bytes")
    if limit:
        ax.axhline(limit / 2**30, color="black", linestyle=":", label=f"cgroup limit {limit / 2**30:.1f} GiB")
    ax.axhline(TARGET_MIB / 1024, color="red", linestyle="--", label="target 6 GiB")
    ax.set_ylabel("peak RSS (GiB)")
    ax.set_title(f"{payload['size']}, {payload['shape']['num_hidden_layers']} layers: analyze")
    ax.legend()
    stages = list(runs[names[0]]["timings_s"])
    bottom = [0.0] * len(names)
    for stage in stages:
        values = [runs[n]["timings_s"].get(stage, 0.0) for n in names]
        bx.bar(names, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    bx.set_ylabel("seconds")
    bx.set_title("time by stage")
    bx.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, CONVERT_SIZES)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--max-memory", default=None, help="the offloaded run's --max-memory (default: 1.5 layers)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--compression", nargs="+", default=["int8", "wanda"])
    # the analysis' sites and per-layer control, passed to `relational-hf analyze` when given (default: its own)
    parser.add_argument("--sites", nargs="+", default=None)
    parser.add_argument("--per-layer-sites", nargs="+", default=None)
    parser.add_argument("--per-layer-perpendicular", nargs="+", default=None, help="none: skip the control")
    parser.add_argument("--per-layer-values", nargs="+", default=["0"], help="none (and --per-layer-perpendicular none): no per-layer edits")
    parser.add_argument("--suffix", default="", help="appended to the results' file name")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-memory-run", action="store_true", help="only the offloaded run")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    size, tag = shape_tag(args)
    json_path = RESULTS / f"analyze_offload_{tag}{args.suffix}.json"
    png_path = json_path.with_suffix(".png")
    if args.plot_only:
        plot(json.loads(json_path.read_text()), png_path)
        return 0
    if not args.text.is_file():
        parser.error(f"--text {args.text} is not a file")
    shape = CONVERT_SIZES[size] | ({"num_hidden_layers": args.layers} if args.layers else {})
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="analyze-offload-"))
    src = workdir / f"llama-{tag}-bf16"
    if not (src / "config.json").is_file():
        generate_checkpoint(size, src, seed=0, layers=args.layers)
    width = 4 if args.dtype == "float32" else 2
    d, ff = shape["hidden_size"], shape["intermediate_size"]
    kv = d // shape["num_attention_heads"] * shape.get("num_key_value_heads", shape["num_attention_heads"])
    layer_bytes = (2 * d * d + 2 * d * kv + 3 * d * ff) * width
    embed_bytes = shape["vocab_size"] * d * width
    budget = args.max_memory or str(embed_bytes + layer_bytes * 3 // 2)
    runs = {}
    plans = ([] if args.skip_memory_run else [("in memory", None)]) + [("offloaded", budget)]
    for name, offload in plans:
        out = workdir / f"analysis-{tag}-{name.replace(' ', '-')}"
        if out.exists():
            shutil.rmtree(out)  # this benchmark's own output of an earlier run
        report = _analysis(src, out, args.text, args, offload)
        runs[name] = {
            "peak_rss_mib": report["peak_rss_mib"],
            "peak_rss_kinds_mib": report["peak_rss_kinds_mib"],
            "wall_seconds": report["wall_seconds"],
            "timings_s": report["timings_s"],
            "device_map": report["device_map"],
            "perplexity": report["perplexity"],
            # time per layer: each stage's seconds over the layers (the per-layer edits rerun layers l..L-1, so
            # theirs grows with the square of the depth)
            "seconds_per_layer": {
                stage: seconds / shape["num_hidden_layers"] for stage, seconds in report["timings_s"].items()
            },
            "report": report,
        }
        shutil.rmtree(out)
    agreement = (
        _largest_difference(runs["in memory"]["report"], runs["offloaded"]["report"]) if len(runs) == 2 else None
    )
    for run in runs.values():
        run.pop("report")
    payload = {
        "size": size,
        "shape": shape,
        "dtype": args.dtype,
        "max_memory": budget,
        "settings": {  # None: the command's default
            k: getattr(args, k)
            for k in ("max_tokens", "seq_len", "batch_size", "compression", "threads")
            + ("sites", "per_layer_sites", "per_layer_perpendicular", "per_layer_values")
        },
        "source_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors")),
        "target_peak_mib": TARGET_MIB,
        "memory_cgroup": memory_limit(),
        "largest_relative_difference": agreement,
        "runs": runs,
    }
    write_json(json_path.stem, payload)
    plot(payload, png_path)
    for name, run in runs.items():
        print(
            f"{name}: peak RSS {run['peak_rss_mib']:,.0f} MiB (largest anonymous / file-backed parts seen: "
            f"{run['peak_rss_kinds_mib']}), {run['wall_seconds']:.0f} s, device map {run['device_map']}"
        )
    if agreement is not None:
        print(f"largest relative difference between the two reports: {agreement:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
