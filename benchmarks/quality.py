"""Quality per parameter: validation loss against stored parameter count, relational variants against a
Transformers Llama family, at equal tokens and equal optimiser settings.

Every contender trains the same sizes with the same seeds (seed = model init and batch order), the same tokens and
the same AdamW + warmup/cosine schedule, whose peak learning rate is chosen once by a small sweep on one Llama size
(the smallest, or --sweep-size) and then frozen. For each relational point the Llama-equivalent parameter count is the Llama curve (mean
validation loss against log parameters, piecewise linear) inverted at that point's loss; the parameter-efficiency
ratio is Llama-equivalent / stored parameters. The goal chased in issue 7: a relational family for which Llama
needs >= 1.3x the parameters for the same loss.

    python benchmarks/quality.py                       # both corpora, default budget (~30 min per corpus, 2 cores)
    python benchmarks/quality.py --corpus shakespeare  # one corpus
    python benchmarks/quality.py --quick               # tiny sizes, few steps (< 3 minutes)
    python benchmarks/quality.py --long                # 5x the tokens (GPU or overnight CPU)
    python benchmarks/quality.py --seeds 2 --contenders llama,relational_pivot   # a reduced grid
    python benchmarks/quality.py --corpus wikitext2 --sweep-size d96   # LR swept on the largest default Llama
    python benchmarks/quality.py --reanalyse --long    # recompute verdicts of the stored JSON (trains nothing)

Corpora (read from ../shared/data; skipped with a message where absent):
- shakespeare: Tiny Shakespeare, character level (the byte-level tokenizer, ids compacted to the characters that
  occur: 65), first 90% of the text (cut at a line boundary) trains, last 10% validates (nanoGPT's split);
- wikitext2: WikiText-2 *validation* text (the train split is not available here) split by documents (`= Title =`
  headings), first 90% of documents train, last 10% validate, byte-level BPE (vocabulary 1024) trained on the
  train part only.

Writes benchmarks/results/quality_<corpus>[_quick|_long].json and .png. The code lives in quality_setup.py (sizes,
contenders, budgets, corpora, models), quality_runner.py (schedule, the training loop, worker pool) and
quality_analysis.py (Llama curve, verdicts, plot, tables); this file is the driver.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time

import common
import torch
from quality_analysis import (
    analyse,
    markdown_table,
    plot,
    print_table,
)
from quality_runner import Runner
from quality_setup import (
    BATCH_SIZE,
    BUDGETS,
    CONTENDERS,
    CONTEXT,
    CONTROLS,
    CORPORA,
    DEFAULT_CONTENDERS,
    OPTIMIZER,
    PROJECTED,
    model_signature,
    projected_optimizer_status,
)

from relational_hf.lm import corpora as data_folder

logger = logging.getLogger("quality")


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def load_previous(name: str, steps: int, vocab_size: int, sizes: dict) -> dict:
    """Runs (and the LR sweep) of an earlier, possibly interrupted, invocation writing results/<name>.json that are
    valid for this one: same steps, batch, context, vocabulary and size dimensions."""
    path = common.RESULTS / f"{name}.json"
    if not path.is_file():
        return {"runs": [], "lr_sweep": None}
    old = json.loads(path.read_text())
    same = (
        old.get("budget", {}).get("steps") == steps
        and old["budget"].get("batch_size") == BATCH_SIZE
        and old["budget"].get("context") == CONTEXT
        and old.get("corpus", {}).get("vocab_size") == vocab_size
        and old.get("optimizer", {}).get("schedule") == OPTIMIZER["schedule"]
    )
    if not same:
        logger.warning("--resume: %s was made with other settings; starting afresh", path)
        return {"runs": [], "lr_sweep": None}
    runs = [
        r
        for r in old.get("runs", [])
        if old["sizes"].get(r["size"]) == sizes.get(r["size"])
        and r["steps"] == steps
        and _same_model(r, sizes[r["size"]], vocab_size)
    ]
    stale = len(old.get("runs", [])) - len(runs)
    if stale:
        logger.info("--resume: %d earlier runs are for other sizes, steps or model configs; they run again", stale)
    return {"runs": runs, "lr_sweep": old.get("lr_sweep")}


def _same_model(run: dict, dims: dict, vocab_size: int) -> bool:
    """The run was made with today's model config. Runs written before signatures were recorded are kept only for
    Transformers' Llama (its config did not change); relational runs from then predate `final_norm_gain`."""
    if run["contender"] not in CONTENDERS:
        return False
    if "model_signature" not in run:
        return CONTENDERS[run["contender"]][1] is None
    return run["model_signature"] == model_signature(run["contender"], dims, vocab_size)


