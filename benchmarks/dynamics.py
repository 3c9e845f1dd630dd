"""Training dynamics on the quotient, measured (issue 6): free-gauge AdamW, free-gauge AdamW with projected updates
(`relational_hf.symmetry.ProjectedOptimizer`) and the pivot gauge, 3 seeds each, on Tiny Shakespeare characters.

    python benchmarks/dynamics.py            # size d64 (d=64, 2 layers), 800 steps, 3 seeds x 3 settings (~6-9 min, 2 cores)
    python benchmarks/dynamics.py --quick    # size q32 (d=32, 1 layer), 60 steps (< 2 minutes)

Every run uses the quality benchmark's models, corpus split, batch (12 x 64 tokens), AdamW settings, warmup/cosine
schedule and training loop (benchmarks/quality_setup.py, quality_runner.py), at one peak learning rate (PEAK_LR, not
swept); seed = model init and batch order. A
`relational_hf.dynamics.QuotientRecorder` records every run (trajectory files under results/dynamics[_quick]_runs/,
figures of `relational-hf dynamics` under results/dynamics[_quick]_plots/). Measured:

(i)   loss: training loss per step (moving average over SMOOTH steps), validation loss; steps for the smoothed training
      loss to reach the target = the highest of the runs' best smoothed losses (a loss every run reaches);
(ii)  variance of the update direction across mini-batches: at a few steps, one optimiser step from the run's current
      weights and optimiser state on each of B fixed mini-batches; for the updates u_b: the direction variance
      mean_b |u_b/|u_b| - mean|^2 = 1 - |mean_b u_b/|u_b||^2, the mean pairwise cosine and the relative variance
      mean_b |u_b - mean u|^2 / mean_b |u_b|^2; the same for their horizontal parts and for the clipped gradients;
(iii) seed-to-seed relative distance |a - b| / rms(|a|, |b|) of the final models (exact, full vectors): raw
      parameters, canonical-gauge parameters (`symmetry.canonicalize`), invariant descriptors (G_QK / G_VO spectra and
      head similarities; also with heads sorted, blind to head permutations), and the functions (symmetrised KL of the
      next-token distributions on validation text);
(iv)  gauge share of the raw motion: sum |P_V Delta|^2 / sum |Delta|^2 over the chords between records, and the mean
      vertical share |P_V delta| / |delta| of the recorded updates (P_V: the groups ProjectedOptimizer projects).
Also the recorder's cost: its seconds per record against the training step time, and the overhead at its default
interval.

Writes results/dynamics[_quick].json and .png.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import math
import os
import statistics
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import common
import numpy as np
import quality_runner
import quality_setup
import torch

logger = logging.getLogger("dynamics")

#: name -> (description, the quality benchmark's contender)
VARIANTS = {
    "free_adamw": ("relational, free gauge, plain AdamW", "relational_free"),
    "free_adamw_projected": (
        "relational, free gauge, AdamW wrapped in relational_hf.symmetry.ProjectedOptimizer",
        "relational_free_projected",
    ),
    "pivot": ("relational, pivot gauge (QK, VO, MLP scales fixed in storage), plain AdamW", "relational_pivot"),
}
#: model sizes (the keys of quality_setup.build_model's dims): the quality benchmark's "d64" and its quick "q32"
D64 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=192)
Q32 = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=96)
BUDGETS = {
    "quick": dict(size="q32", dims=Q32, steps=60, every=10, variance_at=[30, 60], variance_batches=4, eval_every=30,
                  eval_blocks=32, kl_blocks=8),
    "default": dict(size="d64", dims=D64, steps=800, every=20, variance_at=[200, 400, 600, 800], variance_batches=8,
                    eval_every=100, eval_blocks=256, kl_blocks=32),
}  # fmt: skip
SEEDS = [0, 1, 2]
PEAK_LR = 4e-3  # the peak LR the quality benchmark's sweep chose on Tiny Shakespeare (llama/d32, 600 steps)
SMOOTH = 25
SKETCH_DIM, SKETCH_SEED = 512, 0
PROBE_BLOCKS = 4  # fixed validation blocks of the recorder's probe (loss, parallel ratio)
BATCH_SEED = 1234  # the fixed mini-batches of (ii)


# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------

_DATA: dict = {}


def _set_data(data: dict, threads: int) -> None:
    """Worker initializer: the token streams and the torch thread count."""
    _DATA.update(data)
    torch.set_num_threads(threads)


def make_optimizer(
    model: torch.nn.Module, variant: str, lr: float
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(what steps, the inner AdamW): the quality benchmark's optimiser, projected for the projected variant."""
    return quality_runner.make_optimizer(model, lr, VARIANTS[variant][1] in quality_setup.PROJECTED)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def direction_statistics(vectors: list[torch.Tensor]) -> dict:
    """For vectors u_b (one per mini-batch): direction variance 1 - |mean_b u_b/|u_b||^2 (= mean_b |u_b/|u_b| - mean|^2),
    mean pairwise cosine, relative variance mean_b |u_b - mean u|^2 / mean_b |u_b|^2, and the mean norm."""
    v = torch.stack(vectors)  # (B, n)
    norms = v.norm(dim=1)
    unit = v / norms.clamp_min(1e-300)[:, None]
    b = v.shape[0]
    total = unit.sum(0)
    return {
        "direction_variance": float(1 - (total / b).square().sum()),
        "mean_pairwise_cosine": float((total.square().sum() - b) / (b * (b - 1))),
        "relative_variance": float((v - v.mean(0)).square().sum(1).mean() / v.square().sum(1).mean()),
        "mean_norm": float(norms.mean()),
    }


