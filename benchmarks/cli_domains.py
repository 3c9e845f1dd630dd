"""The command line's compression across domains: what a user gets from `relational-hf compress` with one option
changed, measured on five unlike held-out domains.

Every variant is the command a user runs on SmolLM2-135M-Instruct at 25% (`relational-hf compress SRC OUT --remove 0.25
--calibration CAL.pt --calibration-windows 128 --window 512 --eval-windows 12 --eval D.pt ...` with the CLI's
defaults and the variant's options), in the workdir of `gguf_llamacpp.py` (the same calibration windows: the first
128 windows of 512 tokens of the first 90% of the WikiText-2 validation documents; the same held-out windows of each
domain of `domains.py`). A variant whose folder already holds a compression report is read, not rerun: the report
records the calibration settings it was made with (e.g. the prompt set of the sampled calibration text), and the
JSON keeps them beside each figure. Perplexities are the command's own (`--eval`, fp32), ratios to the source's on
the same windows; "worst" is over the four target domains (prose is the extra check no choice was made on).

    python benchmarks/gguf_llamacpp.py --prepare-only     # the texts (and the dense and default checkpoints)
    python benchmarks/cli_domains.py                      # every variant (each compression ~45 minutes on 2 cores)
    python benchmarks/cli_domains.py --variants default w64 --no-run   # tabulate what exists

Writes results/cli_domains.json and cli_domains.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, save_figure, write_json
from domains import DESCRIPTIONS, DOMAINS, TARGET_DOMAINS

WORKDIR = RESULTS / "gguf_runs" / "full"
#: The conversational requests the "conversation" variant added to `compress.distill.CALIBRATION_PROMPTS` (advice and
#: everyday questions, the kind of request a chat model serves; written for this project, none of GENERIC_PROMPTS).
CONVERSATION_PROMPTS = (
    "Can you help me choose a birthday present for my sister?",
    "I get nervous before job interviews. What can I do about it?",
    "What is the difference between weather and climate?",
    "Could you suggest a weekly exercise routine for a beginner?",
    "Why do cats purr? Please answer in a friendly way.",
    "My laptop has become slow. What should I check first?",
    "How can I politely turn down extra work from my manager?",
    "What are some good habits for sleeping better?",
)
#: name -> (folder in the workdir, extra options of `relational-hf compress`, what it changes)
VARIANTS: dict[str, tuple[str, list[str], str]] = {
    "generic-prompts": (
        "compressed",
        [],
        "the defaults before the calibration prompt set: sampled calibration rows seeded by the healing's generic "
        "chat prompts (made by gguf_llamacpp.py)",
    ),
    "default": ("compressed-calprompts", [], "the defaults: sampled calibration rows seeded by CALIBRATION_PROMPTS"),
    "w256": (
        "compressed-w256",
        ["--width-multiple", "256"],
        "every narrowed SwiGLU width a multiple of 256 (made by gguf_llamacpp.py before the calibration prompt set: "
        "compare it with generic-prompts, the same samples)",
    ),
    "w128": ("compressed-w128", ["--width-multiple", "128"], "every narrowed SwiGLU width a multiple of 128"),
    "w64": (
        "compressed-w64",
        ["--width-multiple", "64"],
        "every narrowed SwiGLU width a multiple of 64: SmolLM2's default grid (1536 units in steps of 64) is that "
        "already, so this is the default's model (the same widths and perplexities, measured)",
    ),
    "w32": (
        "compressed-w32",
        ["--width-multiple", "32"],
        "every narrowed SwiGLU width a multiple of 32: the default grid is that already (budget.mlp_width_grid), so "
        "this plans the default's model",
    ),
    "mlp-w256": (
        "compressed-mlp-w256",
        ["--kinds", "mlp", "--width-multiple", "256"],
        "the budget on the MLP alone, every query/key and value width whole (GGUF pads narrowed ones back to the head "
        "width), SwiGLU widths multiples of 256: the llama.cpp-shaped model (made by gguf_llamacpp.py)",
    ),
    "blend-local": (
        "compressed-blend-local",
        ["--refit-blend", "0"],
        "the MLP refit's target the dense MLP's output on the compressed stream alone (the default blends it half "
        "and half with the dense model's next hidden states, which the calibration windows define)",
    ),
    "prior-zero": (
        "compressed-prior-zero",
        ["--refit-prior", "zero"],
        "the MLP refit's ridge pulled towards zero (the default pulls towards the kept units' own W_down columns)",
    ),
    "plan-token": (
        "compressed-plan-token",
        ["--plan-error", "token"],
        "the plan spends the budget by each token's error relative to its residual energy (the default plans by the "
        "predicted KL of the next-token distributions, from Fisher directions on the calibration windows)",
    ),
    "remove-20": (
        "compressed-remove20",
        ["--remove", "0.20"],
        "20% of the stored parameters removed instead of 25%: what the decoder layers "
        "keep if a factorised tied embedding took the other 5% (benchmarks/embedding_rank.py --model)",
    ),
    "conversation": (
        "compressed-conversation",
        [],
        "the sampled calibration rows seeded by CALIBRATION_PROMPTS with eight conversational requests added (none of "
        "GENERIC_PROMPTS, which seed the chat domain): made from a tree whose CALIBRATION_PROMPTS ended with "
        + " / ".join(repr(p) for p in CONVERSATION_PROMPTS) + ", so the report names the prompt set 'calibration'",
    ),
    "refine-8": (
        "compressed-refine8",
        ["--refine-epochs", "8"],
        "twice the refinement's automatic 4 epochs over the calibration windows",
    ),
    "self-half": (
        "compressed-self-half",
        ["--self-calibration", "0.5"],
        "half the calibration windows sampled: every WikiText-2 window kept and as many sampled ones added (128 + 128; "
        "the default adds half as many, 128 + 64)",
    ),
    "prompted-only": (
        "compressed-prompted-only",
        [],
        "every sampled calibration row seeded by a request of CALIBRATION_PROMPTS (the default seeds half of them "
        "from one random vocabulary token): the same 64 sampled windows' count, presampled and given as a second "
        "--calibration text with --self-calibration 0",
    ),
    "seed-2": (
        "compressed-seed2",
        [],
        "the default's sampled calibration windows drawn again with another seed (2; the default's is 1), presampled "
        "and given as a second --calibration text with --self-calibration 0: how far the sampling alone moves each "
        "domain",
    ),
    "remove-20-same": (
        "compressed-remove20-same",
        ["--remove", "0.20"],
        "20% of the stored parameters removed instead of 25%, on the default's very calibration windows (its 64 kept "
        "sampled ones given as a second --calibration text with --self-calibration 0): what the last 5% of the "
        "budget costs, without the sampling's draw",
    ),
    "remove-22.5-same": (
        "compressed-remove22.5-same",
        ["--remove", "0.225"],
        "22.5% of the stored parameters removed, on the default's very calibration windows (as remove-20-same)",
    ),
    "plan-24-seed-2": (
        "compressed-plan24-seed2",
        ["--plan-windows", "24"],
        "the plan on 24 windows (as plan-24) on seed-2's very calibration windows: whether the plan's gain holds on "
        "another draw of the sampled windows",
    ),
    "plan-24": (
        "compressed-plan24",
        ["--plan-windows", "24"],
        "the plan measured on the first 24 calibration windows instead of 8 (16 WikiText-2 and 8 sampled, interleaved, "
        "instead of 5 and 3)",
    ),
}
#: variants whose sampled calibration windows are drawn here, before the command (it then samples none): name ->
#: the sampling's settings (`compress.calibration.sampled_calibration`'s, the default's 64 windows of 512 tokens), or
#: {"from": FOLDER}: the very windows the command kept in that variant's folder (copied into texts/), or
#: {"same_as": NAME}: the file of another PRESAMPLED variant
PRESAMPLED: dict[str, dict] = {
    "prompted-only": {"seed": 1, "chat_share": 1.0},
    "seed-2": {"seed": 2, "chat_share": 0.5},
    "remove-20-same": {"from": VARIANTS["default"][0]},
    "remove-22.5-same": {"from": VARIANTS["default"][0]},
    "plan-24-seed-2": {"same_as": "seed-2"},
}
PRESAMPLED_WINDOWS = 64


def presampled_file(name: str, texts: Path) -> Path:
    """Where a PRESAMPLED variant's sampled windows are kept (one file for every variant taking a folder's, or
    another variant's)."""
    name = PRESAMPLED[name].get("same_as", name)
    folder = PRESAMPLED[name].get("from")
    return texts / (f"sampled_{name}.safetensors" if folder is None else f"sampled_{folder}.safetensors")