def result_name(corpus: str, budget_name: str, tag: str | None = None) -> str:
    """quality_<corpus>[_<budget>][_<tag>]: the results file of one corpus, budget and (optional) focused rerun."""
    return f"quality_{corpus}" + ("" if budget_name == "default" else f"_{budget_name}") + (f"_{tag}" if tag else "")


#: The seed of the learning-rate sweep's runs: one the grid does not use, so that no grid point is the run the sweep
#: selected on the validation set (results made before this reused the sweep's seed-0 winner; see `caveats`).
SWEEP_SEED = 1000


def lr_sweep(runner: Runner, job: dict, size: str, dims: dict, lrs: list[float]) -> tuple[dict, list[dict]]:
    """Train one Llama size (seed SWEEP_SEED) at each peak LR; the one with the lowest validation loss is frozen for
    the whole grid. Returns (the sweep's record, its runs)."""
    logger.info("LR sweep on llama/%s, seed %d: %s", size, SWEEP_SEED, lrs)
    runs = runner.run([dict(job, contender="llama", size=size, dims=dims, seed=SWEEP_SEED, lr=v) for v in lrs])
    runs.sort(key=lambda r: r["lr"])
    best = min(runs, key=lambda r: r["val_loss"] if math.isfinite(r["val_loss"]) else float("inf"))
    logger.info("chosen peak LR %.0e", best["lr"])
    record = {
        "model": f"llama/{size}",
        "seed": SWEEP_SEED,
        "steps": job["steps"],
        "candidates": [{"lr": r["lr"], "val_loss": r["val_loss"]} for r in runs],
        "chosen_lr": best["lr"],
        "at_edge_of_sweep": best["lr"] in (min(lrs), max(lrs)),
        "how": "lowest validation loss; then frozen for every contender, size and seed; the sweep's seed is not one "
        "of the grid's, so its runs are not grid points",
    }
    return record, runs


