"""What a GGUF user gets: SmolLM2-135M-Instruct dense and compressed (25% fewer stored parameters), written by the
plugin's exporter and run by llama.cpp itself (`relational_hf.convert.gguf_runtime`, the `gguf` extra).

Every step is the command a user runs, cached in --workdir (default results/gguf_runs/, which git ignores):
1. texts: the calibration windows of `compress.py` (the first 128 windows of 512 tokens of the first 90% of the
   WikiText-2 validation documents) and each domain's 12 held-out windows (`domains.py`), as token-id files;
2. checkpoints: `relational-hf convert SRC dense` (exact), `relational-hf compress SRC c25 --remove 0.25
   --calibration CAL.pt --eval ...` with the CLI's defaults, and the same with `--width-multiple 256` (every narrowed
   SwiGLU width a multiple of llama.cpp's K-quant block), and that with `--kinds mlp` (the budget on the MLP alone:
   GGUF pads narrowed query/key and value widths back to the head width, so there they save neither bytes nor time);
3. files: `relational-hf export CKPT M.gguf --to gguf` (f16) and `--quantize Q8_0`, `--quantize Q4_K_M` (llama.cpp's
   own quantiser; rows that are no multiple of its block are kept by llama.cpp in a fallback type of its choice);
4. measured: file size; perplexity computed by llama.cpp on each domain's windows (the same token ids as the plugin's
   figure, each window a fresh sequence) beside the plugin's own (fp32, PyTorch); prefill (512 tokens) and decode
   (greedy, one token at a time with the cache) tokens/s on 2 threads, the files alternated in every round, medians.

Targets (issue: out of the plugin): the exact conversion in llama.cpp within 0.5% of the plugin's perplexity; the
compressed model's llama.cpp/plugin perplexity ratio within 1% of 1; compressed decode >= 1.2x dense decode in
llama.cpp at every type; the compressed Q4_K_M file <= 0.78x the dense Q4_K_M file.

    python benchmarks/gguf_llamacpp.py                  # everything (the two compressions take most of an hour on 2 cores)
    python benchmarks/gguf_llamacpp.py --prepare-only   # texts and checkpoints only (llama.cpp not needed)
    python benchmarks/gguf_llamacpp.py --quick          # 2 layers, 5% removed, short windows: the pipeline in minutes

Writes results/gguf.json and gguf.png (gguf_quick.* with --quick; gguf_TAG.* with --tag TAG). (The script is not called gguf.py: run from
this folder it would stand in for the `gguf` package.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, load_average, save_figure, write_json

TYPES = ("F16", "Q8_0", "Q4_K_M")
#: each compression's extra options of `relational-hf compress` (beside --remove 0.25 and the texts)
COMPRESSIONS: dict[str, list[str]] = {
    "compressed": [],
    "compressed-w256": ["--width-multiple", "256"],
    # every query/key and value width whole (GGUF pads narrowed ones back to the head width): the budget on the MLP
    "compressed-mlp-w256": ["--kinds", "mlp", "--width-multiple", "256"],
}
MODELS = ("dense", *COMPRESSIONS)


def _cli(*args: str, log: Path) -> None:
    """Run `relational-hf ARGS` as its own process (what a user runs), its output kept in `log`."""
    command = [sys.executable, "-m", "relational_hf.commands", *args]
    with open(log, "w") as out:
        code = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, check=False, cwd=Path(__file__).resolve().parents[1]
        ).returncode
    if code != 0:
        raise SystemExit(f"relational-hf {' '.join(args)} failed ({code}); see {log}")


def texts(workdir: Path, window: int, n_cal: int, n_eval: int, quick: bool, domains: list[str]) -> dict[str, Path]:
    """The calibration windows and each domain's held-out windows as .pt token-id files (made once)."""
    folder = workdir / "texts"
    files = {"calibration": folder / "calibration.pt", **{d: folder / f"{d}.pt" for d in domains}}
    if all(f.exists() for f in files.values()):
        return files
    folder.mkdir(parents=True, exist_ok=True)
    from compress import load_model, protocol_windows
    from domains import domain_windows

    model, tokenizer = load_model(quick)
    calibration, evaluation, _ = protocol_windows(tokenizer, window, n_cal, n_eval, quick, 2)
    torch.save(calibration.clone(), files["calibration"])
    for name in domains:
        torch.save(domain_windows(name, model, tokenizer, window, n_eval, evaluation).clone(), files[name])
    return files


