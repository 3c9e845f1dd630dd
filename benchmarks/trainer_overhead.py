"""Step-time overhead of `RelationalTrainer` (symmetry projection, parallel suppression) against plain `Trainer`.

Every contender trains a fresh copy of the same initial model (fixed seed) on the same random token blocks for a few
steps through `Trainer.train()`; contenders are alternated within one process (round-robin, rotated each repeat) and
the per-run median step time is summarised as median and min-max over repeats. Two models of the same dimensions:
a relational free-gauge model (the case projection is meant for) and Transformers' `LlamaForCausalLM`.

Contenders: plain `Trainer`; `RelationalTrainer` with everything off; projection (`symmetry_projection="update"`);
suppression at the residual and at the value sites; projection + value suppression. Targets: projection adds under
10% per step, suppression under 15%. Where the time goes: a timing split of every step (forward, backward with
gradient clipping, optimizer step, i.e. inner AdamW + projection, and the rest of the loop) from callbacks and a
forward hook, and the top operators of `torch.profiler` for each contender on the relational model.

    python benchmarks/trainer_overhead.py           # d=256, 4 layers, batch 8 x 128 tokens (a few minutes on 2 cores)
    python benchmarks/trainer_overhead.py --quick   # small model, under a minute

Writes benchmarks/results/trainer_overhead.json and trainer_overhead.png (`_quick` with --quick).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import tempfile
import time
import warnings

import torch
from common import RESULTS, summary, sync, write_json
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from relational_hf import RelationalConfig, RelationalForCausalLM, RelationalTrainer, RelationalTrainingArguments
from relational_hf.lm.data import BlockDataset

logger = logging.getLogger("trainer_overhead")

SIZES = {
    "default": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=768, vocab_size=4096
    ),
    "quick": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=192, vocab_size=256),
}
#: name -> RelationalTrainingArguments fields (None: plain Trainer with TrainingArguments)
CONTENDERS = {
    "trainer": None,
    "relational_off": {},
    "projection": dict(symmetry_projection="update"),
    "suppression_residual": dict(parallel_suppression_coef=0.05, parallel_suppression_site="residual"),
    "suppression_value": dict(parallel_suppression_coef=0.05, parallel_suppression_site="value"),
    "projection+suppression_value": dict(
        symmetry_projection="update", parallel_suppression_coef=0.05, parallel_suppression_site="value"
    ),
}
TARGETS = {  # contender -> maximum added share of the plain Trainer's step time
    "projection": 0.10,
    "suppression_residual": 0.15,
    "suppression_value": 0.15,
    "projection+suppression_value": 0.25,  # no separate target: the sum of the two
}
PARTS = ("forward", "backward", "optimizer", "other")


def build(kind: str, dims: dict, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(dims, max_position_embeddings=1024, tie_word_embeddings=True)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = RelationalForCausalLM(RelationalConfig(**common, gauge="free"))
    model.set_attn_implementation("sdpa")
    return model


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, split into forward (hook on the model), backward (+ clipping), optimizer
    step (inner optimiser + projection) and the rest of the loop (data, scheduler, zero_grad, callbacks)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._marks: dict[str, float] = {}
        self._forward = 0.0
        self._fwd_start = 0.0
        self._last_end: float | None = None

    def attach(self, model: torch.nn.Module) -> None:
        def pre(*_):
            sync()
            self._fwd_start = time.perf_counter()

        def post(*_):
            sync()
            self._forward += time.perf_counter() - self._fwd_start

        model.register_forward_pre_hook(pre)
        model.register_forward_hook(post)

    def _mark(self, key: str) -> None:
        sync()
        self._marks[key] = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self._mark("end")
        self._last_end = self._marks["end"]

    def on_step_begin(self, args, state, control, **kwargs):
        self._forward = 0.0
        self._mark("begin")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._mark("pre_opt")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._mark("opt")

    def on_step_end(self, args, state, control, **kwargs):
        self._mark("end")
        m = self._marks
        total = m["end"] - self._last_end
        fwd_bwd = m["pre_opt"] - m["begin"]
        optimizer = m["opt"] - m["pre_opt"]
        self.steps.append(
            {
                "total": total,
                "forward": self._forward,
                "backward": fwd_bwd - self._forward,
                "optimizer": optimizer,
                "other": total - fwd_bwd - optimizer,
            }
        )
        self._last_end = m["end"]


def make_trainer(name: str, model, dataset, steps: int, batch: int, seed: int, outdir: str, callbacks=()):
    base = dict(
        output_dir=outdir,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=3e-4,
        warmup_steps=0,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
    )
    over = CONTENDERS[name]
    if over is None:
        trainer = Trainer(model=model, args=TrainingArguments(**base), train_dataset=dataset, callbacks=list(callbacks))
    else:
        args = RelationalTrainingArguments(**base, **over)
        trainer = RelationalTrainer(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)  # the end-of-training summary line
    return trainer


def run_once(name: str, base_model, dataset, steps: int, warmup: int, batch: int, seed: int) -> dict:
    model = copy.deepcopy(base_model)
    timer = StepTimer()
    timer.attach(model)
    with tempfile.TemporaryDirectory() as outdir:
        trainer = make_trainer(name, model, dataset, warmup + steps, batch, seed, outdir, [timer])
        trainer.train()
    kept = timer.steps[warmup:]
    return {key: statistics.median(s[key] for s in kept) for key in ("total", *PARTS)}


def profile_top_ops(name: str, base_model, dataset, steps: int, batch: int, seed: int, top: int = 8) -> list[dict]:
    """The `top` operators by self CPU time over `steps` training steps (after one unprofiled step)."""
    from torch.profiler import ProfilerActivity, profile

    model = copy.deepcopy(base_model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    class Profiled(TrainerCallback):
        def __init__(self):
            self.prof = profile(activities=activities)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.prof.__enter__()

        def on_train_end(self, args, state, control, **kwargs):
            self.prof.__exit__(None, None, None)

    cb = Profiled()
    with tempfile.TemporaryDirectory() as outdir:
        make_trainer(name, model, dataset, 1 + steps, batch, seed, outdir, [cb]).train()
    events = cb.prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {
            "op": e.key,
            "self_cpu_ms_per_step": e.self_cpu_time_total / 1000 / steps,
            "share": e.self_cpu_time_total / total,
            "calls_per_step": e.count / steps,
        }
        for e in ranked
    ]


def run(dims: dict, batch: int, seq: int, steps: int, warmup: int, repeats: int, seed: int, profile_steps: int):
    names = list(CONTENDERS)
    n_examples = (warmup + steps + 1) * batch
    gen = torch.Generator().manual_seed(seed)
    dataset = BlockDataset(torch.randint(0, dims["vocab_size"], (n_examples, seq), generator=gen))
    results = {}
    for kind in ("relational_free", "llama"):
        base_model = build(kind, dims, seed)
        params = sum(p.numel() for p in base_model.parameters())
        run_once("trainer", base_model, dataset, 1, 1, batch, seed)  # warm-up (allocator, kernels, imports)
        samples: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(repeats):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
            for n in order:
                samples[n].append(run_once(n, base_model, dataset, steps, warmup, batch, seed))
        entry: dict = {"parameters": params, "contenders": {}}
        base = statistics.median(s["total"] for s in samples["trainer"])
        for n in names:
            totals = [s["total"] for s in samples[n]]
            c = {
                "step_s": summary(totals),
                "split_s": {part: statistics.median(s[part] for s in samples[n]) for part in PARTS},
                "added_share": statistics.median(totals) / base - 1.0,
                # spread of the overhead: this contender's min/max against the plain Trainer's median
                "added_share_range": [min(totals) / base - 1.0, max(totals) / base - 1.0],
            }
            if n in TARGETS:
                c["target"] = TARGETS[n]
                c["target_met"] = c["added_share"] < TARGETS[n]
            entry["contenders"][n] = c
        if profile_steps > 0 and kind == "relational_free":
            entry["profile_top_ops"] = {
                n: profile_top_ops(n, base_model, dataset, profile_steps, batch, seed) for n in names if n != "trainer"
            }
        results[kind] = entry
        logger.info(
            "%s: %s", kind, {n: f"{entry['contenders'][n]['added_share']:+.1%}" for n in names if n != "trainer"}
        )
    return results


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(results)
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4.5), sharey=False)
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green", "other": "tab:gray"}
    for ax, kind in zip(axes, kinds):
        contenders = results[kind]["contenders"]
        names = list(contenders)
        bottom = [0.0] * len(names)
        for part in PARTS:
            vals = [contenders[n]["split_s"][part] * 1000 for n in names]
            ax.bar(range(len(names)), vals, bottom=bottom, color=colors[part], label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        med = [contenders[n]["step_s"]["median"] * 1000 for n in names]
        lo = [m - contenders[n]["step_s"]["min"] * 1000 for m, n in zip(med, names)]
        hi = [contenders[n]["step_s"]["max"] * 1000 - m for m, n in zip(med, names)]
        ax.errorbar(range(len(names)), med, yerr=[lo, hi], fmt="k_", ms=18, capsize=3, label="step median, min-max")
        base = contenders["trainer"]["step_s"]["median"] * 1000
        ax.axhline(base * 1.10, color="r", ls="--", lw=0.8, label="+10% (projection target)")
        ax.axhline(base * 1.15, color="m", ls=":", lw=0.8, label="+15% (suppression target)")
        for i, n in enumerate(names):
            if n != "trainer":
                ax.text(i, med[i] + hi[i], f"{contenders[n]['added_share']:+.0%}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), [n.replace("+", "+\n") for n in names], rotation=30, fontsize=7, ha="right")
        ax.set_ylabel("ms per optimizer step")
        ax.set_title(f"{kind} ({results[kind]['parameters'] / 1e6:.1f}M parameters)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="upper center", ncol=len(labels))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps (under a minute)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds over all contenders (default 5, quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 10, quick 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (default 1: steadier timings on a shared machine)"
    )
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the existing JSON")
    args = parser.parse_args()
    name = "trainer_overhead_quick" if args.quick else "trainer_overhead"
    if args.plot_only:
        plot(json.loads((RESULTS / f"{name}.json").read_text())["results"], RESULTS / f"{name}.png")
        return
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.quick:
        dims, batch, seq, steps, warmup, repeats, profile_steps = SIZES["quick"], 4, 32, 3, 1, 2, 1
    else:
        dims, batch, seq, steps, warmup, repeats, profile_steps = SIZES["default"], 8, 128, 10, 2, 5, 3
    steps = args.steps or steps
    repeats = args.repeats or repeats
    start = time.perf_counter()
    results = run(dims, batch, seq, steps, warmup, repeats, args.seed, profile_steps)
    write_json(
        name,
        {
            "dims": dims,
            "batch": batch,
            "sequence_length": seq,
            "measured_steps_per_run": steps,
            "warmup_steps_per_run": warmup,
            "repeats": repeats,
            "seed": args.seed,
            "suppression_coef": 0.05,
            "targets": TARGETS,
            "wall_s": time.perf_counter() - start,
            "results": results,
        },
    )
    plot(results, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.json')} in {time.perf_counter() - start:.0f} s")
    for kind, entry in results.items():
        base = entry["contenders"]["trainer"]["step_s"]["median"]
        print(f"{kind}: plain Trainer {base * 1000:.1f} ms/step")
        for n, c in entry["contenders"].items():
            if n == "trainer":
                continue
            lo, hi = c["added_share_range"]
            verdict = "" if "target" in c else "(no target)"
            if "target" in c:
                verdict = f"target <{c['target']:.0%}: {'met' if c['target_met'] else 'MISSED'}"
            split = ", ".join(f"{p} {c['split_s'][p] * 1000:.1f}" for p in PARTS)
            print(f"  {n:30s} {c['added_share']:+7.1%} [{lo:+.1%}, {hi:+.1%}] {verdict}; ms: {split}")


if __name__ == "__main__":
    main()
