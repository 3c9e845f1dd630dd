"""Speed of relational models against Transformers' Llama of the same dimensions, side by side in one process.

For each size and sequence length, every contender is measured in alternation (round-robin, repeated) on:
training step (forward + backward + AdamW) tokens/s, prefill tokens/s, decode tokens/s with the KV cache, and peak
GPU memory of the training step (CUDA only). The figure of merit is the ratio relational / Llama.

    python benchmarks/speed.py            # CPU sizes (a few minutes on 2 cores)
    python benchmarks/speed.py --quick    # one small size, under a minute
    python benchmarks/speed.py --gpu      # larger sizes in bf16 on a CUDA device

Writes benchmarks/results/speed.json and speed.png.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from common import RESULTS, summary, sync, timed, write_json
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.modeling.modeling_gauge import weight_cache

logger = logging.getLogger("speed")

CPU_SIZES = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=768, vocab_size=4096),
    "medium": dict(
        hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=1536, vocab_size=8192
    ),
}
GPU_SIZES = {
    "1k": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=2816, vocab_size=32000),
    "2k": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, intermediate_size=5632, vocab_size=32000),
}
# relational variants: name -> config overrides (thin keys with GQA has fewer parameters than Llama)
VARIANTS = {
    "relational_pivot": dict(gauge="pivot"),
    "relational_free": dict(gauge="free"),
    "relational_pivot_vpr": dict(gauge="pivot", value_parallel_removal=True),
    "relational_thin_gqa": dict(gauge="pivot", qk_rank="half", num_key_value_heads="half"),
}


def build(name: str, dims: dict, dtype: torch.dtype, device: str) -> torch.nn.Module:
    common = dict(dims, max_position_embeddings=4096, tie_word_embeddings=True)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        over = dict(VARIANTS[name])
        head_dim = dims["hidden_size"] // dims["num_attention_heads"]
        if over.get("qk_rank") == "half":
            over["qk_rank"] = head_dim // 2
        if over.get("num_key_value_heads") == "half":
            over["num_key_value_heads"] = dims["num_attention_heads"] // 2
        model = RelationalForCausalLM(RelationalConfig(**common, **over))
    model.set_attn_implementation("sdpa")
    return model.to(device=device, dtype=dtype)


def measure(model, batch: int, seq: int, decode_tokens: int, device: str) -> dict:
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def train_step():
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def prefill():
        model.eval()
        model(input_ids=ids, use_cache=True)

    @torch.no_grad()
    def decode():
        model.eval()
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids[:1, :32], cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        sync()
        start = time.perf_counter()
        with weight_cache(model):  # what generate() does: gauge-fixed weights assembled once, not per step
            for _ in range(decode_tokens):
                out = model(input_ids=tok, cache=out.cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
        sync()
        return time.perf_counter() - start

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_train = timed(train_step)
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    t_prefill = timed(prefill)
    t_decode = decode()
    return {
        "train_tokens_per_s": batch * seq / t_train,
        "prefill_tokens_per_s": batch * seq / t_prefill,
        "decode_tokens_per_s": decode_tokens / t_decode,
        "train_peak_mib": peak,
    }


def run(sizes: dict, seqs: list[int], batch: int, repeats: int, decode_tokens: int, dtype, device) -> dict:
    names = ["llama", *VARIANTS]
    results = {}
    for size, dims in sizes.items():
        for seq in seqs:
            models = {n: build(n, dims, dtype, device) for n in names}
            params = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
            for m in models.values():  # warm-up round (allocations, kernels)
                measure(m, batch, seq, 4, device)
            samples = {n: [] for n in names}
            for r in range(repeats):
                order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
                for n in order:
                    samples[n].append(measure(models[n], batch, seq, decode_tokens, device))
            key = f"{size}/T={seq}"
            results[key] = {}
            for n in names:
                entry = {"parameters": params[n]}
                for metric in ("train_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s"):
                    entry[metric] = summary([s[metric] for s in samples[n]])
                peaks = [s["train_peak_mib"] for s in samples[n] if s["train_peak_mib"] is not None]
                entry["train_peak_mib"] = max(peaks) if peaks else None
                results[key][n] = entry
            for n in VARIANTS:
                results[key][n]["ratio_vs_llama"] = {
                    metric: results[key][n][metric]["median"] / results[key]["llama"][metric]["median"]
                    for metric in ("train_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s")
                }
            logger.info(
                "%s: %s", key, {n: round(results[key][n]["ratio_vs_llama"]["train_tokens_per_s"], 3) for n in VARIANTS}
            )
            del models
    return results


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("train_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s")
    keys = list(results)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), sharey=True)
    width = 0.8 / len(VARIANTS)
    for ax, metric in zip(axes, metrics):
        for i, n in enumerate(VARIANTS):
            vals = [results[k][n]["ratio_vs_llama"][metric] for k in keys]
            ax.bar([j + i * width for j in range(len(keys))], vals, width, label=n)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.95, color="r", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys, rotation=30, fontsize=8)
        ax.set_title(metric.replace("_", " ") + " (ratio vs Llama)")
    axes[0].set_ylabel("relational / Llama (median)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small size and sequence length")
    parser.add_argument("--gpu", action="store_true", help="larger sizes in bf16 on CUDA")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.gpu:
        if device != "cuda":
            parser.error("--gpu needs a CUDA device")
        sizes, seqs, batch, dtype, decode_tokens = GPU_SIZES, [512, 2048], 8, torch.bfloat16, 64
    elif args.quick:
        sizes, seqs, batch, dtype, decode_tokens = {"small": CPU_SIZES["small"]}, [128], 4, torch.float32, 16
    else:
        sizes, seqs, batch, dtype, decode_tokens = CPU_SIZES, [128, 512], 4, torch.float32, 32
    results = run(sizes, seqs, batch, args.repeats, decode_tokens, dtype, device)
    name = "speed_gpu" if args.gpu else ("speed_quick" if args.quick else "speed")
    write_json(name, {"dtype": str(dtype), "batch": batch, "repeats": args.repeats, "results": results})
    plot(results, RESULTS / f"{name}.png")
    worst = min(r[n]["ratio_vs_llama"][m] for r in results.values() for n in VARIANTS for m in r[n]["ratio_vs_llama"])
    print(f"wrote {RESULTS / (name + '.json')}; worst relational/Llama ratio {worst:.3f}")
    for key, r in results.items():
        print(key, {n: {m.split("_")[0]: round(v, 3) for m, v in r[n]["ratio_vs_llama"].items()} for n in VARIANTS})


if __name__ == "__main__":
    main()