def run_corpus(corpus: str, args: argparse.Namespace, budget_name: str) -> dict | None:
    """Load one corpus, sweep the LR on one Llama size (unless --lr), train the grid, analyse, write JSON/PNG."""
    from relational_hf.lm.data import lm_blocks

    relpath, loader = CORPORA[corpus]
    if not (common.SHARED_DATA / relpath).is_file():
        name = next(n for n, (rel, _how) in data_folder.CORPORA.items() if rel == relpath)
        logger.warning("skipping %s: %s", corpus, data_folder.missing_message(name))
        return None
    started = time.monotonic()
    budget = BUDGETS[budget_name]
    steps = args.steps or budget["steps"]
    seeds = list(range(args.seeds or budget["seeds"]))
    sizes = {k: v for k, v in budget["sizes"].items() if not args.sizes or k in args.sizes}
    data = loader()
    train_ids, val_ids = data.pop("train_ids"), data.pop("val_ids")
    if budget["eval_tokens"]:
        val_ids = val_ids[: budget["eval_tokens"]]
    val_blocks = lm_blocks(val_ids, CONTEXT)
    data.update(train_tokens=train_ids.numel(), val_tokens=val_blocks.numel())
    data["val_tokens_per_char"] = None if budget["eval_tokens"] else val_ids.numel() / data["val_chars"]
    logger.info(
        "%s: %d train / %d validation tokens, vocabulary %d",
        corpus,
        train_ids.numel(),
        val_blocks.numel(),
        data["vocab_size"],
    )
    contenders, skipped = list(args.contenders or DEFAULT_CONTENDERS), {}
    reason = projected_optimizer_status() if PROJECTED & set(contenders) else None
    for c in [c for c in contenders if c in PROJECTED and reason]:
        logger.warning("skipping %s: %s", c, reason)
        skipped[c] = reason
        contenders.remove(c)
    job = dict(vocab_size=data["vocab_size"], batch_size=BATCH_SIZE, context=CONTEXT, steps=steps)
    sweep_size = args.sweep_size or min(sizes, key=lambda s: sum(sizes[s].values()))
    if sweep_size not in sizes:
        raise ValueError(f"--sweep-size {sweep_size!r} is not among the sizes run: {list(sizes)}")
    name = result_name(corpus, budget_name, args.tag)
    previous = load_previous(name, steps, data["vocab_size"], sizes) if args.resume else {"runs": [], "lr_sweep": None}
    deadline = started + 60 * args.max_minutes if args.max_minutes else None
    with Runner(args.workers, args.threads, train_ids, val_blocks) as runner:
        if args.lr:
            sweep = {"chosen_lr": args.lr, "how": "given with --lr (no sweep)"}
        elif (
            previous["lr_sweep"]
            and previous["lr_sweep"].get("model") == f"llama/{sweep_size}"
            and previous["lr_sweep"].get("seed") == SWEEP_SEED  # a sweep on a grid seed selected a grid point
        ):
            sweep = previous["lr_sweep"]
            logger.info("LR sweep taken from the previous results: peak LR %.0e", sweep["chosen_lr"])
        else:
            sweep, _ = lr_sweep(runner, job, sweep_size, sizes[sweep_size], budget["sweep_lrs"])
        lr = sweep["chosen_lr"]
        wanted = {(c, s, seed) for c in contenders for s in sizes for seed in seeds}
        reuse = [r for r in previous["runs"] if r["lr"] == lr and (r["contender"], r["size"], r["seed"]) in wanted]
        reuse = list({(r["contender"], r["size"], r["seed"]): r for r in reuse}.values())
        have = {(r["contender"], r["size"], r["seed"]) for r in reuse}
        largest_first = sorted(sizes, key=lambda s: -sum(sizes[s].values()))
        jobs = [
            dict(job, contender=c, size=s, dims=sizes[s], seed=seed, lr=lr)
            for c in contenders  # in priority order: a run cut short by --max-minutes has whole curves
            for s in largest_first
            for seed in seeds
            if (c, s, seed) not in have
        ]
        if previous["runs"]:
            logger.info("reusing %d runs from the previous results; %d to run", len(reuse), len(jobs))
        payload = {
            "corpus": data,
            "budget": {
                "name": budget_name,
                "steps": steps,
                "batch_size": BATCH_SIZE,
                "context": CONTEXT,
                "tokens_per_run": steps * BATCH_SIZE * CONTEXT,
                "epochs_per_run": steps * BATCH_SIZE * CONTEXT / train_ids.numel(),
                "seeds": seeds,
                "seed_meaning": "torch.manual_seed before model init, and the order of training windows",
            },
            "optimizer": dict(OPTIMIZER, peak_lr=lr),
            "lr_sweep": sweep,
            "sizes": sizes,
            "contenders": {c: CONTENDERS[c][0] for c in contenders},
            "skipped": skipped,
            "parameter_count": "trainable parameters stored (tied embedding counted once); the pivot gauge's index "
            "buffers are not learned and not counted; formula_parameters is relational_hf.params' closed form",
            "workers": args.workers,
            "threads_per_worker": args.threads,
            "reused_runs": len(reuse),
        }

        def checkpoint(runs: list[dict]) -> None:  # partial results survive an interrupted run
            common.write_json(name, {**payload, "partial": True, "runs": reuse + runs})

        new_runs = runner.run(jobs, on_done=checkpoint, deadline=deadline)
    runs = reuse + new_runs
    done = {(r["contender"], r["size"], r["seed"]) for r in runs}
    payload["not_run"] = [f"{c}/{s}/seed {seed}" for c, s, seed in sorted(wanted - done)]
    if payload["not_run"]:
        logger.warning(
            "%d runs not started within --max-minutes %g (finish them with --resume): %s",
            len(payload["not_run"]),
            args.max_minutes,
            ", ".join(payload["not_run"]),
        )
    for r in runs:
        if r["parameters"] != r["formula_parameters"]:
            logger.warning(
                "%s/%s: stored %d parameters, formula says %d",
                r["contender"],
                r["size"],
                r["parameters"],
                r["formula_parameters"],
            )
    payload.update(analyse(runs, sizes))
    payload["caveats"] = caveats({**payload, "runs": runs})
    payload["runs"] = sorted(runs, key=lambda r: (r["contender"], list(sizes).index(r["size"]), r["seed"]))
    payload["wall_seconds"] = time.monotonic() - started  # this invocation (not reused runs)
    payload["run_seconds_total"] = sum(r["seconds"] for r in runs)  # every run, reused ones included
    path = common.write_json(name, payload)
    plot(payload, common.RESULTS / f"{name}.png")
    logger.info("wrote %s (%.0f s)", path, payload["wall_seconds"])
    print_table(payload)
    return payload