def update_variance(model, stepper, variant: str, lr: float, batches: torch.Tensor) -> dict:
    """(ii) at the current weights and optimiser state: one step on each of the fixed mini-batches (on copies);
    `direction_statistics` of the updates, of their horizontal parts (P_V at the current weights) and of the clipped
    gradients."""
    from relational_hf.symmetry import UpdateProjector

    state = stepper.state_dict()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    updates, grads = [], []
    for ids in batches:
        trial = copy.deepcopy(model)
        trial_stepper, _ = make_optimizer(trial, variant, lr)
        trial_stepper.load_state_dict(copy.deepcopy(state))
        params = [p for p in trial.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        trial(input_ids=ids[None] if ids.dim() == 1 else ids, labels=ids, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(trial.parameters(), quality_setup.OPTIMIZER["grad_clip_norm"])
        grads.append(_flat(p.grad for p in params))
        trial_stepper.step()
        updates.append({n: (p.detach() - b).double() for n, p, b in zip(names, params, before)})
    projector = UpdateProjector(model)
    horizontal = [_flat(projector.split(u)[1][n] for n in names) for u in updates]
    return {
        "update": direction_statistics([_flat(u[n] for n in names) for u in updates]),
        "update_horizontal": direction_statistics(horizontal),
        "gradient": direction_statistics(grads),
    }


@torch.no_grad()
def _log_probs(model, blocks: torch.Tensor) -> np.ndarray:
    model.eval()
    out = torch.log_softmax(model(input_ids=blocks, use_cache=False).logits.double(), -1)
    model.train()
    return out.numpy()


def run_one(job: dict) -> dict:
    """Train one variant with one seed, recording its trajectory; returns losses, (ii) statistics, final coordinates
    and timings."""
    from relational_hf.dynamics import TRAJECTORY_NAME, QuotientRecorder
    from relational_hf.lm.data import RandomBlockDataset
    from relational_hf.lm.metrics import token_nll
    from relational_hf.symmetry import canonicalize

    started = time.perf_counter()
    variant, seed, steps, lr = job["variant"], job["seed"], job["steps"], job["lr"]
    torch.manual_seed(seed)
    model = quality_setup.build_model(VARIANTS[variant][1], job["dims"], job["vocab_size"])
    model.train()
    stepper, inner = make_optimizer(model, variant, lr)
    metadata = {"label": f"{variant} seed {seed}", "group": variant, "seed": seed,
                "projection": VARIANTS[variant][1] in quality_setup.PROJECTED, "learning_rate": lr}  # fmt: skip
    recorder = QuotientRecorder(model, every=job["every"], sketch_dim=SKETCH_DIM, seed=SKETCH_SEED,
                                probe_input_ids=_DATA["probe"], metadata=metadata)  # fmt: skip
    batch = quality_setup.BATCH_SIZE
    windows = RandomBlockDataset(_DATA["train_ids"], quality_setup.CONTEXT, steps * batch, seed=seed)
    recorder.record(0)
    val, variance = [], {}
    due, lr_now = False, lr

    def before_step(step: int) -> None:
        nonlocal due, lr_now
        due = recorder.due(step + 1) or step + 1 == steps
        lr_now = inner.param_groups[0]["lr"]  # this step's learning rate
        if due:
            recorder.before_update()

    def after_step(step: int, loss: float) -> None:
        if due:
            recorder.after_update()
        recorder.add_loss(step + 1, loss)
        if due:
            recorder.record(step + 1)
        if step + 1 in job["variance_at"]:
            variance[step + 1] = update_variance(model, stepper, variant, lr_now, _DATA["variance_batches"])
        if (step + 1) % job["eval_every"] == 0 or step + 1 == steps:
            total, count = token_nll(model, _DATA["eval_blocks"], batch_size=64)
            val.append((step + 1, total / count))

    trained = quality_runner.train_steps(
        model, stepper, inner, windows, steps=steps, batch=batch, before_step=before_step, after_step=after_step
    )
    losses, step_seconds = trained["train_losses"], trained["step_seconds"]
    run_dir = Path(job["runs_dir"]) / f"{variant}_seed{seed}"
    recorder.save(run_dir / TRAJECTORY_NAME)
    total, count = token_nll(model, _DATA["val_blocks"], batch_size=64)
    final = recorder.records[-1]
    trajectory = recorder.trajectory()
    canonical = canonicalize(model)
    record_seconds = [float(r["seconds"]) for r in recorder.records[1:]]
    return {
        "variant": variant,
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_loss": losses,
        "val_loss_curve": val,
        "final_val_loss": total / count,
        "variance": variance,
        "summary": trajectory.summary(),
        "update_vertical_share": trajectory.vertical_share("update").tolist(),
        "record_steps": trajectory.steps.tolist(),
        "layout_signature": trajectory.metadata.get("layout_signature"),
        "raw": _flat(p for p in model.parameters() if p.requires_grad).float().numpy(),
        "canonical": _flat(p for p in canonical.parameters() if p.requires_grad).float().numpy(),
        "coordinates": {k: np.asarray(final[k]) for k in ("raw_sketch", "canonical_sketch", "qk_spectrum",
                                                           "vo_spectrum", "qk_similarity", "vo_similarity")},
        "log_probs": _log_probs(model, _DATA["kl_blocks"]),
        "mean_step_seconds": statistics.fmean(step_seconds),
        "mean_record_seconds": statistics.fmean(record_seconds) if record_seconds else math.nan,
        "train_step_seconds": sum(step_seconds),
        "record_seconds": sum(float(r["seconds"]) for r in recorder.records),
        "trajectory_file": str(run_dir / TRAJECTORY_NAME),
        "seconds": time.perf_counter() - started,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------------------------


def smooth(values: list[float], window: int = SMOOTH) -> np.ndarray:
    """Trailing moving average (shorter windows at the start)."""
    c = np.cumsum(np.insert(np.asarray(values, np.float64), 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _stats(values: list[float]) -> dict:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return {
        "mean": statistics.fmean(finite) if finite else None,
        "std": statistics.stdev(finite) if len(finite) > 1 else None,
        "values": values,
    }


def symmetric_kl(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over positions of (KL(p_a || p_b) + KL(p_b || p_a)) / 2 for log-probabilities (..., V)."""
    pa, pb = np.exp(a), np.exp(b)
    return float((0.5 * ((pa * (a - b)).sum(-1) + (pb * (b - a)).sum(-1))).mean())


def analyse(runs: list[dict], budget: dict) -> dict:
    from relational_hf.dynamics import DEFAULT_EVERY, coordinate_distances, descriptor_vector, relative_distance

    by_variant = {v: sorted((r for r in runs if r["variant"] == v), key=lambda r: r["seed"]) for v in VARIANTS}
    by_variant = {v: rs for v, rs in by_variant.items() if rs}
    smoothed = {(r["variant"], r["seed"]): smooth(r["train_loss"]) for r in runs}
    target = max(float(s.min()) for s in smoothed.values())
    out: dict = {"target_loss": target, "target_rule": "highest of the runs' best smoothed training losses",
                 "variants": {}}  # fmt: skip
    for variant, rs in by_variant.items():
        reach = [int(np.argmax(smoothed[(variant, r["seed"])] <= target)) + 1 for r in rs]
        distances: dict[str, list[float]] = {}
        for a, b in itertools.combinations(rs, 2):
            # stored entries are comparable only between runs with the same index layout (a pivot-gauge model's
            # pivot positions depend on its initialisation): otherwise only the invariants and the function are
            same_layout = a.get("layout_signature") == b.get("layout_signature")
            pair = {
                "raw": relative_distance(a["raw"], b["raw"]) if same_layout else None,
                "canonical": relative_distance(a["canonical"], b["canonical"]) if same_layout else None,
                "descriptors": relative_distance(descriptor_vector(a["coordinates"]),
                                                 descriptor_vector(b["coordinates"])),
                "descriptors_sorted_heads": relative_distance(descriptor_vector(a["coordinates"], True),
                                                              descriptor_vector(b["coordinates"], True)),
                "function_symmetric_kl": symmetric_kl(a["log_probs"], b["log_probs"]),
            }  # fmt: skip
            sketched = coordinate_distances(a["coordinates"], b["coordinates"]) if same_layout else {}
            pair["raw_from_sketch"], pair["canonical_from_sketch"] = sketched.get("raw"), sketched.get("canonical")
            for k, v in pair.items():
                distances.setdefault(k, []).append(v)
        variance = {}
        for step in budget["variance_at"]:
            entry = {}
            for kind in ("update", "update_horizontal", "gradient"):
                for stat in ("direction_variance", "mean_pairwise_cosine", "relative_variance"):
                    entry.setdefault(kind, {})[stat] = _stats([r["variance"][step][kind][stat] for r in rs
                                                               if step in r["variance"]])  # fmt: skip
            variance[step] = entry
        summaries = [r["summary"] for r in rs]
        step_s = statistics.fmean(r["mean_step_seconds"] for r in rs)
        record_s = statistics.fmean(r["mean_record_seconds"] for r in rs)
        out["variants"][variant] = {
            "description": VARIANTS[variant][0],
            "parameters": rs[0]["parameters"],
            "seeds": [r["seed"] for r in rs],
            "final_val_loss": _stats([r["final_val_loss"] for r in rs]),
            "final_train_loss_smoothed": _stats([float(smoothed[(variant, r["seed"])][-1]) for r in rs]),
            "steps_to_target": _stats(reach),
            "update_direction_variance": variance,
            "seed_distances": {k: _stats(v) for k, v in distances.items()},
            "gauge_share_of_motion": _stats([s["gauge_share_of_motion"] for s in summaries]),
            "mean_update_vertical_share": _stats([s.get("mean_update_vertical_share") for s in summaries]),
            "mean_gradient_vertical_share": _stats([s.get("mean_gradient_vertical_share") for s in summaries]),
            "path_length": {
                k: _stats([s["path_length"].get(k) for s in summaries])
                for k in ("raw", "vertical", "horizontal", "canonical")
            },  # fmt: skip
            "recorder_cost": {
                "mean_train_step_seconds": step_s,
                "mean_seconds_per_record": record_s,
                "overhead_at_benchmark_interval": record_s / (budget["every"] * step_s),
                "benchmark_interval": budget["every"],
                "overhead_at_default_interval": record_s / (DEFAULT_EVERY * step_s),
                "default_interval": DEFAULT_EVERY,
            },
        }
    return out


def plot(payload: dict, trajectories: list, path: Path) -> None:
    """The four measured claims in one PNG, from the payload and the runs' trajectories (same order as its runs)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 10), layout="constrained")
    (ax_loss, ax_var), (ax_seed, ax_gauge) = fig.subplots(2, 2)
    colors = {v: f"C{i}" for i, v in enumerate(VARIANTS)}
    for variant, entry in payload["variants"].items():
        runs = [r for r in payload["runs"] if r["variant"] == variant]
        curves = np.array([r["train_loss_smoothed_every_10"] for r in runs])
        x = 10 * np.arange(1, curves.shape[1] + 1)
        ax_loss.plot(x, curves.mean(0), color=colors[variant],
                     label=f"{variant}: {entry['steps_to_target']['mean']:.0f} steps to target, "
                           f"val {entry['final_val_loss']['mean']:.3f}")  # fmt: skip
        ax_loss.fill_between(x, curves.min(0), curves.max(0), color=colors[variant], alpha=0.2)
        steps = sorted(entry["update_direction_variance"], key=int)
        for kind, style, shift in (("update", "-o", -4), ("update_horizontal", "--s", 4)):
            stats = [entry["update_direction_variance"][s][kind]["direction_variance"] for s in steps]
            ax_var.errorbar([int(s) + shift for s in steps], [st["mean"] for st in stats],
                            yerr=[st["std"] or 0.0 for st in stats], fmt=style, color=colors[variant], capsize=3,
                            label=f"{variant} ({kind})")  # fmt: skip
        own = [t for t, r in zip(trajectories, payload["runs"]) if r["variant"] == variant]
        with warnings.catch_warnings():  # the first record has no update: an all-NaN column
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_share = np.nanmean(np.stack([t.vertical_share("update") for t in own]), axis=0)
        ax_gauge.plot(own[0].steps, np.maximum(mean_share, 1e-12), "-o", ms=3, color=colors[variant],
                      label=f"{variant}: gauge share of motion {entry['gauge_share_of_motion']['mean']:.3g}")  # fmt: skip
    ax_loss.axhline(payload["target_loss"], color="k", lw=0.8, ls=":", label="target")
    ax_loss.set(xlabel="step", ylabel=f"training loss (moving average over {SMOOTH} steps)",
                title="(i) loss, mean and min-max over seeds")  # fmt: skip
    ax_loss.legend(fontsize=7)
    ax_var.set(xlabel="step", ylabel="1 - |mean unit update|^2 across mini-batches",
               title="(ii) variance of the update direction, mean ± std over seeds (dashed: horizontal part)")  # fmt: skip
    ax_var.legend(fontsize=6)
    kinds = ["raw", "canonical", "descriptors", "descriptors_sorted_heads"]
    variants = list(payload["variants"])
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        means = [payload["variants"][v]["seed_distances"][kind]["mean"] for v in variants]
        means = [np.nan if m is None else m for m in means]  # no comparable pair (different pivot layouts)
        ax_seed.bar(np.arange(len(variants)) + (i - 1.5) * width, means, width, label=kind.replace("_", " "))
    labels = [f"{v}\nKL {payload['variants'][v]['seed_distances']['function_symmetric_kl']['mean']:.3f}"
              for v in variants]  # fmt: skip
    ax_seed.set_xticks(np.arange(len(variants)), labels, fontsize=8)
    ax_seed.set(ylabel="relative distance between seeds", title="(iii) seed-to-seed distance of the final models")
    ax_seed.legend(fontsize=7)
    ax_gauge.set_yscale("log")
    ax_gauge.set(xlabel="step", ylabel="|P_V delta| / |delta| of the recorded update (mean over seeds)",
                 title="(iv) vertical share of the updates (pivot: no group left, drawn at 1e-12)")  # fmt: skip
    ax_gauge.legend(fontsize=7)
    fig.suptitle(f"Training dynamics on the quotient: {payload['corpus']}, size {payload['budget']['size']}, "
                 f"{payload['budget']['steps']} steps, {len(SEEDS)} seeds")  # fmt: skip
    fig.savefig(path, dpi=110)


def print_table(payload: dict) -> None:
    print(f"\ntarget loss {payload['target_loss']:.4f}")
    head = f"{'variant':22s} {'val loss':>15s} {'steps->target':>13s} {'dir.var upd':>11s} {'dir.var hor':>11s} "
    print(
        head + f"{'raw dist':>8s} {'canon':>6s} {'descr':>6s} {'sorted':>6s} {'KL':>6s} {'gauge':>8s} {'upd.vert':>8s}"
    )
    def num(value, width: int, spec: str = ".3f") -> str:
        return f"{'–':>{width}s}" if value is None else f"{value:{width}{spec}}"

    for v, e in payload["variants"].items():
        last = e["update_direction_variance"][max(e["update_direction_variance"], key=int)]
        d = e["seed_distances"]
        val = e["final_val_loss"]
        print(
            f"{v:22s} {val['mean']:.4f} ± {val['std'] or 0:.4f} {e['steps_to_target']['mean']:13.0f} "
            f"{last['update']['direction_variance']['mean']:11.4f} "
            f"{last['update_horizontal']['direction_variance']['mean']:11.4f} "
            f"{num(d['raw']['mean'], 8)} {num(d['canonical']['mean'], 6)} {d['descriptors']['mean']:6.3f} "
            f"{d['descriptors_sorted_heads']['mean']:6.3f} {d['function_symmetric_kl']['mean']:6.3f} "
            f"{e['gauge_share_of_motion']['mean'] or 0:8.3g} {e['mean_update_vertical_share']['mean'] or 0:8.3g}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="size q32, 60 steps, 3 seeds (under 2 minutes)")
    parser.add_argument("--lr", type=float, default=PEAK_LR, help=f"peak learning rate (default {PEAK_LR})")
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 2), help="parallel runs (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the figures from the saved JSON and runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from relational_hf.lm.data import lm_blocks

    budget_name = "quick" if args.quick else "default"
    budget = BUDGETS[budget_name]
    name = "dynamics" + ("_quick" if args.quick else "")
    if args.plot_only:
        payload = json.loads((common.RESULTS / f"{name}.json").read_text())
        draw(name, payload)
        print_table(payload)
        return payload
    started = time.monotonic()
    corpus = quality_setup.load_shakespeare()
    val_blocks = lm_blocks(corpus["val_ids"], quality_setup.CONTEXT)
    generator = torch.Generator().manual_seed(BATCH_SEED)
    starts = torch.randint(0, corpus["train_ids"].numel() - quality_setup.CONTEXT, (budget["variance_batches"] * quality_setup.BATCH_SIZE,),
                           generator=generator)  # fmt: skip
    windows = torch.stack([corpus["train_ids"][s : s + quality_setup.CONTEXT] for s in starts.tolist()])
    data = {
        "train_ids": corpus["train_ids"],
        "val_blocks": val_blocks if not args.quick else val_blocks[: budget["eval_blocks"]],
        "eval_blocks": val_blocks[: budget["eval_blocks"]],
        "kl_blocks": val_blocks[-budget["kl_blocks"] :],
        "probe": val_blocks[:PROBE_BLOCKS],
        "variance_batches": windows.view(budget["variance_batches"], quality_setup.BATCH_SIZE, quality_setup.CONTEXT),
    }
    runs_dir = common.RESULTS / f"{name}_runs"
    jobs = [dict(variant=v, seed=s, steps=budget["steps"], lr=args.lr, dims=budget["dims"], every=budget["every"],
                 variance_at=budget["variance_at"], eval_every=budget["eval_every"], vocab_size=corpus["vocab_size"],
                 runs_dir=str(runs_dir)) for s in SEEDS for v in VARIANTS]  # fmt: skip
    logger.info("%d runs of %d steps (size %s), %d worker(s)", len(jobs), budget["steps"], budget["size"], args.workers)
    runs = []
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn"), initializer=_set_data,
                                 initargs=(data, args.threads)) as pool:  # fmt: skip
            for result in pool.map(run_one, jobs):
                runs.append(result)
                logger.info("%s seed %d: val loss %.4f (%.0f s)", result["variant"], result["seed"],
                            result["final_val_loss"], result["seconds"])  # fmt: skip
    else:
        _set_data(data, args.threads)
        for job in jobs:
            runs.append(run_one(job))
            logger.info("%s seed %d: val loss %.4f (%.0f s)", job["variant"], job["seed"], runs[-1]["final_val_loss"],
                        runs[-1]["seconds"])  # fmt: skip
    payload = {
        "corpus": corpus["name"],
        "corpus_source": corpus["source"],
        "vocab_size": corpus["vocab_size"],
        "budget": {k: v for k, v in budget.items()} | {"name": budget_name, "batch_size": quality_setup.BATCH_SIZE,
                                                        "context": quality_setup.CONTEXT, "peak_lr": args.lr,
                                                        "seeds": SEEDS},  # fmt: skip
        "optimizer": quality_setup.OPTIMIZER,
        "variants_run": {v: VARIANTS[v][0] for v in VARIANTS},
        "recorder": {"sketch_dim": SKETCH_DIM, "sketch_seed": SKETCH_SEED, "probe_blocks": PROBE_BLOCKS,
                     "vertical_groups": "every linear group but the residual rotation (ProjectedOptimizer's default)"},
        "variance_batches": {"count": budget["variance_batches"], "seed": BATCH_SEED},
        "workers": args.workers,
        "threads_per_worker": args.threads,
    }  # fmt: skip
    payload.update(analyse(runs, budget))
    payload["runs"] = [
        {k: r[k] for k in ("variant", "seed", "final_val_loss", "val_loss_curve", "summary", "seconds",
                           "mean_step_seconds", "mean_record_seconds")}
        | {"train_loss_smoothed_every_10": smooth(r["train_loss"])[9::10].round(4).tolist(),
           "trajectory_file": str(Path(r["trajectory_file"]).relative_to(common.RESULTS))}
        for r in runs
    ]  # fmt: skip
    payload["wall_seconds"] = time.monotonic() - started
    path = common.write_json(name, payload)
    draw(name, payload)
    logger.info("wrote %s (%.0f s)", path, payload["wall_seconds"])
    print_table(payload)
    return payload


def draw(name: str, payload: dict) -> None:
    """results/<name>.png and the `relational-hf dynamics` figures of the runs under results/<name>_plots/."""
    from relational_hf.dynamics import load_trajectory, plot_all

    trajectories = [load_trajectory(common.RESULTS / r["trajectory_file"]) for r in payload["runs"]]
    plot(payload, trajectories, common.RESULTS / f"{name}.png")
    figures = plot_all(trajectories, common.RESULTS / f"{name}_plots")
    logger.info("wrote %s and %d figures under %s", common.RESULTS / f"{name}.png", len(figures),
                common.RESULTS / f"{name}_plots")  # fmt: skip


if __name__ == "__main__":
    main()
