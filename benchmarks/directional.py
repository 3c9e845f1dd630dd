"""Directional-decomposition evidence on a small character-level model (issue 4).

Trains a small Llama (or relational) model on Tiny Shakespeare bytes (first 90% of the file; the last 10% evaluates),
then measures with `relational_hf.directional`:
- the per-layer parallel profile at every site (mean |y_par|/|y_perp|, parallel energy, alpha, cos(h, h+y));
- s_par and s_perp sweeps at every site (Delta PPL) and the diagonal-removal control;
- the compression ranking (int8/int4, magnitude/Wanda unstructured/2:4/4:8) by perpendicular and by total
  layer-local error, with Spearman correlations against the compressed models' perplexity.
Writes benchmarks/results/directional_<arch>.json and four PNGs beside it: directional_<arch>_profile.png (mean
|y_par|/|y_perp| per layer and site), _energy.png (parallel energy), _sweep.png (Delta PPL against s) and
_compression.png (the compression ranking). Fixed seed; CPU.

    python benchmarks/directional.py                      # about 6.5 minutes (training is capped at 5.5)
    python benchmarks/directional.py --arch relational --max-minutes 5
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from common import corpus

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.directional import (
    SITES,
    compression_report,
    decompose_dataset,
    perplexity,
    plot_compression,
    plot_parallel_profile,
    plot_sweeps,
    scale_components,
    sweep_all,
    token_blocks,
)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RESULTS = PROJECT_ROOT / "benchmarks" / "results"
SWEEP_VALUES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)


def build_model(arch: str, seq_len: int) -> torch.nn.Module:
    """nanoGPT's CPU shakespeare_char size: 4 layers, 4 heads, d = 128 (SwiGLU width 384), 256 byte tokens."""
    dims = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=seq_len,
    )
    if arch == "relational":
        return RelationalForCausalLM(RelationalConfig(**dims, attn_implementation="sdpa"))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**dims, tie_word_embeddings=True, attn_implementation="sdpa"))


def train(model: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace) -> dict:
    """AdamW with warm-up and cosine decay on random windows; stops at --steps or --max-minutes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    started, losses, step = time.monotonic(), [], 0
    model.train()
    while step < args.steps and time.monotonic() - started < 60 * args.max_minutes:
        lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, ids.numel() - args.seq_len - 1, (args.batch_size,), generator=generator)
        batch = torch.stack([ids[s : s + args.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        if step % 100 == 0:
            print(f"step {step}: train loss {sum(losses[-100:]) / 100:.3f} ({time.monotonic() - started:.0f} s)")
    model.eval()
    return {"steps": step, "seconds": time.monotonic() - started, "final_train_loss": sum(losses[-50:]) / 50}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["llama", "relational"], default="llama")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--max-minutes", type=float, default=5.5)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (one is fastest for d = 128 on a busy CPU)"
    )
    args = parser.parse_args()
    data = corpus("tinyshakespeare")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    ids = torch.tensor(list(data.read_bytes()), dtype=torch.long)
    split = int(0.9 * ids.numel())
    train_ids, val_ids = ids[:split], ids[split:]

    model = build_model(args.arch, args.seq_len)
    training = train(model, train_ids, args)
    rows = token_blocks(val_ids, args.seq_len, args.eval_tokens)  # (N, T) validation rows
    calibration = token_blocks(train_ids[-64 * args.seq_len :], args.seq_len)[:16]  # Wanda calibration (train text)
    val_ppl = perplexity(model, rows, batch_size=32)
    print(f"trained {training['steps']} steps in {training['seconds']:.0f} s; val loss {math.log(val_ppl):.3f}")

    t0 = time.monotonic()
    batches = [rows[i : i + 32] for i in range(0, rows.shape[0], 32)]
    profile = decompose_dataset(model, batches, total=len(batches))
    sweeps = sweep_all(model, rows, SITES, values=SWEEP_VALUES, batch_size=32)
    with scale_components(model, "diagonal"):
        diagonal = perplexity(model, rows, batch_size=32)
    report = compression_report(model, rows[:64], calibration_ids=calibration, eval_ids=rows, batch_size=32)
    analysis_seconds = time.monotonic() - t0

    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = f"directional_{args.arch}"
    plot_parallel_profile(profile, RESULTS / f"{tag}_profile.png", title=f"{args.arch}, Tiny Shakespeare bytes")
    plot_parallel_profile(profile, RESULTS / f"{tag}_energy.png", statistic="parallel_energy")
    plot_sweeps(sweeps, RESULTS / f"{tag}_sweep.png", title=f"Delta PPL (baseline {val_ppl:.3f})")
    plot_compression(report, RESULTS / f"{tag}_compression.png")
    result = {
        "command": f"python benchmarks/directional.py --arch {args.arch}",
        "settings": vars(args),
        "data": "../shared/data/tinyshakespeare/input.txt, bytes; first 90% train, last 10% validation",
        "parameters": sum(p.numel() for p in model.parameters()),
        "training": training,
        "validation_tokens": int(rows.numel()),
        "validation_loss": math.log(val_ppl),
        "validation_perplexity": val_ppl,
        "analysis_seconds": analysis_seconds,
        "profile": profile.to_dict(),
        "sweeps": [s.to_dict() for s in sweeps],
        "diagonal_removal": {"perplexity": diagonal, "delta": diagonal - val_ppl},
        "compression": report.to_dict(),
    }
    (RESULTS / f"{tag}.json").write_text(json.dumps(result, indent=2, allow_nan=False))

    print(profile.to_markdown())
    print("\nDelta PPL at s = 0 / 0.5 / 1.5 (parallel | perpendicular):")
    by_key = {(s.site, s.component): s for s in sweeps}
    for site in SITES:
        cells = []
        for component in ("parallel", "perpendicular"):
            s = by_key[(site, component)]
            cells.append(" / ".join(f"{s.deltas[s.values.index(v)]:+.3f}" for v in (0.0, 0.5, 1.5)))
        print(f"  {site:<20} {cells[0]:>28} | {cells[1]:>28}")
    print(f"  diagonal removal: {diagonal - val_ppl:+.3f}")
    print()
    print(report.to_markdown())
    print(f"\nwrote {RESULTS / (tag + '.json')} and PNGs ({analysis_seconds:.0f} s of analysis)")


if __name__ == "__main__":
    main()
