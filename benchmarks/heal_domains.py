"""Healing across domains, with its dense control: does a short repair of the compressed model hold on text unlike
its healing text, and what does the same repair do to the dense model?

The compressed model is the one `gguf_llamacpp.py` makes with the CLI's defaults (`relational-hf compress SRC OUT --remove
0.25 --calibration CAL.pt`, SmolLM2-135M-Instruct, 128 WikiText-2 windows plus 64 windows the source samples itself),
the dense model its exact conversion (`relational-hf convert`). Both are healed the way `compress --heal-steps 200`
heals (`relational_hf.training.heal.heal`, its defaults: LoRA rank 16, distillation from the dense model, KL of the
next-token distributions) on what the CLI heals on: text the dense model samples itself
(`compress.distill.teacher_text`, the CLI's default healing text: 256 samples of 256 tokens, seed 0, half of them
chat) and the compression's own calibration windows (the 128 WikiText-2 windows and the 64 the source sampled, rebuilt
with the sampling settings the compressed model's report records), half the blocks from each
(`compress.distill.healing_stream`, `--calibration-share`, default the CLI's 0.5; 0: the sampled text alone, what the
runs before the share was given here did), and measured on the five domains of
`domains.py` (12 held-out windows of 512 tokens each, the windows of `gguf_llamacpp.py`) before and after: ratio to the
dense model's unhealed perplexity and the worst of the four target domains.

    python benchmarks/gguf_llamacpp.py --prepare-only    # the texts and checkpoints, once
    python benchmarks/heal_domains.py           # about 35 minutes on 2 cores

Writes results/heal_domains.json and heal_domains.png. Today's default model (samples seeded by CALIBRATION_PROMPTS):

    python benchmarks/cli_domains.py --variants default          # makes compressed-calprompts
    python benchmarks/heal_domains.py --compressed compressed-calprompts --tag cli            # as the CLI heals
    python benchmarks/heal_domains.py --compressed compressed-calprompts --tag calprompts --calibration-share 0
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import RESULTS, save_figure, write_json
from domains import DOMAINS, TARGET_DOMAINS, ratios

from relational_hf.training.heal_settings import DEFAULT_HEAL_BATCH_SIZE, DEFAULT_HEAL_BLOCK_SIZE, DEFAULT_HEAL_LR


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _measure(model, windows: dict[str, torch.Tensor]) -> dict[str, float]:
    from relational_hf.compress.eval import perplexity_on_windows

    return {d: perplexity_on_windows(model, w) for d, w in windows.items()}


#: The healing's own settings a dense control must share (`training.heal.heal`'s report; earlier runs healed with the
#: defaults, which these are).
HEAL_DEFAULTS = {
    "learning_rate": DEFAULT_HEAL_LR["kd"], "lora_rank": 16, "batch_size": DEFAULT_HEAL_BATCH_SIZE,
    "block_size": DEFAULT_HEAL_BLOCK_SIZE, "adapter": "lora", "hidden_weight": 0.0,
}


def _earlier_control(
    path: Path,
    steps: int,
    dense: dict[str, float],
    share: float = 0.0,
    stream: dict | None = None,
    settings: dict | None = None,
    prompts: str = "generic",
    same_tokens=None,
) -> tuple[dict, dict]:
    """The healed dense model's perplexities and heal report from an earlier run, if it healed the same way on the
    same windows (its unhealed dense figures equal today's to 1e-6, its steps equal, the same calibration share and,
    with a share above 0, the same calibration windows: runs that recorded no share healed on the sampled text
    alone; the same prompts seeding the healing text; the same learning rate, LoRA rank, batch size and block
    size, `settings`, default `HEAL_DEFAULTS`). Calibration windows described otherwise are the same when
    `same_tokens(earlier run's JSON)` says the stream it rebuilds from that run's recorded folder holds today's very
    tokens (e.g. the same sampled windows, read from another file)."""
    import json

    earlier = json.loads(path.read_text(encoding="utf-8"))
    same_windows = all(abs(earlier["perplexity"]["dense"][d] / dense[d] - 1) < 1e-6 for d in DOMAINS)
    same_stream = (
        earlier.get("calibration_share", 0.0) == share
        and (share == 0.0 or earlier.get("stream") == stream or (same_tokens is not None and same_tokens(earlier)))
        and earlier.get("heal_prompts", "generic") == prompts
    )
    healed_with = (earlier.get("heal") or {}).get("dense") or {}
    wanted = settings or HEAL_DEFAULTS
    same_settings = all(healed_with.get(k, HEAL_DEFAULTS[k]) == v for k, v in wanted.items())
    if (
        earlier.get("steps") != steps
        or not same_windows
        or not same_stream
        or not same_settings
        or "dense, healed" not in earlier["perplexity"]
    ):
        raise SystemExit(
            f"{path} healed the dense model another way (steps, windows, healing stream or settings differ): heal it again"
        )
    return earlier["perplexity"]["dense, healed"], earlier["heal"]["dense"]


def _prompt_set(name: str):
    """The prompts a teacher text's chat rows are seeded from, by name: "generic" (the CLI's healing text),
    "calibration" (the CLI's calibration samples) or "both"; None for a name no set has."""
    from relational_hf.compress.distill import CALIBRATION_PROMPTS, GENERIC_PROMPTS

    sets = {"generic": GENERIC_PROMPTS, "calibration": CALIBRATION_PROMPTS, "both": GENERIC_PROMPTS + CALIBRATION_PROMPTS}
    return sets.get(name)


def _cached_teacher_text(path: Path, teacher, **settings) -> tuple[torch.Tensor, dict]:
    """`compress.distill.teacher_text` of the dense `teacher` with SmolLM2's tokenizer and `settings`, read from
    `path` when an earlier run saved it there, else sampled and saved."""
    from transformers import AutoTokenizer

    from relational_hf.compress.distill import load_teacher_text, save_teacher_text, teacher_text
    from relational_hf.pretrained import smollm2_checkpoint

    if path.exists():
        return load_teacher_text(path)
    ids, info = teacher_text(teacher, AutoTokenizer.from_pretrained(smollm2_checkpoint()), **settings)
    save_teacher_text(path, ids, info)
    return ids, info


def heal_text(workdir: Path, teacher, prompts: str = "generic") -> torch.Tensor:
    """The healing text: the CLI's default (`prompts` "generic", cached in workdir as heal_text.safetensors), or the
    same settings with the chat rows seeded from `GENERIC_PROMPTS` and `CALIBRATION_PROMPTS` together ("both",
    heal_text_both.safetensors)."""
    path = workdir / ("heal_text.safetensors" if prompts == "generic" else f"heal_text_{prompts}.safetensors")
    return _cached_teacher_text(path, teacher, prompts=None if prompts == "generic" else _prompt_set(prompts))[0]


def calibration_windows(workdir: Path, compressed: Path, teacher) -> tuple[torch.Tensor, dict]:
    """The calibration windows `relational-hf compress` fitted the compressed model on: the user's windows
    (texts/calibration.pt) and the source's samples its report records (count, length, seed, prompt set), mixed as the
    command mixes them (`compress.calibration.mixed_calibration`). The samples are read from the folder's
    calibration_sampled.safetensors, the very tokens, where the command kept them; for a folder made before it kept
    them, sampled again from the recorded settings (cached in the workdir; drawn from the dense conversion, so the
    command's recipe, not necessarily its very tokens: sampling from a model that differs in the last bits may
    diverge)."""
    import json

    from relational_hf.commands.compress_texts import SAMPLED_CALIBRATION_NAME
    from relational_hf.compress.calibration import mixed_calibration
    from relational_hf.compress.distill import load_teacher_text

    report = json.loads((compressed / "compression_report.json").read_text(encoding="utf-8"))
    info = report.get("calibration") or {}
    given = info.get("texts") or {}
    if len(given) == 2 and "calibration.pt" in given and not info.get("self_windows"):  # presampled (cli_domains.py)
        return _presampled_calibration(workdir, compressed, given)
    user = torch.load(workdir / "texts" / "calibration.pt")[: info.get("user_windows", 0)]
    sampling = info.get("sampling")
    if not info.get("self_windows"):
        return user, {"user_windows": user.shape[0], "self_windows": 0}
    name = sampling.get("prompts", "generic")
    prompts = _prompt_set(name) if name in ("generic", "calibration") else None
    if prompts is None or info.get("user_windows") != user.shape[0]:
        raise SystemExit(f"{compressed.name}: its calibration ({info}) cannot be rebuilt from the workdir's texts")
    keys = ("samples", "length", "seed", "chat_share")
    kept = compressed / SAMPLED_CALIBRATION_NAME  # the very tokens, where the command kept them
    if kept.is_file():
        rows, settings = load_teacher_text(kept)
        settings = settings | {"from": f"{compressed.name}/{SAMPLED_CALIBRATION_NAME}"}
    else:
        path = workdir / ("calibration_sampled_{prompts}_{samples}x{length}_seed{seed}.safetensors".format(**sampling))
        rows, settings = _cached_teacher_text(path, teacher, prompts=prompts, **{k: sampling[k] for k in keys})
        settings = settings | {"from": "sampled again from the recorded settings"}
    share = info["self_windows"] / (info["self_windows"] + info["user_windows"])
    windows, mixed = mixed_calibration(user, share, sampled=rows)
    return windows, mixed | {"sampling": {k: settings.get(k, sampling.get(k)) for k in (*keys, "prompts", "from")}}


def _presampled_calibration(workdir: Path, compressed: Path, given: dict[str, int]) -> tuple[torch.Tensor, dict]:
    """The calibration of a variant whose sampled windows were given as a second --calibration text (`cli_domains.py`'s
    PRESAMPLED): the workdir's calibration.pt and that file from texts/, interleaved as the command interleaves
    several texts (`compress.calibration.interleave`), described as the command's own sampled calibration is."""
    from relational_hf.compress.calibration import interleave
    from relational_hf.compress.distill import load_teacher_text

    name = next(n for n in given if n != "calibration.pt")
    path = workdir / "texts" / name
    if not path.is_file():
        raise SystemExit(f"{compressed.name}: its calibration names {name}, which is not in {path.parent}")
    user = torch.load(workdir / "texts" / "calibration.pt")[: given["calibration.pt"]]
    rows, settings = load_teacher_text(path)
    rows = rows[: given[name]]
    keys = ("samples", "length", "seed", "chat_share", "prompts")
    sampling = {k: settings.get(k) for k in keys} | {"from": f"texts/{name}"}
    return interleave([user, rows]), {"user_windows": user.shape[0], "self_windows": rows.shape[0], "sampling": sampling}


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["ratio_to_dense"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(rows)
    for i, (name, cells) in enumerate(rows.items()):
        ax.bar([j + (i - (len(rows) - 1) / 2) * width for j in range(len(DOMAINS))], [cells[d] for d in DOMAINS], width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.6, color="r", lw=0.8, ls="--", label="target: worst of four <= x1.6")
    ax.set_xticks(range(len(DOMAINS)), DOMAINS)
    ax.set_ylabel("perplexity / dense (unhealed)")
    ax.set_title("SmolLM2-135M at 25% fewer stored parameters: healed (200 steps) and not, dense control", fontsize=10)
    top = max(v for cells in rows.values() for v in cells.values())
    ax.set_ylim(0, top * 1.2)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=RESULTS / "gguf_runs" / "full")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--compressed", default="compressed", help="the compressed checkpoint's folder in the workdir "
        "(compressed-calprompts: today's default, made by cli_domains.py)",
    )
    parser.add_argument(
        "--dense-control", type=Path, metavar="JSON", help="take the healed dense model's figures from an earlier "
        "result of this script (the same healing text, steps and windows, checked) instead of healing it again",
    )
    parser.add_argument(
        "--calibration-share", type=float, default=None, help="share of the healing's blocks drawn from the "
        "compression's calibration windows (default: the CLI's, 0.5; 0 heals on the sampled text alone)",
    )
    parser.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: the CLI's for LoRA; required with --adapter full)"
    )
    parser.add_argument("--rank", type=int, default=HEAL_DEFAULTS["lora_rank"], help="LoRA rank")
    parser.add_argument(
        "--adapter", choices=("lora", "full"), default="lora", help="what the healing trains: LoRA adapters merged "
        "back (the CLI's) or the decoder maps' stored entries themselves (give --lr)",
    )
    parser.add_argument("--batch-size", type=int, default=HEAL_DEFAULTS["batch_size"], help="blocks a step takes")
    parser.add_argument("--block-size", type=int, default=HEAL_DEFAULTS["block_size"], help="tokens in a block")
    parser.add_argument(
        "--no-dense-control", action="store_true", help="heal the compressed model alone (an exploratory run: the "
        "JSON then has no dense control, which a reported healed figure needs)",
    )
    parser.add_argument(
        "--heal-prompts", choices=("generic", "both"), default="generic", help="what the healing text's chat rows are "
        "seeded from: the CLI's GENERIC_PROMPTS (default), or those and CALIBRATION_PROMPTS together",
    )
    parser.add_argument(
        "--hidden-weight", type=float, default=0.0, help="add this weight times the residual streams' relative "
        "distance to the dense model's to the distillation loss (default 0: the CLI's KL alone)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--tag", default="", help="suffix of the result files (heal_domains_TAG.json)")
    args = parser.parse_args(argv)
    if args.lr is None and args.adapter == "full":
        parser.error("--adapter full needs --lr (the LoRA default does not carry over)")
    if args.lr is None:
        args.lr = HEAL_DEFAULTS["learning_rate"]
    settings = {
        "learning_rate": args.lr, "lora_rank": args.rank, "batch_size": args.batch_size, "block_size": args.block_size,
        "adapter": args.adapter, "hidden_weight": args.hidden_weight,
    }
    torch.set_num_threads(args.threads)
    from relational_hf.compress.distill import calibration_share, healing_stream
    from relational_hf.training.heal import heal

    windows = {d: torch.load(args.workdir / "texts" / f"{d}.pt") for d in DOMAINS}
    dense = _load(args.workdir / "dense")
    if not (args.workdir / args.compressed / "config.json").is_file():
        raise SystemExit(f"no checkpoint {args.compressed!r} in {args.workdir}: make it first (see the module's help)")
    try:
        share = calibration_share(args.calibration_share, "--calibration-share")
    except ValueError as err:
        parser.error(str(err))
    text = heal_text(args.workdir, dense, args.heal_prompts)
    stream: dict = {"calibration_share": share, "text_tokens": text.numel()}
    sampled = text
    if share > 0.0:
        calibration, info = calibration_windows(args.workdir, args.workdir / args.compressed, dense)
        text, stream = healing_stream(text, calibration, share)
        stream["calibration"] = info

    def same_tokens(earlier: dict) -> bool:
        """Whether the earlier run's stream, rebuilt from its recorded folder, is today's token for token."""
        folder = args.workdir / str(earlier.get("compressed"))
        if not (folder / "compression_report.json").is_file():
            return False
        rebuilt = healing_stream(sampled, calibration_windows(args.workdir, folder, dense)[0], share)[0]
        return torch.equal(rebuilt, text)

    perplexity = {"dense": _measure(dense, windows)}
    reports = {}
    control = (
        _earlier_control(
            args.dense_control, args.steps, perplexity["dense"], share, stream, settings, args.heal_prompts, same_tokens
        )
        if args.dense_control else None
    )  # fmt: skip
    healing_dense = not control and not args.no_dense_control
    runs = [("compressed", args.workdir / args.compressed)] + ([("dense", args.workdir / "dense")] if healing_dense else [])
    for name, folder in runs:
        model = _load(folder)
        if name == "compressed":
            perplexity["compressed"] = _measure(model, windows)
        started = time.perf_counter()
        healed, report = heal(
            model, text, steps=args.steps, loss="kd", teacher=dense, progress=True, heal_lr=args.lr,
            heal_rank=args.rank, heal_batch_size=args.batch_size, heal_block_size=args.block_size,
            adapter=args.adapter, hidden_weight=args.hidden_weight,
        )  # fmt: skip
        report["wall_seconds"] = time.perf_counter() - started
        reports[name] = report
        perplexity[f"{name}, healed"] = _measure(healed, windows)
        del model, healed
    if control:
        perplexity["dense, healed"], reports["dense"] = control
    base = perplexity["dense"]
    table = {name: {d: p[d] / base[d] for d in DOMAINS} for name, p in perplexity.items() if name != "dense"}
    payload = {
        "steps": args.steps,
        "compressed": args.compressed,
        "dense_control_from": args.dense_control.name if args.dense_control else None,
        "heal_text": "256 samples x 256 tokens the dense model writes itself (seed 0, half chat): the CLI's default"
        + ("" if args.heal_prompts == "generic" else ", the chat rows seeded from GENERIC_PROMPTS + CALIBRATION_PROMPTS"),
        "heal_prompts": args.heal_prompts,
        "calibration_share": share,
        "heal_settings": settings,
        "dense_control": "none (exploratory)" if args.no_dense_control else "healed the same way",
        "stream": stream,
        "perplexity": perplexity,
        "ratio_to_dense": table,
        "worst_of_four": {name: ratios(p, base, TARGET_DOMAINS) for name, p in perplexity.items() if name != "dense"},
        "heal": reports,
    }
    name = "heal_domains" + (f"_{args.tag}" if args.tag else "")
    write_json(name, payload)
    plot(payload, RESULTS / f"{name}.png")
    for name, cells in table.items():
        print(name, " ".join(f"{d} x{cells[d]:.2f}" for d in DOMAINS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
