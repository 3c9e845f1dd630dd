"""Conversion of Llama checkpoints to relational models: cost, exactness, and slicing against magnitude pruning.

(a) Exact conversion (`relational_hf.convert.to_relational`) of randomly initialised `LlamaForCausalLM` checkpoints
built from `LlamaConfig` on the CPU in fp32 (decoder norm gains drawn around 1 so that folding them is not trivial;
the final gain is kept in front of the tied head either way). Each size is converted in its own subprocess: wall time of
the conversion (its self-check included), peak resident memory from `resource.getrusage(...).ru_maxrss` before and
after the conversion (the delta is what the conversion adds on top of building the source), max |logit difference|
reported by the converter, and parameters saved (decoder norm gains + fixed orbit dimensions).

(b) Slicing: a small Llama (byte tokenizer of `relational_hf.lm.data`, d=128, 4 layers, context 64) is
trained here on Tiny Shakespeare (`../shared/data/tinyshakespeare`, first 90% of the text), converted with
`slice_fraction` 0.1-0.4 (principal gauge from calibration blocks of the training text) and evaluated on the
held-out last 10%; next to it, the same trained Llama with as many decoder weights set to zero by magnitude pruning
(`relational_hf.directional.compression.prune_weights`), both "same number removed" and "same number left".
Perplexity is `relational_hf.lm.metrics.perplexity`.

    python benchmarks/convert.py            # 0.1B and 1B conversions, 1500 training steps (about 10-15 min on 2 cores)
    python benchmarks/convert.py --quick    # a ~10M conversion, 100 training steps (under 2 minutes)

Writes benchmarks/results/convert.json and convert.png (`_quick` with --quick).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from common import RESULTS, SHARED_DATA, write_json
from transformers import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger("convert")

#: conversion sizes: name -> LlamaConfig fields (tied embeddings, 32k vocabulary)
CONVERT_SIZES = {
    "10M": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=688, vocab_size=32000),
    "0.1B": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048, vocab_size=32000
    ),
    "0.3B": dict(
        hidden_size=1024, num_hidden_layers=20, num_attention_heads=16, intermediate_size=2816, vocab_size=32000
    ),
    "1B": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, intermediate_size=5632, vocab_size=32000
    ),
}
FRACTIONS = (0.1, 0.2, 0.3, 0.4)
SMALL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384)
SMALL_QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=192)


def _rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_now_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


# ---- (a) conversion cost, one size per subprocess ------------------------------------------------------------------
def convert_child(size: str, seed: int) -> dict:
    """Build, convert and measure one size (run in a fresh process so that ru_maxrss belongs to this size only)."""
    from relational_hf.convert import to_relational

    torch.manual_seed(seed)
    start = time.perf_counter()
    config = LlamaConfig(**CONVERT_SIZES[size], max_position_embeddings=2048, tie_word_embeddings=True)
    source = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in source.model.layers:  # non-trivial gains to fold (the final gain is kept: tied head)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1.0 + 0.1 * torch.randn_like(norm.weight))
    build_s = time.perf_counter() - start
    rss_before, peak_before = _rss_now_mib(), _rss_peak_mib()
    start = time.perf_counter()
    target, report = to_relational(source, return_report=True)
    convert_s = time.perf_counter() - start
    peak_after = _rss_peak_mib()
    source_params = report.source_parameters
    return {
        "size": size,
        "config": CONVERT_SIZES[size],
        "source_parameters": source_params,
        "relational_parameters": report.relational_parameters,
        "parameters_saved": source_params - report.relational_parameters,
        "parameters_saved_share": 1 - report.relational_parameters / source_params,
        "norm_gain_parameters": report.source_norm_gain_parameters,
        "removed_orbit_dimensions": report.removed_orbit_dimensions,
        "max_logit_difference": report.max_logit_difference,
        "verified_sequence_length": report.verified_sequence_length,
        "build_s": build_s,
        "convert_s": convert_s,
        "source_fp32_mib": source_params * 4 / 2**20,
        "rss_before_convert_mib": rss_before,
        "peak_rss_before_convert_mib": peak_before,
        "peak_rss_after_convert_mib": peak_after,
        "convert_peak_delta_mib": peak_after - peak_before,
        "convert_peak_over_rss_mib": peak_after - rss_before,
        "threads": torch.get_num_threads(),
    }


def run_conversions(sizes: list[str], seed: int, threads: int, timeout_s: float) -> dict:
    out = {}
    for size in sizes:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", size, "--seed", str(seed)]
        cmd += ["--threads", str(threads)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out[size] = {"size": size, "error": f"did not finish within {timeout_s:.0f} s (time box)"}
            logger.info("%s: timed out after %.0f s", size, timeout_s)
            continue
        if proc.returncode != 0:
            out[size] = {"size": size, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
            logger.info("%s: failed: %s", size, out[size]["error"])
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["subprocess_wall_s"] = time.perf_counter() - start
        out[size] = result
        logger.info(
            "%s: %s params, convert %.1f s, peak +%.0f MiB, max logit diff %.2g, saved %s",
            size,
            f"{result['source_parameters']:,}",
            result["convert_s"],
            result["convert_peak_delta_mib"],
            result["max_logit_difference"],
            f"{result['parameters_saved']:,}",
        )
    return out


# ---- (b) slicing vs magnitude pruning on a small trained model -----------------------------------------------------
def shakespeare_ids() -> tuple[torch.Tensor, torch.Tensor]:
    from relational_hf.lm.data import byte_level_tokenizer, encode, split_text

    path = SHARED_DATA / "tinyshakespeare" / "input.txt"
    if not path.is_file():
        raise SystemExit(f"Tiny Shakespeare not found at {path}")
    train, val = split_text(path.read_text(encoding="utf-8"), 0.1)
    tok = byte_level_tokenizer()
    return encode(tok, train), encode(tok, val)


def train_small(dims: dict, train_ids: torch.Tensor, steps: int, batch: int, context: int, seed: int, lr: float):
    from relational_hf.lm.data import RandomBlockDataset

    torch.manual_seed(seed)
    # untied head: slicing folds a varying final gain into the head anyway (a tied head would be untied, +V d)
    config = LlamaConfig(**dims, vocab_size=259, max_position_embeddings=context, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    windows = RandomBlockDataset(train_ids, context, steps * batch, seed=seed)
    warmup = max(1, steps // 20)
    model.train()
    losses = []
    for step in range(steps):
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        ids = torch.stack([windows[i]["input_ids"] for i in range(step * batch, (step + 1) * batch)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 5) == 0:
            logger.info("train step %d/%d: loss %.3f", step + 1, steps, sum(losses[-50:]) / len(losses[-50:]))
    return model.eval(), losses


def decoder_weight_count(model) -> int:
    from relational_hf.directional.compression import weight_matrices

    return sum(m.rows.numel() for m in weight_matrices(model))


def nonzero(model) -> int:
    return sum(int((p != 0).sum()) for p in model.parameters())


def slicing_vs_pruning(quick: bool, steps: int, seed: int) -> dict:
    from relational_hf.convert import to_relational
    from relational_hf.directional.compression import prune_weights
    from relational_hf.lm.data import lm_blocks
    from relational_hf.lm.metrics import perplexity

    context, batch = 64, 12
    dims = SMALL_QUICK if quick else SMALL
    train_ids, val_ids = shakespeare_ids()
    start = time.perf_counter()
    model, losses = train_small(dims, train_ids, steps, batch, context, seed, lr=2e-3)
    train_s = time.perf_counter() - start
    val = lm_blocks(val_ids, context, max_tokens=(32 if quick else 256) * context)
    gen = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, train_ids.numel() - context, (16 if quick else 128,), generator=gen)
    calibration = torch.stack([train_ids[s : s + context] for s in starts.tolist()])
    llama_params = sum(p.numel() for p in model.parameters())
    ppl_llama = perplexity(model, val, batch_size=64)
    decoder_weights = decoder_weight_count(model)
    rows = []
    exact = None
    for fraction in FRACTIONS:
        sliced, report = to_relational(model, fraction, calibration, eval_data=val, return_report=True)
        s = report.slicing
        exact = {"relational_parameters": report.relational_parameters, "perplexity": s.perplexity_before}
        removed = s.parameters_before - s.parameters_after
        row = {
            "fraction": fraction,
            "hidden_size_after": s.hidden_size_after,
            "relational_parameters_before": s.parameters_before,
            "sliced_parameters": s.parameters_after,
            "parameters_removed": removed,
            "parameter_reduction": s.parameter_reduction,
            "variance_kept": s.variance_kept,
            "perplexity_sliced": s.perplexity_after,
            "perplexity_change_sliced": s.perplexity_after / ppl_llama - 1,
        }
        # magnitude pruning of the trained Llama's decoder weights (embeddings/head untouched, like prune_weights)
        for label, count in (("same_removed", removed), ("same_left", llama_params - s.parameters_after)):
            sparsity = max(0, count) / decoder_weights
            if sparsity >= 1:
                row[f"magnitude_{label}"] = {"sparsity": sparsity, "error": "more than all decoder weights"}
                continue
            pruned = prune_weights(model, "magnitude", "unstructured", sparsity)
            ppl = perplexity(pruned, val, batch_size=64)
            row[f"magnitude_{label}"] = {
                "zeroed": count,
                "decoder_sparsity": sparsity,
                "nonzero_parameters": nonzero(pruned),
                "perplexity": ppl,
                "perplexity_change": ppl / ppl_llama - 1,
            }
        rows.append(row)
        logger.info(
            "slice %.1f: -%.1f%% params, ppl %.3f -> %.3f; magnitude (same removed) %.3f, (same left) %.3f",
            fraction,
            100 * s.parameter_reduction,
            ppl_llama,
            s.perplexity_after,
            row["magnitude_same_removed"].get("perplexity", float("nan")),
            row["magnitude_same_left"].get("perplexity", float("nan")),
        )
    return {
        "model": dict(dims, vocab_size=259, context=context, tokenizer="byte_level_tokenizer"),
        "training": {
            "steps": steps,
            "batch": batch,
            "context": context,
            "lr": 2e-3,
            "tokens": steps * batch * context,
            "wall_s": train_s,
            "final_train_loss_mean_last_50": sum(losses[-50:]) / len(losses[-50:]),
        },
        "corpus": "tinyshakespeare input.txt, split_text 90/10 (train / held-out)",
        "heldout_tokens": int(val.numel()),
        "calibration_blocks": int(calibration.shape[0]),
        "llama_parameters": llama_params,
        "llama_decoder_weights": decoder_weights,
        "perplexity_llama": ppl_llama,
        "exact_conversion": exact,
        "rows": rows,
    }


def plot(conversions: dict, slicing: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    ok = [c for c in conversions.values() if "error" not in c]
    if ok:
        labels = [
            f"{c['size']} ({c['source_parameters'] / 1e6:.0f}M)\nmax|dlogit| {c['max_logit_difference']:.1e}"
            for c in ok
        ]
        x = range(len(ok))
        ax0.bar([i - 0.2 for i in x], [c["convert_s"] for c in ok], 0.4, label="convert time (s)")
        ax0b = ax0.twinx()
        ax0b.bar([i + 0.2 for i in x], [c["convert_peak_over_rss_mib"] for c in ok], 0.4, color="tab:orange")
        ax0b.set_ylabel("peak RSS above pre-conversion RSS (MiB)", color="tab:orange")
        ax0.set_xticks(list(x), labels, fontsize=8)
        ax0.set_xlim(-0.7, len(ok) - 0.3)
        ax0.set_ylabel("conversion wall time (s)", color="tab:blue")
        ax0.set_title("exact conversion (fp32, CPU)")
    rows = slicing["rows"]
    removed = [100 * r["parameter_reduction"] for r in rows]
    ax1.plot(removed, [r["perplexity_sliced"] for r in rows], "o-", label="relational + slicing")
    for label, style in (("same_removed", "s--"), ("same_left", "^:")):
        pts = [(100 * r["parameter_reduction"], r[f"magnitude_{label}"].get("perplexity")) for r in rows]
        pts = [p for p in pts if p[1] is not None]
        ax1.plot(*zip(*pts), style, label=f"Llama + magnitude pruning ({label.replace('_', ' ')})")
    ax1.axhline(slicing["perplexity_llama"], color="k", lw=0.8, label="trained Llama (unpruned)")
    for r, x in zip(rows, removed):
        ax1.annotate(f"slice {r['fraction']:.1f}", (x, r["perplexity_sliced"]), fontsize=7)
    ax1.set_xlabel("stored parameters removed by slicing (%)")
    ax1.set_ylabel("held-out perplexity (Tiny Shakespeare, bytes)")
    ax1.set_title("slicing vs magnitude pruning")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~10M conversion and a short training (under 2 min)")
    parser.add_argument("--sizes", nargs="+", choices=list(CONVERT_SIZES), help="conversion sizes (default 0.1B 1B)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of the small model (1500; quick 100)")
    parser.add_argument("--convert-timeout", type=float, default=900.0, help="seconds allowed per conversion")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the existing JSON")
    args = parser.parse_args()
    name = "convert_quick" if args.quick else "convert"
    if args.plot_only:
        saved = json.loads((RESULTS / f"{name}.json").read_text())
        plot(saved["conversion"], saved["slicing"], RESULTS / f"{name}.png")
        return
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.child:
        print(json.dumps(convert_child(args.child, args.seed)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("relational_hf").setLevel(logging.WARNING)
    sizes = args.sizes or (["10M"] if args.quick else ["0.1B", "1B"])
    steps = args.steps or (100 if args.quick else 1500)
    start = time.perf_counter()
    conversions = run_conversions(sizes, args.seed, args.threads, args.convert_timeout)
    slicing = slicing_vs_pruning(args.quick, steps, args.seed)
    write_json(
        name,
        {
            "seed": args.seed,
            "threads": args.threads,
            "wall_s": time.perf_counter() - start,
            "conversion": conversions,
            "slicing": slicing,
        },
    )
    plot(conversions, slicing, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.json')} in {time.perf_counter() - start:.0f} s")
    print("size   source params  relational  saved  convert s  peak+ MiB  max|dlogit|")
    for c in conversions.values():
        if "error" in c:
            print(f"{c['size']:6s} {c['error']}")
            continue
        print(
            f"{c['size']:6s} {c['source_parameters']:13,d} {c['relational_parameters']:11,d} "
            f"{c['parameters_saved']:7,d} {c['convert_s']:9.1f} {c['convert_peak_over_rss_mib']:10.0f} "
            f"{c['max_logit_difference']:11.2e}"
        )
    print(
        f"trained Llama: {slicing['llama_parameters']:,} params, held-out perplexity {slicing['perplexity_llama']:.3f}"
    )
    print("fraction  removed  ppl sliced  ppl magnitude(same removed)  ppl magnitude(same left)")
    for r in slicing["rows"]:
        m1 = r["magnitude_same_removed"].get("perplexity", float("nan"))
        m2 = r["magnitude_same_left"].get("perplexity", float("nan"))
        print(
            f"{r['fraction']:8.1f} {r['parameter_reduction']:8.1%} {r['perplexity_sliced']:11.3f} {m1:28.3f} {m2:25.3f}"
        )


if __name__ == "__main__":
    main()
