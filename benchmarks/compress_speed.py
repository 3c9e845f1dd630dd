"""Speed of compressed SmolLM2-135M-Instruct against its dense source: prefill and greedy-decode tokens/s.

For every level of the compression curve (share of stored parameters removed, `--levels`), the model compressed by
the project's relational method (`relational_hf.jobs.compress_model`, calibrated on the first
`--calibration-windows` windows of 512 tokens of the first 90% of the WikiText-2 validation documents, the protocol of
`benchmarks/compress.py`; level 0 is the exact conversion, nothing removed; speed depends only on the widths, which
the method plans on the first 8 calibration windows whatever their number, so 8 windows give the shapes of the
README's 16- and 64-window models at a fraction of the time) is timed against the dense source loaded
as a plain `LlamaForCausalLM`, both in the same dtype (`--dtype`) and attention implementation (`--attn`), in one
process, in alternated rounds (the order flips every round, one warm-up round first), every model's weights copied
into newly allocated memory first (`in_own_memory`: a checkpoint loaded from a file may be read from mapped memory,
more slowly and by a varying amount), on:

- prefill: one forward pass over random token ids, batch 1 x `--prefill` tokens and `--batch` x `--prefill-batched`,
  inside `relational_hf.modeling.weight_cache` (what `generate()` and the project's evaluation loops enter: the
  gauge-fixed weights assembled once; a no-op for the dense Llama); prefill_bare: the batch-1 pass as a bare
  forward call, which assembles every gauge-fixed weight at each call;
- decode: `generate(do_sample=False)` of `--decode` new tokens (no early stop) after a `--prompt`-token prompt,
  batch 1 (the prompt's prefill included);
- prefill_last: the batch-1 pass as `generate()` runs a prompt, with only the last position's logits
  (`logits_to_keep=1`: the tied head, a fifth of SmolLM2's parameters and not compressed, applied to one position).

Reported per case: the median over `--rounds` rounds of tokens/s by wall clock, and by the process's CPU time (all
threads; on a machine that other jobs share, CPU time is the steadier of the two), and the best round (the least
disturbed; `speedup_best`), with the load average beside them. The figure of merit is compressed / dense.
`--gauge` is the gauge of the compressed model timed: free (the default, what `relational-hf compress` writes: every
map a plain Linear holding its full weight) or pivot (the gauge-fixed form, which assembles its full weights from its
free entries); level 0, the exact conversion, is put in the same gauge (`relational_hf.convert.to_free_gauge`), and
`--widths-from` cells are built in it whatever gauge their widths were planned in. `--keep-assembled` times a third model,
the compressed one keeping its assembled gauge-fixed weights between calls (`keep_assembled`: `generate()` then
assembles nothing after its first call), in the same alternated rounds.

    python benchmarks/compress_speed.py                  # every level (compressions are cached in --workdir)
    python benchmarks/compress_speed.py --quick          # 2 layers, 1 level, short inputs: a minute or two
    python benchmarks/compress_speed.py --gpu            # on a CUDA device, bf16 by default (synchronised timing)
    python benchmarks/compress_speed.py --plot-only
    python benchmarks/compress_speed.py --widths-from results/compress_curve.json --levels 0.1 0.2 0.3 0.4 0.5

`--widths-from JSON`: the per-layer widths that the quality benchmark's relational cells chose (their reports keep
them), or those of one `relational-hf compress` run (its `compression_report.json`, at its `--remove`), built as
relational models of exactly those shapes with freshly initialised weights instead of compressing
again: on dense kernels the time depends on the shapes only, not on the values.

Writes results/compress_speed.json and compress_speed.png (`_curve`, `_gpu`, `_quick` suffixes), atomically.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from common import RESULTS, load_average, sync, write_json

from relational_hf.modeling import weight_cache

logger = logging.getLogger("compress_speed")

LEVELS = (0.0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5)
CASES = ("prefill", "prefill_batched", "decode", "prefill_bare", "prefill_last")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.no_grad()
def in_own_memory(model):
    """`model` with every parameter and buffer copied into newly allocated memory (tied weights stay tied). A checkpoint
    that `from_pretrained` loads on the CPU may keep its tensors in memory mapped from the file, which this CPU reads
    more slowly, by an amount that changes from one process to the next (a decoding step of the dense SmolLM2 measured
    by hand: 62.8 ms mapped, 51.5 ms copied, the compressed model 42 ms either way); a model built in memory (the
    compression's) never is. Both models are timed from memory of the same kind."""
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return model


def planned_widths(payload) -> dict[float, dict[str, list[int]]]:
    """{share removed: widths} of `benchmarks/compress.py`'s relational cells, or of one `relational-hf compress`
    report (its `remove` and `widths`: the command's own model); empty for anything else."""
    if isinstance(payload, dict) and isinstance(payload.get("cells"), dict):
        cells = payload["cells"].values()
        return {c["target"]: c["details"]["widths"] for c in cells if c["method"] == "relational" and c["status"] == "ok"}
    if isinstance(payload, dict) and isinstance(payload.get("widths"), dict) and "remove" in payload:
        return {float(payload["remove"]): payload["widths"]}
    return {}


def clocked(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call of fn, the device synchronised before and after."""
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(model, args, device: str, generator: torch.Generator) -> dict[str, tuple[float, float, int]]:
    """One round on `model`: {case: (wall s, CPU s, tokens)}."""
    vocab = model.config.vocab_size
    one = torch.randint(0, vocab, (1, args.prefill), generator=generator).to(device)
    many = torch.randint(0, vocab, (args.batch, args.prefill_batched), generator=generator).to(device)
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=generator).to(device)
    out = {}
    with torch.no_grad():
        out["prefill_bare"] = (*clocked(lambda: model(input_ids=one, use_cache=False)), one.numel())
        with weight_cache(model):  # what generate() and the project's evaluation loops enter (no-op for Llama)
            out["prefill"] = (*clocked(lambda: model(input_ids=one, use_cache=False)), one.numel())
            out["prefill_batched"] = (*clocked(lambda: model(input_ids=many, use_cache=False)), many.numel())
            last = clocked(lambda: model(input_ids=one, use_cache=False, logits_to_keep=1))  # as generate() prefills
            out["prefill_last"] = (*last, one.numel())
        out["decode"] = (
            *clocked(
                lambda: model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.decode,
                    min_new_tokens=args.decode, do_sample=False, pad_token_id=0,
                )
            ),
            args.decode,
        )  # fmt: skip
    return out


def compare(dense, compressed, args, device: str, kept=None) -> dict:
    """Alternated rounds of dense and compressed (and `kept`, the compressed model keeping its assembled weights,
    when given); medians of tokens/s (wall and CPU) and their ratios to dense."""
    models = {"dense": dense, "compressed": compressed} | ({"compressed_kept": kept} if kept is not None else {})
    samples: dict[str, list] = {name: [] for name in models}
    loads = []
    for r in range(args.rounds + 1):  # round 0 warms up (allocations, kernels, caches)
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            gen = torch.Generator().manual_seed(r)  # the same inputs for both models in a round
            result = measure(models[name], args, device, gen)
            if r > 0:
                samples[name].append(result)
        loads.append(load_average())
    out: dict = {"load_average": loads}
    for name in models:
        out[name] = {}
        for case in CASES:
            walls = [tokens / wall for wall, _, tokens in (s[case] for s in samples[name])]
            cpus = [tokens / cpu for _, cpu, tokens in (s[case] for s in samples[name]) if cpu > 0]
            out[name][case] = {
                "tokens_per_s": statistics.median(walls),
                "tokens_per_cpu_s": statistics.median(cpus) if cpus else None,
                "best_tokens_per_s": max(walls),  # the round least disturbed by anything else on the machine
                "rounds": walls,
            }
    for name, suffix in (("compressed", ""), ("compressed_kept", "_kept")):
        if name not in out:
            continue
        out["speedup" + suffix] = {
            case: out[name][case]["tokens_per_s"] / out["dense"][case]["tokens_per_s"] for case in CASES
        }
        out["speedup_best" + suffix] = {
            case: out[name][case]["best_tokens_per_s"] / out["dense"][case]["best_tokens_per_s"] for case in CASES
        }
        out["speedup_cpu_time" + suffix] = {
            case: (out[name][case]["tokens_per_cpu_s"] or float("nan"))
            / (out["dense"][case]["tokens_per_cpu_s"] or float("nan"))
            for case in CASES
        }
    return out


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(payload["levels"], key=float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "speedup", "wall clock"), (axes[1], "speedup_cpu_time", "process CPU time")):
        for case, marker in zip(CASES, "osd^v"):
            line = ax.plot(
                [100 * float(lv) for lv in levels], [payload["levels"][lv][key][case] for lv in levels], marker=marker,
                label=case.replace("_", " "),
            )  # fmt: skip
            kept = [lv for lv in levels if key + "_kept" in payload["levels"][lv]]
            if kept and case != "prefill_bare":
                ax.plot(
                    [100 * float(lv) for lv in kept], [payload["levels"][lv][key + "_kept"][case] for lv in kept],
                    marker=marker, linestyle=":", color=line[0].get_color(), label=case.replace("_", " ") + ", kept",
                )  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.2, color="grey", linewidth=0.8, linestyle="--", label="target at 25%: 1.2x")
        ax.set_xlabel("stored parameters removed (%)")
        ax.set_title(f"compressed / dense tokens/s ({title})")
    axes[0].set_ylabel("speed-up (median of rounds)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{payload['model']}, {payload['device']}, {payload['dtype']}, {payload['attn']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, level 5%%, short inputs, 2 rounds")
    parser.add_argument("--gpu", action="store_true", help="run on the CUDA device (bf16 unless --dtype)")
    parser.add_argument("--levels", type=float, nargs="+", default=None, help=f"shares removed (default {LEVELS})")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="float32 (CPU default) / bfloat16 (GPU)")
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attention implementation (sdpa)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds per model (3; quick 2)")
    parser.add_argument("--prefill", type=int, default=None, help="prefill tokens, batch 1 (512; quick 64)")
    parser.add_argument("--batch", type=int, default=4, help="batch of the batched prefill (4)")
    parser.add_argument("--prefill-batched", type=int, default=None, help="tokens per row, batched prefill (128)")
    parser.add_argument("--decode", type=int, default=None, help="greedy new tokens (64; quick 16)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens before decoding (16)")
    parser.add_argument("--calibration-windows", type=int, default=8, help="calibration windows of the compression (8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="where compressed models are kept between runs")
    parser.add_argument(
        "--keep-assembled", action="store_true",
        help="also time the compressed model keeping its assembled weights between calls (keep_assembled)",
    )  # fmt: skip
    parser.add_argument(
        "--gauge", choices=("free", "pivot"), default="free",
        help="gauge of the compressed model: free (the default of `relational-hf compress`: full maps, nothing "
        "assembled) or pivot (the gauge-fixed form)",
    )  # fmt: skip
    parser.add_argument("--tag", default="", help="appended to the results' file name")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    parser.add_argument(
        "--widths-from", type=Path, default=None, metavar="JSON",
        help="time models of the widths that benchmarks/compress.py's relational cells chose, or of one compress "
        "report (no compression run)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.keep_assembled and args.gauge == "free":
        parser.error("--keep-assembled times a pivot-gauge model keeping its assembled weights: give --gauge pivot")
    if args.tag and not args.tag.replace("_", "").replace("-", "").isalnum():
        parser.error(f"--tag must be letters, digits, '_' or '-', got {args.tag!r}")
    name = "compress_speed" + ("_curve" if args.widths_from else "") + ("_gpu" if args.gpu else "")
    name += ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    if args.plot_only:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            parser.error(f"{path} does not exist: run the benchmark first")
        plot(json.loads(path.read_text()), RESULTS / f"{name}.png")
        return 0
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device")
    levels = args.levels or ((0.05,) if args.quick else LEVELS)
    if any(not 0.0 <= lv < 1.0 for lv in levels):
        parser.error("--levels must be shares in [0, 1)")
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.prefill = args.prefill or (64 if args.quick else 512)
    args.prefill_batched = args.prefill_batched or (32 if args.quick else 128)
    args.decode = args.decode or (16 if args.quick else 64)
    for flag in ("rounds", "prefill", "batch", "prefill_batched", "decode", "prompt", "calibration_windows", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    dtype = DTYPES[args.dtype or ("bfloat16" if args.gpu else "float32")]
    device = "cuda" if args.gpu else "cpu"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    from compress import load_model, protocol_windows
    from heal import compressed_model

    from relational_hf.compress.eval import stored_parameters
    from relational_hf.convert import to_relational

    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    source, tokenizer = load_model(args.quick)
    window = 128 if args.quick else 512
    calibration, _, protocol = protocol_windows(tokenizer, window, args.calibration_windows, 1, args.quick, args.threads)
    dense = source.to(device=device, dtype=dtype).eval()
    dense.set_attn_implementation(args.attn)
    payload = {
        "model": protocol["model"],
        "device": torch.cuda.get_device_name(0) if args.gpu else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "attn": args.attn,
        "threads": args.threads,
        "gauge": args.gauge,
        "protocol": {
            "compression": f"relational method, {protocol['calibration']}; level 0 = the exact conversion",
            "prefill": f"batch 1 x {args.prefill} tokens; batched: {args.batch} x {args.prefill_batched} tokens",
            "decode": f"greedy, {args.decode} new tokens after {args.prompt} prompt tokens, batch 1",
            "rounds": f"{args.rounds} measured rounds, alternated (order flipped every round), after 1 warm-up round",
            "dense": "the source as Transformers' LlamaForCausalLM, same dtype and attention implementation",
            "memory": "every model's parameters and buffers copied into newly allocated memory before timing",
        },
        "dense_stored_parameters": stored_parameters(dense)["total"],
        "levels": {},
    }
    planned = {}
    if args.widths_from is not None:
        planned = planned_widths(json.loads(args.widths_from.read_text()))
        if not planned:
            parser.error(f"--widths-from {args.widths_from}: neither a compress benchmark result nor a compress report")
        missing = [lv for lv in levels if lv and lv not in planned]
        if missing:
            parser.error(f"--widths-from {args.widths_from} has no relational cell at level(s) {missing}")
        payload["protocol"]["compression"] = f"models of the widths chosen in {args.widths_from.name}, fresh weights"
    relational_config = to_relational(source.float()).config if planned else None  # the widths' base, converted once
    for level in levels:
        if level in planned:
            from relational_hf.compress.lowrank import compressed_config
            from relational_hf.modeling import RelationalForCausalLM

            config = compressed_config(relational_config, planned[level], args.gauge)
            compressed = RelationalForCausalLM(config).eval()
            dense = source.to(device=device, dtype=dtype)
            info = {"stored_parameters": stored_parameters(compressed)["total"], "widths": planned[level]}
        elif level == 0.0:
            compressed = to_relational(source.float()).eval()
            dense = source.to(device=device, dtype=dtype)  # to_relational reads fp32 on the CPU
            info = {"stored_parameters": stored_parameters(compressed)["total"], "widths": None}
        else:
            compressed, report = compressed_model(
                source.float().cpu(), tokenizer, calibration, level, args.workdir, {"gauge": args.gauge}
            )
            dense = source.to(device=device, dtype=dtype)
            info = {"stored_parameters": report["parameters_after"], "widths": report.get("widths")}
        if args.gauge == "free" and compressed.config.gauge != "free":  # the exact conversion writes the pivot gauge
            from relational_hf.convert import to_free_gauge

            compressed = to_free_gauge(compressed.float())
            info["stored_parameters"] = stored_parameters(compressed)["total"]
        assert compressed.config.gauge == args.gauge, (compressed.config.gauge, args.gauge)
        compressed = compressed.to(device=device, dtype=dtype).eval()
        compressed.set_attn_implementation(args.attn)
        dense.set_attn_implementation(args.attn)
        logger.info("level %g: %s stored parameters; timing", level, f"{info['stored_parameters']:,}")
        kept = None
        if args.keep_assembled:
            from relational_hf.modeling import GaugeFixedLinear

            kept = copy.deepcopy(compressed)
            for m in kept.modules():
                if isinstance(m, GaugeFixedLinear):
                    m.keep_assembled = True
        dense, compressed = in_own_memory(dense), in_own_memory(compressed)
        result = compare(dense, compressed, args, device, kept if kept is None else in_own_memory(kept))
        del kept
        payload["levels"][f"{level:g}"] = info | result
        logger.info("level %g: speed-up %s (CPU time %s)", level, result["speedup"], result["speedup_cpu_time"])
        write_json(name, payload)
        plot(payload, RESULTS / f"{name}.png")
        del compressed
    print(json.dumps({lv: {k: round(v, 3) for k, v in r["speedup"].items()} for lv, r in payload["levels"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