def caveats(payload: dict) -> list[str]:
    """What the reader of one results JSON must know before trusting its verdicts (also marks, in
    payload["lr_sweep"], a sweep run reused as a grid point)."""
    out = []
    sweep = payload.get("lr_sweep") or {}
    sweep.pop("reused_as_grid_run", None)
    if "model" in sweep:
        size, seed = sweep["model"].split("/", 1)[1], sweep.get("seed", 0)
        reused = [
            r
            for r in payload.get("runs", [])
            if r["contender"] == "llama" and r["size"] == size and r["seed"] == seed and r["lr"] == sweep["chosen_lr"]
        ]
        if reused:
            sweep["reused_as_grid_run"] = f"{sweep['model']}/seed {seed} (see caveats)"
            out.append(
                f"Llama's {size}/seed {seed} point is the LR sweep's winning run, chosen as the lowest validation loss on "
                f"this same validation set: that point is selected on the data it is scored on (optimistic for Llama "
                f"at {size}); new sweeps run on seed {SWEEP_SEED}, outside the grid, which removes this"
            )
    budget, corpus = payload.get("budget", {}), payload.get("corpus", {})
    epochs = budget.get("epochs_per_run")
    gaps = [
        r["val_loss"] - r["train_loss_last_5pct"]
        for r in payload.get("runs", [])
        if math.isfinite(r["val_loss"]) and math.isfinite(r.get("train_loss_last_5pct", float("nan")))
    ]
    if epochs and epochs > 1.5 and gaps:
        out.append(
            f"{epochs:.1f} passes over {corpus.get('train_tokens', 0) / 1e6:.2f}M training tokens, validation minus "
            f"final training loss {min(gaps):.2f} to {max(gaps):.2f} nats: an overfitting regime, in which the "
            "comparison measures how models memorise a small corpus as much as how they learn it"
        )
    seeds = budget.get("seeds") or []
    out.append(
        f"{len(seeds)} seeds per point: the standard errors are rough; verdicts within a factor ~1.5 of their "
        "threshold need more seeds before they are quoted"
    )
    return out