def presampled_options(name: str, texts: Path) -> list[str]:
    """The options that give a PRESAMPLED variant its windows: the WikiText-2 calibration and the presampled file."""
    file = presampled_file(name, texts)
    return [
        "--calibration", str(texts / "calibration.pt"), str(file), "--self-calibration", "0",
        "--calibration-windows", str(128 + PRESAMPLED_WINDOWS),
    ]  # fmt: skip


def presample(name: str, texts: Path) -> None:
    """Sample a PRESAMPLED variant's calibration windows from the source once (kept in texts/)."""
    name = PRESAMPLED[name].get("same_as", name)
    file = presampled_file(name, texts)
    if file.is_file():
        return
    folder = PRESAMPLED[name].get("from")
    if folder is not None:  # the windows another run of the command kept, copied as they are
        from relational_hf.commands.compress_texts import SAMPLED_CALIBRATION_NAME
        from relational_hf.compress.distill import load_teacher_text, save_teacher_text

        kept = texts.parent / folder / SAMPLED_CALIBRATION_NAME
        if not kept.is_file():
            raise SystemExit(f"{name} takes the calibration windows kept in {kept}: make that variant first")
        save_teacher_text(file, *load_teacher_text(kept))
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relational_hf.compress.calibration import sampled_calibration
    from relational_hf.compress.distill import save_teacher_text
    from relational_hf.pretrained import smollm2_checkpoint

    source = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids, settings = sampled_calibration(model, tokenizer, n=PRESAMPLED_WINDOWS, window=512, **PRESAMPLED[name])
    save_teacher_text(file, ids, settings)


