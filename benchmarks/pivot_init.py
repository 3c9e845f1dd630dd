"""Pivot-gauge initialisation: validation loss after training from each way of initialising the pivot gauge, at equal
tokens, seeds and optimiser settings (the quality benchmark's loop, corpora, sizes and frozen peak LR).

The initialisations compared (the free gauge, whose initialisation does not change, is the reference):
- config_layout_matched: the library's initialisation. The gauge layout is derived from the config
  (`GaugeFixedLinear.initial_pivots`, pivots spread over the residual coordinates), the free entries N(0, c^2/m) and
  their partner factors N(0, m s^4/c^2) (`GaugeFixedLinear.init_stds`): every entry of G_QK, G_VO and of each SwiGLU
  unit's product has the free model's second moment;
- max_volume: the previous initialisation. All factors drawn N(0, s^2) as in a free model, then moved into the
  pivot gauge at the greedy max-volume pivots (`set_full_weights`, what conversion does): the free model's function
  distribution exactly, but random pivot layouts (buffers that re-initialisation does not reproduce);
- config_layout_free_scales: the config's layout with every free entry and partner factor N(0, s^2) as in a free
  model, the pivot entries c: the invariants' second moments match away from the pivot rows only.

    python benchmarks/pivot_init.py --sizes d32,d64                   # Tiny Shakespeare, 3 seeds
    python benchmarks/pivot_init.py --corpus wikitext2 --sizes d64,d96 --inits config_layout_matched,max_volume
    python benchmarks/pivot_init.py --quick                           # q16/q32, 50 steps, 2 seeds

Writes benchmarks/results/pivot_init_<corpus>[_quick].json: every run, the mean and spread of the validation loss
per contender, initialisation and size, and the per-seed differences to max_volume (same seed: same embedding draw,
same batches).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import common
import torch
from quality_runner import make_optimizer, train_steps
from quality_setup import BATCH_SIZE, BUDGETS, CONTEXT, CORPORA, OPTIMIZER, build_model

logger = logging.getLogger("pivot_init")

INITS = {
    "config_layout_matched": "the library's: config layout, free entries N(0, c^2/m), partners N(0, m s^4/c^2)",
    "max_volume": "the previous: factors N(0, s^2) moved to greedy max-volume pivots (conversion's move)",
    "config_layout_free_scales": "config layout, free entries and partners N(0, s^2), pivot entries c",
}
CONTENDERS = ("relational_pivot", "relational_pivot_vpr")
REFERENCE = "relational_free"


@torch.no_grad()
def apply_init(model: torch.nn.Module, init: str) -> None:
    """Re-initialise the gauge-fixed factor pairs of a freshly built pivot-gauge model as `init` says (the library's
    own initialisation, config_layout_matched, is left as built)."""
    from relational_hf.modeling import GaugeFixedLinear

    std = model.config.initializer_range
    for module in model.modules():
        if not hasattr(module, "gauge_pairs") or init in ("config_layout_matched", "free_gauge"):
            continue
        if init == "max_volume":
            module.set_full_weights({k: torch.randn_like(w) * std for k, w in module.full_weights().items()})
        elif init == "config_layout_free_scales":
            for partner, fixed in module.gauge_pairs():
                if isinstance(fixed, GaugeFixedLinear):
                    partner.weight.normal_(0.0, std)
                    fixed.weight.normal_(0.0, std)
        else:
            raise ValueError(f"unknown initialisation {init!r}")


def train(job: dict, train_ids: torch.Tensor, val_blocks: torch.Tensor) -> dict:
    from relational_hf.lm.data import RandomBlockDataset
    from relational_hf.lm.metrics import token_nll

    start = time.perf_counter()
    torch.manual_seed(job["seed"])
    model = build_model(job["contender"], job["dims"], job["vocab_size"])
    apply_init(model, job["init"])
    model.train()
    stepper, inner = make_optimizer(model, job["lr"], projected=False)
    windows = RandomBlockDataset(train_ids, CONTEXT, job["steps"] * BATCH_SIZE, seed=job["seed"])
    trained = train_steps(model, stepper, inner, windows, steps=job["steps"], batch=BATCH_SIZE)
    val = float("nan")
    if not trained["diverged"]:
        total, count = token_nll(model, val_blocks, batch_size=64)
        val = total / count
    return {k: job[k] for k in ("contender", "init", "size", "seed", "lr")} | {
        "val_loss": val,
        "diverged": trained["diverged"],
        "seconds": time.perf_counter() - start,
    }


def analyse(runs: list[dict]) -> dict:
    """Mean and sd of the validation loss per (contender, init, size); per-seed differences to max_volume."""
    groups: dict[tuple, dict[int, float]] = {}
    for r in runs:
        groups.setdefault((r["contender"], r["init"], r["size"]), {})[r["seed"]] = r["val_loss"]
    table = {}
    for (contender, init, size), by_seed in sorted(groups.items()):
        values = list(by_seed.values())
        row = {
            "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values),
        }
        base = groups.get((contender, "max_volume", size))
        if base is not None and init != "max_volume":
            diffs = [by_seed[s] - base[s] for s in by_seed if s in base]
            row["minus_max_volume"] = {
                "mean": statistics.fmean(diffs),
                "sd": statistics.stdev(diffs) if len(diffs) > 1 else None,
                "per_seed": diffs,
            }
        table[f"{contender}/{init}/{size}"] = row
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="shakespeare")
    parser.add_argument("--quick", action="store_true", help="q16/q32, 50 steps, 2 seeds")
    parser.add_argument("--sizes", help="comma-separated sizes of the quality benchmark (default: d32,d64,d96)")
    parser.add_argument("--seeds", type=int, help="number of seeds (default 3; 2 with --quick)")
    parser.add_argument("--inits", help=f"comma-separated initialisations (default: all of {', '.join(INITS)})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    from relational_hf.lm.data import lm_blocks

    budget = BUDGETS["quick" if args.quick else "default"]
    all_sizes = {**BUDGETS["default"]["sizes"], **BUDGETS["quick"]["sizes"]}
    names = args.sizes.split(",") if args.sizes else (list(budget["sizes"]) if args.quick else ["d32", "d64", "d96"])
    sizes = {n: all_sizes[n] for n in names}
    seeds = list(range(args.seeds or budget["seeds"]))
    inits = args.inits.split(",") if args.inits else list(INITS)
    if set(inits) - set(INITS):
        parser.error(f"--inits: unknown {sorted(set(inits) - set(INITS))}; choose from {', '.join(INITS)}")
    stored = common.RESULTS / f"quality_{args.corpus}.json"
    lr = json.loads(stored.read_text())["lr_sweep"]["chosen_lr"]  # the quality benchmark's frozen peak LR
    relpath, loader = CORPORA[args.corpus]
    data = loader()
    train_ids, val_ids = data["train_ids"], data["val_ids"]
    if budget["eval_tokens"]:
        val_ids = val_ids[: budget["eval_tokens"]]
    val_blocks = lm_blocks(val_ids, CONTEXT)
    jobs = [
        dict(contender=c, init=i, size=s, dims=sizes[s], seed=seed, lr=lr, vocab_size=data["vocab_size"])
        for s in sizes
        for seed in seeds
        for c, i in [(REFERENCE, "free_gauge"), *((c, i) for c in CONTENDERS for i in inits)]
    ]
    runs = []
    name = f"pivot_init_{args.corpus}" + ("_quick" if args.quick else "")
    payload: dict = {}
    for job in jobs:
        job["steps"] = budget["steps"]
        runs.append(train(job, train_ids, val_blocks))
        logger.info(
            "%s %s %s seed %d: %.4f (%.0f s, load %.1f)",
            *(job[k] for k in ("contender", "init", "size", "seed")),
            runs[-1]["val_loss"],
            runs[-1]["seconds"],
            os.getloadavg()[0],
        )
        payload = {
            "corpus": {"name": args.corpus, "source": relpath, "vocab_size": data["vocab_size"]},
            "budget": {"steps": budget["steps"], "batch_size": BATCH_SIZE, "context": CONTEXT, "seeds": seeds},
            "optimizer": dict(OPTIMIZER, peak_lr=lr, peak_lr_from=f"benchmarks/results/{stored.name} lr_sweep"),
            "sizes": sizes,
            "inits": {i: INITS[i] for i in inits},
            "threads": args.threads,
            "load_average_at_end": os.getloadavg(),
            "runs": runs,
            "results": analyse(runs),
        }
        common.write_json(name, payload)  # partial results survive an interrupted run
    return payload


if __name__ == "__main__":
    main()
