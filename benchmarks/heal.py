"""Healing a compressed real checkpoint: held-out perplexity of SmolLM2-135M-Instruct during a LoRA recovery run.

Two losses (`--loss`): "kd" (default; repair by distillation from the source, DESIGN.md 2.2a) trains the adapters on
KL(p_source || p_model) of the next-token distributions, on text the source model sampled itself
(`relational_hf.compress.distill.teacher_text`: `--text-samples` rows of `--text-length` tokens, half started from
generic chat prompts, half from a random vocabulary token, seed `--text-seed`); the KL to the source is also measured
on 16 further rows of such text (another seed) at every evaluation. "lm" trains on the language-model loss on random
blocks of the first 90% of the WikiText-2 documents (adaptation to the evaluation's domain as well as repair).
`--kd-text calibration` keeps the KL to the source as the loss but reads random blocks of the first 90% of the WikiText-2
documents instead of the source's samples (text of the evaluation's kind, never its windows); `--kd-text mixed` reads
the source's samples and the calibration windows half and half, as `relational-hf compress --heal-steps` does; `--refit-holdout N`
compresses with each layer's refit chosen on N held-back calibration windows. Every figure has its control:
`--dense-control` runs the same healing on the uncompressed model.

Protocol (the one of `benchmarks/compress.py`): the model is compressed by the project's relational method
(`relational_hf.jobs.compress_model`, default options) to `--remove` of its stored parameters removed, calibrated
on the first `--calibration-windows` (16) windows of 512 tokens of the first 90% of the WikiText-2 validation
documents; perplexity is measured
on the first 12 windows of 512 tokens of the last 10% of the documents (held out from calibration and healing).
Healing (`relational_hf.training.heal.heal`): LoRA of rank `--rank` on every linear map of the decoder layers,
trained through `RelationalTrainer` for `--steps` steps of `--batch-size` random blocks of `--block` tokens drawn from
the first 90% of the documents (the calibration side only), AdamW at `--lr` with a cosine schedule, then merged
back into the compressed shapes (stored size unchanged, checked). The held-out perplexity is measured every
`--eval-every` steps on the unmerged adapter model (the same function), and once more after the merge.

    python benchmarks/heal.py --calibration-windows 64 --steps 200 --eval-every 40        # distillation
    python benchmarks/heal.py --calibration-windows 64 --steps 200 --eval-every 40 --dense-control
    python benchmarks/heal.py --loss lm --calibration-windows 64 --steps 200 --eval-every 40   # LM loss on WikiText-2
    python benchmarks/heal.py --kd-text calibration --refit-holdout 16 --calibration-windows 128 --steps 500 \
        --eval-every 100 --batch-size 2 --tag calibration_holdout   # distillation on the calibration side, one epoch
    python benchmarks/heal.py --quick         # 2 layers, 128-token windows, 20 steps (about a minute)
    python benchmarks/heal.py --plot-only     # redraw the PNG from the JSON

Writes results/heal_kd.json and heal_kd.png for "kd", results/heal.json and heal.png for "lm" (`*_quick.*` with
--quick), the JSON after every evaluation, atomically. The compressed model and the teacher text are kept in
`--workdir` (default: a temporary folder) so that a rerun with the same settings skips their computation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common import RESULTS, command_line, corpus, load_average, log_axis_in_plain_numbers, machine
from compress import load_model, protocol_windows, write_atomically

logger = logging.getLogger("heal")


def compressed_model(
    model, tokenizer, calibration: torch.Tensor, remove: float, workdir: Path | None, options: dict | None = None
):
    """The relational compression of `model` at `remove` with the `compress_model` options `options` (reloaded from
    `workdir` when it was saved there with the same calibration windows and options); returns (model, report)."""
    from relational_hf.compress.options import LowRankOptions
    from relational_hf.jobs import compress_model
    from relational_hf.modeling import RelationalForCausalLM

    options = dict(options or {})
    suffix = "".join(f"-{key}{value}" for key, value in sorted(options.items()))
    folder = None if workdir is None else workdir / f"relational-{remove:g}{suffix}"
    signature = {"remove": remove, "calibration": calibration.sum().item(), "shape": list(calibration.shape)}
    signature |= {"gauge": LowRankOptions.gauge} | options  # a model cached before the free gauge was the default: not reused
    if folder is not None and (folder / "signature.json").is_file():
        if json.loads((folder / "signature.json").read_text()) == signature:
            logger.info("reusing the compressed model in %s", folder)
            report = json.loads((folder / "report.json").read_text())
            return RelationalForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), report
    compressed, report = compress_model(
        model, tokenizer, remove=remove, method="relational", calibration=calibration, **options
    )
    report = json.loads(json.dumps(report, default=str))
    if folder is not None:
        stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=workdir))
        compressed.save_pretrained(stage)
        (stage / "report.json").write_text(json.dumps(report))
        (stage / "signature.json").write_text(json.dumps(signature))
        if folder.exists():
            raise SystemExit(f"{folder} exists with other settings; remove it or pass another --workdir")
        stage.rename(folder)
    return compressed, report


def cached_teacher_text(model, tokenizer, workdir: Path | None, name: str, **options) -> tuple[torch.Tensor, dict]:
    """`teacher_text(model, tokenizer, **options)`, reused from `workdir/name` when it was written there by the same
    source with the same options."""
    from relational_hf.compress.distill import load_teacher_text, model_fingerprint, save_teacher_text, teacher_text

    path = None if workdir is None else workdir / name
    wanted = {k: v for k, v in options.items() if k != "progress"} | {"source": model_fingerprint(model)}
    if path is not None and path.is_file():
        ids, settings = load_teacher_text(path)
        if {k: settings.get(k) for k in wanted} == wanted:
            logger.info("reusing the teacher text in %s", path)
            return ids, settings
    ids, settings = teacher_text(model, tokenizer, **options)
    if path is not None:
        fd, tmp = tempfile.mkstemp(dir=workdir, prefix=f".{name}.")
        os.close(fd)
        save_teacher_text(tmp, ids, settings)
        os.replace(tmp, path)
    return ids, settings


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = payload.get("curve", [])
    what = "distillation" if payload.get("loss", "lm") == "kd" else "LM-loss healing"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if curve:
        ax.plot([c["step"] for c in curve], [c["perplexity"] for c in curve], marker="o", label=f"relational + LoRA {what}")
    control = payload.get("dense_control", {}).get("curve", [])
    if control:
        ax.plot(
            [c["step"] for c in control], [c["perplexity"] for c in control], marker="s", color="tab:green",
            label=f"control: dense model + the same LoRA {what}",
        )  # fmt: skip
    dense = payload.get("dense_perplexity")
    if dense:
        ax.axhline(dense, color="black", linewidth=1, label=f"dense ({dense:.2f})")
        ax.axhline(1.1 * dense, color="grey", linewidth=1, linestyle="--", label=f"dense + 10% ({1.1 * dense:.2f})")
    for name, value in payload.get("references", {}).items():
        ax.axhline(value, linewidth=0.8, linestyle=":", color="tab:red", label=f"{name} ({value:.2f})")
    ax.set_yscale("log")
    log_axis_in_plain_numbers(ax.yaxis)
    ax.set_xlabel(f"LoRA {what} steps")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(f"{payload['protocol']['model']}, {payload['remove']:.0%} of stored parameters removed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 128-token windows, 20 steps")
    parser.add_argument(
        "--loss", choices=("kd", "lm"), default="kd",
        help="kd: distillation from the source on its own text (default); lm: LM loss on WikiText-2",
    )  # fmt: skip
    parser.add_argument(
        "--kd-text", choices=("source", "calibration", "mixed"), default="source",
        help="kd only: the source's own samples (default), random blocks of the first 90%% of the WikiText-2 "
        "documents, the calibration side (the loss is still the KL to the source), or the source's samples and the "
        "calibration windows half and half (`compress.distill.healing_stream`, what `compress --heal-steps` does)",
    )  # fmt: skip
    parser.add_argument(
        "--refit-holdout", type=int, default=0, help="the compression's --refit-holdout (0: off, the default)"
    )
    parser.add_argument("--text-samples", type=int, default=None, help="teacher-text rows for kd (256; quick 32)")
    parser.add_argument("--text-length", type=int, default=None, help="tokens per teacher-text row (256; quick 64)")
    parser.add_argument("--text-seed", type=int, default=0, help="seed of the teacher text (0)")
    parser.add_argument(
        "--remove", type=float, default=None, help="share of stored parameters removed (0.25; quick 0.05, as 2 layers "
        "hold a small part of the model)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="healing steps (300; quick 20)")
    parser.add_argument("--eval-every", type=int, default=None, help="held-out evaluation period in steps (50; quick 10)")
    parser.add_argument(
        "--lr", type=float, default=None, help="LoRA learning rate (default: the library's for the loss, DEFAULT_HEAL_LR)"
    )
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (16)")
    parser.add_argument("--batch-size", type=int, default=4, help="blocks per step (4)")
    parser.add_argument("--block", type=int, default=None, help="tokens per healing block (256; quick 64)")
    parser.add_argument(
        "--calibration-windows", type=int, default=None, help="calibration windows of the compression (16; quick 4)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="where the compressed model is kept between runs")
    parser.add_argument(
        "--dense-control", action="store_true",
        help="heal the UNCOMPRESSED model with the same settings (the control: how much of the gain is adaptation to "
        "the healing text rather than recovery) and add its curve to the existing JSON",
    )  # fmt: skip
    parser.add_argument("--tag", default="", help="appended to the results' file name (e.g. a learning-rate probe)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args(argv)
    args.remove = args.remove if args.remove is not None else (0.05 if args.quick else 0.25)
    if not 0.0 < args.remove < 1.0:
        parser.error("--remove must be in (0, 1)")
    for flag in (
        "steps", "eval_every", "rank", "batch_size", "block", "threads", "calibration_windows", "text_samples",
        "text_length",
    ):  # fmt: skip
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.refit_holdout < 0:
        parser.error(f"--refit-holdout must be >= 0, got {args.refit_holdout}")
    if args.kd_text != "source" and args.loss != "kd":
        parser.error("--kd-text applies to --loss kd only")
    if args.lr is None:
        from relational_hf.training.heal import DEFAULT_HEAL_LR

        args.lr = DEFAULT_HEAL_LR[args.loss]
    if not 0.0 < args.lr < 1.0:
        parser.error("--lr must be in (0, 1)")
    name = ("heal_kd" if args.loss == "kd" else "heal") + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    json_path, png_path = RESULTS / f"{name}.json", RESULTS / f"{name}.png"
    if args.plot_only:
        if not json_path.is_file():
            parser.error(f"{json_path} does not exist: run the benchmark first")
        plot(json.loads(json_path.read_text()), png_path)
        return 0
    steps = args.steps or (20 if args.quick else 300)
    every = args.eval_every or (10 if args.quick else 50)
    block = args.block or (64 if args.quick else 256)
    window = 128 if args.quick else 512
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    from transformers import TrainerCallback

    from relational_hf.compress.eval import perplexity_on_windows, stored_parameters, text_windows
    from relational_hf.lm.metrics import teacher_kl
    from relational_hf.training.heal import heal

    started = time.perf_counter()
    model, tokenizer = load_model(args.quick)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    calibration, evaluation, protocol = protocol_windows(
        tokenizer, window, args.calibration_windows or (4 if args.quick else 16), 4 if args.quick else 12, args.quick,
        args.threads,
    )
    compressed = report = None
    if not args.dense_control:  # compressed first: a --dense-control run beside this one can cache the teacher text
        options = {"refit_holdout": args.refit_holdout} if args.refit_holdout else {}
        compressed, report = compressed_model(model, tokenizer, calibration, args.remove, args.workdir, options)
        if args.refit_holdout:
            protocol["refit_holdout"] = f"each layer's refit chosen on the last {args.refit_holdout} calibration windows"
    held_out_text = None
    on_source_text = args.loss == "kd" and args.kd_text in ("source", "mixed")
    if args.loss == "kd":
        samples, length = args.text_samples or (32 if args.quick else 256), args.text_length or (64 if args.quick else 256)
        held_out_text, _ = cached_teacher_text(
            model, tokenizer, args.workdir, f"heal_text_heldout-{length}-{args.text_seed + 1}.safetensors",
            samples=16, length=length, seed=args.text_seed + 1, progress=True,
        )  # fmt: skip
        protocol["teacher_kl"] = (
            f"mean KL(p_source || p_model) per token on 16 further rows of {length} tokens of the source's own text "
            f"(seed {args.text_seed + 1}), nats"
        )
    if on_source_text:
        heal_ids, text_settings = cached_teacher_text(
            model, tokenizer, args.workdir, f"heal_text-{samples}x{length}-{args.text_seed}.safetensors",
            samples=samples, length=length, seed=args.text_seed, progress=True,
        )  # fmt: skip
        protocol["healing_text"] = (
            f"{samples} rows of {length} tokens sampled from the source model itself at temperature 1 "
            f"(relational_hf.compress.distill.teacher_text, seed {args.text_seed}; half from generic chat prompts, half "
            f"from a random vocabulary token), {heal_ids.numel():,} tokens, read as one stream in random blocks of "
            f"{block}; generated in {text_settings['seconds']} s"
        )
        if args.kd_text == "mixed":
            from relational_hf.compress.distill import DEFAULT_CALIBRATION_SHARE, healing_stream

            heal_ids, mix = healing_stream(heal_ids, calibration, DEFAULT_CALIBRATION_SHARE)
            text_settings = text_settings | mix
            protocol["healing_text"] += (
                f"; mixed with the calibration windows, {DEFAULT_CALIBRATION_SHARE:.0%} of the stream's tokens "
                "(relational_hf.compress.distill.healing_stream, as compress --heal-steps does)"
            )
    else:
        heal_ids = text_windows(corpus("wikitext-2"), tokenizer, window=block, n=10**7, split="first")
        protocol["healing_text"] = (
            f"random blocks of {block} tokens of the first 90% of the documents ({heal_ids.numel():,} tokens; "
            "the calibration side, disjoint from the evaluation windows)"
            + (", the loss the KL to the source" if args.loss == "kd" else "")
        )
    dense_ppl = perplexity_on_windows(model, evaluation, batch_size=2, progress=True)
    healing = {
        "loss": args.loss, "steps": steps, "eval_every": every, "lora_rank": args.rank, "learning_rate": args.lr,
        "batch_size": args.batch_size, "block": block, "tokens_per_step": args.batch_size * block,
        "schedule": "cosine, warm-up steps // 10", "optimizer": "AdamW (Trainer default)",
    }  # fmt: skip
    if on_source_text:
        keys = ("samples", "length", "seed", "chat_share", "source", "calibration_share")
        healing["text"] = {k: text_settings[k] for k in keys if k in text_settings}
    elif args.loss == "kd":
        healing["text"] = "the calibration side of WikiText-2"
    else:
        healing.pop("loss")  # the LM-loss JSON predates the option; its settings compare equal to a rerun's

    def save_main(payload: dict) -> None:
        write_atomically(json_path, payload)
        plot(payload, png_path)

    def healed_curve(net, curve: list, payload: dict, save=save_main) -> tuple:
        """Heal `net`, appending the held-out perplexity every `every` steps to `curve` (`save(payload)` each time)."""

        def record(step: int, current, train_seconds: float) -> None:
            t0 = time.perf_counter()
            was_training = current.training
            current.eval()
            ppl = perplexity_on_windows(current, evaluation, batch_size=2)
            point = {"step": step, "perplexity": ppl}
            if held_out_text is not None:
                point["teacher_kl"] = teacher_kl(current, model, held_out_text, batch_size=2)
            current.train(was_training)
            point.update(
                train_seconds=round(train_seconds, 1), eval_seconds=round(time.perf_counter() - t0, 1),
                load_average=load_average(),
            )  # fmt: skip
            curve.append(point)
            logger.info("step %d: held-out perplexity %.3f (dense %.3f) %s", step, ppl, dense_ppl, point)
            save(payload)

        class HeldOut(TrainerCallback):
            """Held-out perplexity every `every` steps; training time excludes the evaluations."""

            def __init__(self):
                self.clock = time.perf_counter()
                self.train_seconds = 0.0

            def on_step_end(self, _args, state, control, model=None, **kwargs):
                if state.global_step % every == 0 or state.global_step == steps:
                    self.train_seconds += time.perf_counter() - self.clock
                    record(state.global_step, model, self.train_seconds)
                    self.clock = time.perf_counter()

        record(0, net, 0.0)
        stored_before = stored_parameters(net)["total"]
        healed, heal_report = heal(
            net, heal_ids, steps=steps, loss=args.loss, teacher=model if args.loss == "kd" else None, heal_lr=args.lr,
            heal_rank=args.rank, heal_batch_size=args.batch_size, heal_block_size=block, callbacks=[HeldOut()],
        )  # fmt: skip
        stored_after = stored_parameters(healed)["total"]
        if stored_after != stored_before:
            raise SystemExit(f"healing changed the stored size: {stored_before:,} -> {stored_after:,}")
        return perplexity_on_windows(healed, evaluation, batch_size=2), heal_report

    if args.dense_control:
        if not json_path.is_file():
            parser.error(f"--dense-control adds to {json_path}, which does not exist: run without it first")
        payload = json.loads(json_path.read_text())
        if payload.get("healing") != healing or payload.get("protocol", {}).get("evaluation") != protocol["evaluation"]:
            parser.error(f"--dense-control: {json_path} was measured with other healing settings or another protocol")
        from relational_hf.convert import to_relational

        control = payload["dense_control"] = {
            "what": "the uncompressed model, exactly converted to the relational form, healed with the same LoRA "
            "settings on the same text" + (" (distilled from the source it was converted from)" if args.loss == "kd" else ""),
            "command": command_line("python benchmarks/heal.py", argv),
            "curve": [],
        }
        # the run of the compressed model may still be writing the JSON: the control's progress goes to a file of its
        # own, and into the JSON once that run has finished (its final "merged_perplexity" is there)
        progress = json_path.with_name(f".{json_path.stem}.control.json")
        merged, heal_report = healed_curve(
            to_relational(model).float().eval(), control["curve"], payload,
            save=lambda p: write_atomically(progress, p["dense_control"]),
        )  # fmt: skip
        control.update(merged_perplexity=merged, heal_report=heal_report, wall_seconds=time.perf_counter() - started)
        while "merged_perplexity" not in json.loads(json_path.read_text()):
            logger.info("waiting for the compressed model's run to finish writing %s", json_path)
            time.sleep(60)
        payload = json.loads(json_path.read_text())
        payload["dense_control"] = control
        write_atomically(json_path, payload)
        plot(payload, png_path)
        progress.unlink(missing_ok=True)
        print(f"dense control: held-out perplexity {dense_ppl:.2f} -> {merged:.2f} after {steps} LoRA steps")
        return 0

    payload = {
        "protocol": protocol,
        "loss": args.loss,
        "remove": args.remove,
        "dense_perplexity": dense_ppl,
        "dense_stored_parameters": report["parameters_before"],
        "stored_parameters": stored_parameters(compressed)["total"],
        "healing": healing,
        "curve": [],
        "machine": machine(),
        "command": command_line("python benchmarks/heal.py", argv),
    }
    compress_json = RESULTS / "compress.json"
    if compress_json.is_file() and not args.quick:
        cells = json.loads(compress_json.read_text())["cells"]
        for key, label in ((f"slicegpt@{args.remove:g}", "SliceGPT (tied), no healing"),):
            if cells.get(key, {}).get("perplexity"):
                payload.setdefault("references", {})[label] = cells[key]["perplexity"]
    payload["merged_perplexity"], payload["heal_report"] = healed_curve(compressed, payload["curve"], payload)
    payload["compression"] = {k: report.get(k) for k in ("widths", "parameters_after", "removed_share", "seconds")}
    payload["wall_seconds"] = time.perf_counter() - started
    write_atomically(json_path, payload)
    plot(payload, png_path)
    first, last = payload["curve"][0]["perplexity"], payload["merged_perplexity"]
    print(
        f"{args.remove:.0%} removed: held-out perplexity {first:.2f} -> {last:.2f} after {steps} LoRA steps "
        f"(dense {dense_ppl:.2f}; {last / dense_ppl - 1:+.1%}); wrote {json_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