def compress_command(src: str, out: Path, texts: Path, extra: list[str]) -> list[str]:
    """The variant's command line: the defaults at --remove 0.25 (unless the variant gives its own) and its options."""
    evals = [a for d in DOMAINS for a in ("--eval", str(texts / f"{d}.pt"))]
    remove = [] if "--remove" in extra else ["--remove", "0.25"]
    calibration = [] if "--calibration" in extra else [
        "--calibration", str(texts / "calibration.pt"), "--calibration-windows", "128"
    ]  # fmt: skip
    return [
        "compress", src, str(out), *remove, *calibration, "--window", "512", "--eval-windows", "12", *evals, *extra,
    ]  # fmt: skip


def read_variant(folder: Path) -> dict | None:
    path = folder / "compression_report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text(encoding="utf-8"))
    texts = (report.get("eval") or {}).get("texts") or {}
    dense = {Path(n).stem: row["perplexity_before"] for n, row in texts.items()}
    after = {Path(n).stem: row["perplexity_after"] for n, row in texts.items()}
    ratios = {d: after[d] / dense[d] for d in after}
    held = [ratios[d] for d in TARGET_DOMAINS if d in ratios]
    cal = report.get("calibration") or {}
    sampling = cal.get("sampling") or {}
    return {
        "stored": report.get("parameters_after"),
        "stored_before": report.get("parameters_before"),
        "removed_share": report.get("removed_share"),
        "seconds": report.get("seconds"),
        "calibration": {k: v for k, v in (report.get("calibration") or {}).items() if k != "sampling"}
        | {"prompts": sampling.get("prompts", "generic" if cal.get("self_windows") else None),
           "sampling_seed": sampling.get("seed")},
        "width_multiple": (report.get("options") or {}).get("width_multiple"),
        "dense": dense,
        "perplexity": after,
        "ratio": ratios,
        "worst_of_four": max(held) if held else None,
    }


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = payload["variants"]
    names = list(cells)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / max(1, len(names))
    colours = plt.get_cmap("tab20").colors  # one colour per variant (the default cycle repeats after ten)
    for i, name in enumerate(names):
        r = cells[name]["ratio"]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(DOMAINS))]
        ax.bar(xs, [r.get(d, 0.0) for d in DOMAINS], width, label=f"{name} (worst x{cells[name]['worst_of_four']:.2f})",
               color=colours[i % len(colours)])  # fmt: skip
    ax.axhline(1.6, color="grey", ls="--", lw=0.8)
    ax.text(-0.45, 1.62, "target x1.6", ha="left", va="bottom", fontsize=8, color="grey")
    ax.set_xticks(range(len(DOMAINS)), DOMAINS)
    ax.set_ylabel("perplexity / dense perplexity")
    ax.set_title("relational-hf compress --remove 0.25 unless the variant says (SmolLM2-135M-Instruct): held-out domains",
                 fontsize=10)  # fmt: skip
    top = max(max(c["ratio"].values()) for c in cells.values())
    ax.set_ylim(0, top * 1.35)  # room above the bars for the legend
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME")
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--no-run", action="store_true", help="tabulate the variants that exist; run none")
    parser.add_argument("--tag", default="", help="suffix of the result files (cli_domains_TAG.json)")
    args = parser.parse_args()
    texts = args.workdir / "texts"
    if not all((texts / f"{d}.pt").is_file() for d in ("calibration", *DOMAINS)):
        raise SystemExit(f"no texts in {texts}: run `python benchmarks/gguf_llamacpp.py --prepare-only` first")
    from gguf_llamacpp import _cli

    from relational_hf.pretrained import smollm2_checkpoint

    variants, commands = {}, {}
    for name in args.variants:
        folder_name, extra, what = VARIANTS[name]
        folder = args.workdir / folder_name
        shown = extra
        if name in PRESAMPLED:
            extra, shown = presampled_options(name, texts) + extra, presampled_options(name, Path("texts")) + extra
        commands[name] = "relational-hf " + " ".join(
            compress_command("SMOLLM2", Path(folder_name), Path("texts"), shown)
        )
        found = read_variant(folder)
        if found is None and name == "generic-prompts":
            print(f"{name}: no report in {folder} (made by an earlier version; not rerun)", file=sys.stderr)
        elif found is None and not args.no_run:
            started = time.perf_counter()
            if name in PRESAMPLED:
                presample(name, texts)
            _cli(*compress_command(str(smollm2_checkpoint()), folder, texts, extra), log=args.workdir / f"{folder_name}.log")
            print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
            found = read_variant(folder)
        if found is not None and name in PRESAMPLED:  # the sampling's settings, which the command did not see
            from relational_hf.compress.distill import load_teacher_text

            kept = ("seed", "chat_share", "prompts", "samples", "length", "source")
            settings = load_teacher_text(presampled_file(name, texts))[1]
            found["calibration"]["presampled"] = {k: settings[k] for k in kept if k in settings} | {
                k: PRESAMPLED[name][k] for k in ("from", "same_as") if k in PRESAMPLED[name]
            }
        if found is not None:
            variants[name] = {"what": what, "command": commands[name]} | found
    if not variants:
        raise SystemExit("no variant has a compression report yet")
    payload = {
        "protocol": {
            "model": "SmolLM2-135M-Instruct, 25% of the stored parameters removed by the command line",
            "calibration": "the first 128 windows of 512 tokens of the first 90% of the WikiText-2 validation "
            "documents (gguf_llamacpp.py's texts/calibration.pt), plus the windows the CLI samples from the source",
            "domains": {d: DESCRIPTIONS[d] for d in DOMAINS},
            "eval_windows": "12 x 512 tokens per domain",
            "targets": "worst of the four target domains <= x1.6, WikiText-2 <= x1.35",
        },
        "variants": variants,
    }
    name = "cli_domains" + (f"_{args.tag}" if args.tag else "")
    path = write_json(name, payload)
    plot(payload, path.with_suffix(".png"))
    for key, cell in variants.items():
        row = "  ".join(f"{d} x{cell['ratio'][d]:.2f}" for d in DOMAINS if d in cell["ratio"])
        print(f"{key:16s} {row}  worst x{cell['worst_of_four']:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