def reanalyse(name: str) -> dict | None:
    """Recompute the analysis of results/<name>.json from its runs with today's rule (nothing is trained), record the
    verdicts that changed and the caveats, and rewrite the JSON (atomically) and its PNG."""
    path = common.RESULTS / f"{name}.json"
    if not path.is_file():
        return None
    payload = json.loads(path.read_text())
    before = {(c, s): r.get("verdict") for c, comp in payload.get("comparisons", {}).items() for s, r in comp.items()}
    payload.update(analyse(payload["runs"], payload["sizes"]))
    changes = []
    for c, comp in payload["comparisons"].items():
        for s, r in comp.items():
            old = before.get((c, s))
            if old is not None and old != r["verdict"]:
                changes.append({"contender": c, "size": s, "before": old, "after": r["verdict"]})
    payload["verdict_changes"] = {
        "what": "verdicts of this file before it was re-analysed (one Llama standard error averaged over all sizes) "
        "that differ under verdict_rule",
        "changes": changes,
    }
    payload["caveats"] = caveats(payload)
    payload["reanalysed_with"] = " ".join(["quality.py", *sys.argv[1:]])
    fd, staged = tempfile.mkstemp(dir=common.RESULTS, prefix=f".{name}.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.chmod(staged, 0o644)
    os.replace(staged, path)
    plot(payload, common.RESULTS / f"{name}.png")
    return payload


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--quick", action="store_true", help="tiny sizes, 50 steps, 2 seeds (under 3 minutes)")
    budget.add_argument("--long", action="store_true", help="5x the default tokens per run")
    parser.add_argument("--corpus", choices=[*CORPORA, "all"], default="all")
    parser.add_argument(
        "--contenders",
        type=lambda s: s.split(","),
        help=f"comma-separated subset of {','.join(CONTENDERS)}, or 'all' (default: all but the controls "
        f"{', '.join(sorted(CONTROLS))})",
    )
    parser.add_argument("--sizes", type=lambda s: s.split(","), help="comma-separated subset of the budget's sizes")
    parser.add_argument("--seeds", type=int, help="number of seeds (default: the budget's, 3; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the budget's)")
    parser.add_argument("--lr", type=float, help="peak learning rate; skips the sweep")
    parser.add_argument(
        "--sweep-size",
        help="the Llama size the LR sweep trains (default: the smallest). On WikiText-2 the smallest picks an LR at "
        "which larger Llamas train worse than smaller ones; the largest size is the safer choice there",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1 if torch.cuda.is_available() else min(os.cpu_count() or 1, 8),
        help="runs in parallel processes (default: one per CPU core, at most 8; 1 on CUDA)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: 1)")
    parser.add_argument(
        "--tag",
        help="suffix of the results files (quality_<corpus>_<tag>.json), for a focused rerun (e.g. two contenders with "
        "more seeds) that must not replace the full grid's file",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        help="start no run after this many minutes per corpus; the analysis covers what finished (contenders run in "
        "the order given, so the first ones have whole curves)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse the runs (and LR sweep) already in the results JSON made with the same settings; run the rest",
    )
    parser.add_argument(
        "--reanalyse",
        action="store_true",
        help="recompute the verdicts, caveats and plot of the existing results JSON of each corpus (and budget) from "
        "its runs with today's rule, rewrite it, and exit; trains nothing",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the README table of the existing results JSON of each corpus (and budget) and exit; trains nothing",
    )
    args = parser.parse_args(argv)
    if args.contenders == ["all"]:
        args.contenders = list(CONTENDERS)
    if args.reanalyse:
        budget_name = "quick" if args.quick else "long" if args.long else "default"
        for corpus in list(CORPORA) if args.corpus == "all" else [args.corpus]:
            name = result_name(corpus, budget_name, args.tag)
            payload = reanalyse(name)
            if payload is not None:
                for change in payload["verdict_changes"]["changes"]:
                    print(f"{name}: {change['contender']}/{change['size']}: {change['before']} -> {change['after']}")
                print_table(payload)
        return []
    if args.markdown:
        budget_name = "quick" if args.quick else "long" if args.long else "default"
        for corpus in list(CORPORA) if args.corpus == "all" else [args.corpus]:
            name = result_name(corpus, budget_name, args.tag)
            path = common.RESULTS / f"{name}.json"
            if path.is_file():
                print(f"{name}\n\n{markdown_table(json.loads(path.read_text()))}\n")
        return []
    unknown = set(args.contenders or []) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contender(s) {sorted(unknown)}; choose from {list(CONTENDERS)}")
    budget_name = "quick" if args.quick else "long" if args.long else "default"
    unknown = set(args.sizes or []) - set(BUDGETS[budget_name]["sizes"])
    if unknown:
        parser.error(
            f"unknown size(s) {sorted(unknown)} for the {budget_name} budget; choose from {list(BUDGETS[budget_name]['sizes'])}"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    corpora = list(CORPORA) if args.corpus == "all" else [args.corpus]
    payloads = [p for c in corpora if (p := run_corpus(c, args, budget_name)) is not None]
    if not payloads:
        logger.warning("no corpus found under %s: nothing measured (see %s)", common.SHARED_DATA, data_folder.DATA_ENV)
    return payloads


if __name__ == "__main__":
    main()
