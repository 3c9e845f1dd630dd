"""Compression of a checkpoint larger than the memory it may use: peak resident memory and time per layer of the
layer-streamed `compress` (`relational_hf.jobs.compress_checkpoint`) on a generated Llama-shaped bf16 checkpoint.

The checkpoint is the convert benchmark's (`benchmarks/convert.py` `generate_checkpoint`: random bf16 weights of the
named shape, 32k vocabulary, sharded safetensors; 7B = the Llama-2-7B shape, untied head, 13.5 GB on disk). The
calibration is `--windows` windows of `--window` random token ids (the weights are random, so the quality figures
mean nothing here: this measures memory and time). The compression runs in a child process, so its peak resident
memory (VmHWM) is its own; the parent waits. The target of the issue: under 6 GiB for the 7B shape.

    python benchmarks/compress_stream.py --size 7B --workdir /big/disk      # writes compress_stream_7B.json / .png
    python benchmarks/compress_stream.py --size 7B --layers 4               # the 7B layer shape, 4 layers deep
    python benchmarks/compress_stream.py --quick                            # the 10M shape, a few seconds

Options of the compression are the CLI defaults unless given (`--qk-step`, `--vo-step`, `--mlp-step`: coarser
grids of candidate widths cost less time per layer and no memory). The checkpoint is kept in --workdir for reruns.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, RSSTrace, add_shape_arguments, peak_rss_mib, save_figure, shape_tag, write_json
from convert import CONVERT_SIZES, generate_checkpoint

TARGET_MIB = 6 * 1024


def _child(src: str, out: str, settings: str) -> None:
    """Run in the child process: one streamed compression, its report (with VmHWM) as JSON on stdout."""
    import torch

    from relational_hf.jobs import compress_checkpoint

    cfg = json.loads(settings)
    torch.set_num_threads(cfg.pop("threads"))
    vocab = json.loads((Path(src) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (cfg.pop("windows"), cfg.pop("window")), generator=g)
    start = time.perf_counter()
    with RSSTrace() as trace:
        report = compress_checkpoint(src, out, calibration=ids, progress=True, **cfg)
    report["wall_seconds"] = time.perf_counter() - start
    report["rss_trace"] = trace.coarse()  # [(s, MiB)]: the largest sample of each second (of each run of seconds)
    report["vm_hwm_mib"] = peak_rss_mib()
    print("REPORT " + json.dumps(report))


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = payload["report"]
    layers = report["layer_seconds"]
    trace = report.get("rss_trace")
    fig, axes = plt.subplots(1, 3 if trace else 2, figsize=(18 if trace else 12, 4),
                             gridspec_kw={"width_ratios": [3, 3, 1] if trace else [3, 1]})  # fmt: skip
    ax, bx = axes[0], axes[-1]
    bottom = [0.0] * len(layers)
    for key, color in (("fisher", "tab:purple"), ("measure", "tab:blue"), ("compress", "tab:orange")):
        values = [s.get(key, 0.0) for s in layers]
        ax.bar(range(len(layers)), values, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("seconds")
    ax.set_title(f"{payload['size']} ({payload['shape']['num_hidden_layers']} layers): time per layer (total {report['wall_seconds']:.0f} s)")
    ax.legend()
    if trace:
        cx = axes[1]
        cx.plot([t / 60 for t, _ in trace], [m / 1024 for _, m in trace], color="tab:green", lw=0.8)
        cx.axhline(TARGET_MIB / 1024, color="red", linestyle="--", label="target 6 GiB")
        cx.axvline((report["wall_seconds"] - report["compress_seconds"]) / 60, color="grey", linestyle=":",
                   label="compression pass starts")  # fmt: skip
        cx.set_xlabel("minutes")
        cx.set_ylabel("resident memory, GiB (max of each second)")
        cx.set_title("resident memory over the run: Fisher sweeps and curves, then compression")
        cx.legend()
    bx.bar(["peak RSS"], [report["vm_hwm_mib"] / 1024], color="tab:green")
    bx.axhline(TARGET_MIB / 1024, color="red", linestyle="--", label="target 6 GiB")
    bx.set_ylabel("GiB")
    bx.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser, CONVERT_SIZES)
    parser.add_argument("--remove", type=float, default=None, help="share removed (0.25; quick 0.05: 10M is 80%% embedding)")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--qk-step", type=int, default=None)
    parser.add_argument("--vo-step", type=int, default=None)
    parser.add_argument("--mlp-step", type=int, default=None)
    parser.add_argument("--sensitivity", default=None, help="fisher (default), token, relative or uniform")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    size, tag = shape_tag(args)
    json_path = RESULTS / f"compress_stream_{tag}.json"
    png_path = json_path.with_suffix(".png")
    if args.plot_only:
        plot(json.loads(json_path.read_text()), png_path)
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="compress-stream-"))
    src = workdir / f"llama-{tag}-bf16"
    generated = None
    if not (src / "config.json").is_file():
        generated = generate_checkpoint(size, src, seed=0, layers=args.layers)
    remove = args.remove if args.remove is not None else (0.05 if args.quick else 0.25)
    settings = {"remove": remove, "windows": args.windows, "window": args.window, "threads": args.threads}
    for key in ("qk_step", "vo_step", "mlp_step", "sensitivity"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    out = workdir / f"compressed-{tag}"
    if out.exists():
        shutil.rmtree(out)  # this benchmark's own output of an earlier run
    command = [sys.executable, __file__, "--child", str(src), str(out), json.dumps(settings)]
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line[len("REPORT ") :])
    out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    shutil.rmtree(out)
    payload = {
        "size": size,
        "shape": CONVERT_SIZES[size] | ({"num_hidden_layers": args.layers} if args.layers else {}),
        "settings": settings,
        "source_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors")),
        "output_bytes": out_bytes,
        "generated": generated,
        "target_peak_mib": TARGET_MIB,
        "report": report,
    }
    write_json(json_path.stem, payload)
    plot(payload, png_path)
    per_layer = [sum(s.values()) for s in report["layer_seconds"]]
    print(
        f"{size}: peak RSS {report['vm_hwm_mib']:,.0f} MiB (target {TARGET_MIB:,}), {report['wall_seconds']:.0f} s, "
        f"median {sorted(per_layer)[len(per_layer) // 2]:.1f} s per layer; {report['parameters_before']:,} -> "
        f"{report['parameters_after']:,} stored parameters"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