def checkpoints(
    workdir: Path, files: dict[str, Path], quick: bool, domains: list[str], window: int, n_eval: int,
    models: tuple[str, ...] = MODELS,
) -> dict[str, Path]:
    """dense (exact conversion) and the compressions among `models`, each made once by the CLI."""
    from relational_hf.pretrained import smollm2_checkpoint

    src = str(smollm2_checkpoint())
    if quick:
        src = str(_two_layers(workdir, src))
    out = {name: workdir / name for name in models}
    if not (out["dense"] / "config.json").exists():
        _cli("convert", src, str(out["dense"]), log=workdir / "dense.log")
    evals = [a for d in domains for a in ("--eval", str(files[d]))]
    for name, extra in COMPRESSIONS.items():
        if name not in out or (out[name] / "config.json").exists():
            continue
        started = time.perf_counter()
        _cli(
            "compress", src, str(out[name]), "--remove", "0.05" if quick else "0.25", "--calibration", str(files["calibration"]),
            "--calibration-windows", str(len(torch.load(files["calibration"]))), "--window", str(window),
            "--eval-windows", str(n_eval), *evals, *extra,
            log=workdir / f"{name}.log",
        )
        (workdir / f"{name}.seconds").write_text(f"{time.perf_counter() - started:.1f}\n")
    return out


def _two_layers(workdir: Path, src: str) -> Path:
    folder = workdir / "src-2-layers"
    if not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        model.model.layers = model.model.layers[:2]
        model.config.num_hidden_layers = 2
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    return folder


def gguf_files(workdir: Path, ckpts: dict[str, Path]) -> dict[tuple[str, str], Path]:
    """(model, type) -> the GGUF file, exported by the CLI once."""
    out = {}
    for name, folder in ckpts.items():
        for kind in TYPES:
            path = workdir / f"{name}-{kind}.gguf"
            if not path.exists():
                extra = [] if kind == "F16" else ["--quantize", kind]
                _cli("export", str(folder), str(path), "--to", "gguf", *extra, log=workdir / f"{name}-{kind}.log")
            out[name, kind] = path
    return out


def plugin_perplexities(ckpts: dict[str, Path], files: dict[str, Path], domains: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    from relational_hf.compress.eval import perplexity_on_windows

    out = {}
    for name, folder in ckpts.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[name] = {d: perplexity_on_windows(model, torch.load(files[d])) for d in domains}
        del model
    return out


def llama_cpp_measures(ggufs, files, domains, window: int, decode: int, rounds: int) -> dict:
    from relational_hf.convert.gguf_runtime import LlamaCpp

    llms = {key: LlamaCpp(path, n_ctx=window + decode, threads=2, n_batch=window) for key, path in ggufs.items()}
    result = {f"{m}/{t}": {"file_mib": ggufs[m, t].stat().st_size / 2**20} for m, t in ggufs}
    for (m, t), llm in llms.items():
        result[f"{m}/{t}"]["perplexity"] = {d: llm.perplexity(torch.load(files[d]).tolist()) for d in domains}
    prompt = torch.load(files[domains[0]])[0, :window].tolist()
    times = {key: ([], []) for key in llms}
    for r in range(rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for key in order:
            prefill, dec = llms[key].time_prefill_and_decode(prompt, decode)
            times[key][0].append(prefill)
            times[key][1].append(dec)
    for (m, t), (prefill, dec) in times.items():
        result[f"{m}/{t}"]["prefill_tokens_per_s"] = window / statistics.median(prefill)
        result[f"{m}/{t}"]["decode_tokens_per_s"] = decode / statistics.median(dec)
    for llm in llms.values():
        llm.close()
    return result


def summarise(measures: dict, plugin: dict, domains: list[str], models: tuple[str, ...] = MODELS) -> dict:
    """The issue's four targets, from the measures."""
    first = domains[0]
    cells = {}
    for name in models:
        ratio = measures[f"{name}/F16"]["perplexity"][first] / plugin[name][first]
        cells[f"{name}: llama.cpp F16 / plugin perplexity ({first})"] = ratio
    targets = {
        "exact conversion within 0.5% of the plugin (F16)": abs(cells[f"dense: llama.cpp F16 / plugin perplexity ({first})"] - 1) <= 0.005,
    }
    for name in [m for m in models if m != "dense"]:
        plugin_ratio = cells[f"{name}: llama.cpp F16 / plugin perplexity ({first})"]
        targets[f"{name}: llama.cpp/plugin within 1% (F16)"] = abs(plugin_ratio - 1) <= 0.01
        speed = {t: measures[f"{name}/{t}"]["decode_tokens_per_s"] / measures[f"dense/{t}"]["decode_tokens_per_s"] for t in TYPES}
        cells[f"{name}: decode speed / dense"] = speed
        targets[f"{name}: decode >= 1.2x dense at every type"] = all(v >= 1.2 for v in speed.values())
        size = measures[f"{name}/Q4_K_M"]["file_mib"] / measures["dense/Q4_K_M"]["file_mib"]
        cells[f"{name}: Q4_K_M file / dense"] = size
        targets[f"{name}: Q4_K_M file <= 0.78x dense"] = size <= 0.78
    return {"ratios": cells, "targets_met": targets}


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures, first, models = payload["llama_cpp"], payload["domains"][0], payload["models"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.8 / len(models)
    for i, name in enumerate(models):
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(TYPES))]
        cells = [measures[f"{name}/{t}"] for t in TYPES]
        axes[0].bar(xs, [c["file_mib"] for c in cells], width, label=name)
        axes[1].bar(xs, [c["decode_tokens_per_s"] for c in cells], width, label=name)
        axes[2].bar(xs, [c["perplexity"][first] for c in cells], width, label=name)
    titles = ("file size (MiB)", "decode tokens/s (llama.cpp, 2 threads)", f"perplexity in llama.cpp ({first})")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(range(len(TYPES)), TYPES)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[2].axhline(payload["plugin_perplexity"]["dense"][first], color="k", lw=0.8, ls="--", label="dense, plugin fp32")
    axes[2].legend(fontsize=8)
    what = "first 2 layers, 5%" if payload.get("quick") else "25%"
    fig.suptitle(f"SmolLM2-135M-Instruct in llama.cpp: dense and {what} fewer stored parameters, one exporter", fontsize=11)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    from domains import DOMAINS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=RESULTS / "gguf_runs")
    parser.add_argument("--quick", action="store_true", help="2 layers, 128-token windows")
    parser.add_argument("--prepare-only", action="store_true", help="texts and checkpoints only")
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (every file in each)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--models", nargs="+", default=list(MODELS), choices=MODELS, help="which checkpoints (dense is always one)"
    )
    parser.add_argument("--tag", default="", help="suffix of the result files (gguf_TAG.json), to keep a reference run")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    window, n_cal, n_eval = (128, 8, 4) if args.quick else (512, 128, 12)
    workdir = args.workdir / ("quick" if args.quick else "full")
    workdir.mkdir(parents=True, exist_ok=True)
    files = texts(workdir, window, n_cal, n_eval, args.quick, args.domains)
    models = tuple(m for m in MODELS if m in args.models or m == "dense")
    ckpts = checkpoints(workdir, files, args.quick, args.domains, window, n_eval, models)
    if args.prepare_only:
        return 0
    from relational_hf.convert import gguf_runtime

    if not gguf_runtime.available():
        raise SystemExit(f"llama.cpp is needed for the measures: {gguf_runtime.INSTALL_HINT}")
    ggufs = gguf_files(workdir, ckpts)
    load_before = load_average()
    plugin = plugin_perplexities(ckpts, files, args.domains)
    measures = llama_cpp_measures(ggufs, files, args.domains, window, args.decode_tokens, args.rounds)
    reports = {
        n: json.loads((ckpts[n] / "compression_report.json").read_text())
        for n in models
        if (ckpts[n] / "compression_report.json").exists()
    }
    payload = {
        "quick": args.quick,
        "models": list(models),
        "llama_cpp": measures,
        "plugin_perplexity": plugin,
        "domains": args.domains,
        "llama_cpp_version": gguf_runtime.version(),
        "window": window,
        "eval_windows": n_eval,
        "decode_tokens": args.decode_tokens,
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "stored_parameters": {n: r.get("parameters_after") for n, r in reports.items()},
        "compress_seconds": {
            n: float((workdir / f"{n}.seconds").read_text()) for n in models if (workdir / f"{n}.seconds").exists()
        },
        "widths": {n: r.get("widths") for n, r in reports.items()},
    }
    payload |= summarise(measures, plugin, args.domains, models)
    name = ("gguf_quick" if args.quick else "gguf") + (f"_{args.tag}" if args.tag else "")
    path = write_json(name, payload)
    plot(payload, RESULTS / f"{name}.png")
    print(json.dumps(payload["ratios"], indent=1))
    print(json.dumps(payload["targets_met"], indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
