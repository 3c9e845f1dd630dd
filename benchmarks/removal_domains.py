"""What the last share of the budget costs on each domain: the command line's compression of SmolLM2-135M-Instruct at
several `--remove` levels on the very same calibration windows (the default's 128 WikiText-2 windows and the 64 it
sampled, kept in its folder), each unhealed and after `--heal-steps 200` as the command heals, with the dense control,
on the five held-out domains of `domains.py`.

It runs nothing: it reads what `cli_domains.py` (the compressions) and `heal_domains.py` (their healing) wrote, checks
that each healing ran on the compression it is set beside (the same folder, the same unhealed figures) and draws the
curve.

    python benchmarks/cli_domains.py --variants remove-20-same --tag remove20same            # and remove-22.5-same
    python benchmarks/heal_domains.py --compressed compressed-remove20-same --threads 1 \\
        --dense-control results/heal_domains_keptchat.json --tag remove20same
    python benchmarks/removal_domains.py

Writes results/removal_domains.json and removal_domains.png (`--results DIR` reads the inputs from DIR instead).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli_domains import VARIANTS
from common import RESULTS, save_figure, write_json
from domains import DOMAINS, TARGET_DOMAINS

#: (cli_domains.py result, its variant, heal_domains.py result on that variant's folder), the 25% default first
LEVELS: list[tuple[str, str, str]] = [
    ("cli_domains_keptchat.json", "default", "heal_domains_keptchat.json"),
    ("cli_domains_remove22same.json", "remove-22.5-same", "heal_domains_remove22same.json"),
    ("cli_domains_remove20same.json", "remove-20-same", "heal_domains_remove20same.json"),
]
#: how far the healing script's unhealed figures may differ from the command's own --eval of the same model
SAME_MODEL = 1e-3
WIKITEXT_TARGET, WORST_TARGET = 1.35, 1.6


def level(results: Path, cli_name: str, variant: str, heal_name: str) -> dict:
    """One removal level: its stored parameters, ratios to dense unhealed and healed, the dense control's, and the
    worst of the four target domains; SystemExit when the healing is not of this compression."""
    cell = json.loads((results / cli_name).read_text(encoding="utf-8"))["variants"][variant]
    heal = json.loads((results / heal_name).read_text(encoding="utf-8"))
    folder = VARIANTS[variant][0]
    if heal.get("compressed") != folder:
        raise SystemExit(f"{heal_name} healed {heal.get('compressed')!r}, not {variant}'s {folder!r}")
    unhealed = heal["ratio_to_dense"]["compressed"]
    off = {d: unhealed[d] / cell["ratio"][d] - 1 for d in DOMAINS}
    if any(abs(x) > SAME_MODEL for x in off.values()):
        raise SystemExit(f"{heal_name}'s unhealed figures are not {cli_name}'s {variant} ({off}): another model")
    if "dense, healed" not in heal["ratio_to_dense"]:
        raise SystemExit(f"{heal_name} has no dense control: a healed figure needs one")
    rows = {
        "unhealed": cell["ratio"],
        "healed": heal["ratio_to_dense"]["compressed, healed"],
        "dense control": heal["ratio_to_dense"]["dense, healed"],
    }
    return {
        "variant": variant,
        "removed_share": cell["removed_share"],
        "stored": cell["stored"],
        "stored_before": cell["stored_before"],
        "calibration": cell["calibration"],
        "sources": [cli_name, heal_name],
        "ratio": {k: {d: v[d] for d in DOMAINS} for k, v in rows.items()},
        "worst_of_four": {k: max(v[d] for d in TARGET_DOMAINS) for k, v in rows.items()},
        "targets_met_healed": max(rows["healed"][d] for d in TARGET_DOMAINS) <= WORST_TARGET
        and rows["healed"]["wikitext"] <= WIKITEXT_TARGET,
    }


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted(payload["levels"], key=lambda c: c["removed_share"])
    xs = [100 * c["removed_share"] for c in cells]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    colours = plt.get_cmap("tab10").colors
    for i, d in enumerate(DOMAINS):
        for kind, style in (("unhealed", "--"), ("healed", "-")):
            ax.plot(xs, [c["ratio"][kind][d] for c in cells], style, marker="o", color=colours[i],
                    label=f"{d}, {kind}" if kind == "healed" else None)  # fmt: skip
    ax.axhline(WORST_TARGET, color="grey", ls=":", lw=0.8)
    ax.text(xs[0], WORST_TARGET + 0.01, "x1.6, worst of four", fontsize=8, color="grey", va="bottom")
    ax.set_xlabel("stored parameters removed (%)")
    ax.set_ylabel("perplexity / dense perplexity")
    ax.set_title("relational-hf compress on SmolLM2-135M-Instruct, the same calibration windows at every level\n"
                 "dashed: as the command wrote it; solid: after --heal-steps 200", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the inputs are (default results/)")
    parser.add_argument("--tag", default="", help="suffix of the result files (removal_domains_TAG.json)")
    args = parser.parse_args(argv)
    missing = [n for c, _, h in LEVELS for n in (c, h) if not (args.results / n).is_file()]
    if missing:
        raise SystemExit(f"not measured yet: {', '.join(missing)} (see the module's help)")
    payload = {
        "protocol": "the command line's defaults at each --remove, one calibration (128 WikiText-2 windows and the "
        "default's 64 sampled ones), healed as --heal-steps 200 heals, the dense model healed the same way; 12 "
        "held-out windows of 512 tokens a domain; targets: worst of four <= x1.6 and WikiText-2 <= x1.35 healed",
        "levels": [level(args.results, *spec) for spec in LEVELS],
    }
    name = "removal_domains" + (f"_{args.tag}" if args.tag else "")
    write_json(name, payload)
    plot(payload, RESULTS / f"{name}.png")
    for c in payload["levels"]:
        print(f"{c['removed_share']:.1%}", " ".join(f"{d} x{c['ratio']['healed'][d]:.2f}" for d in DOMAINS),
              f"worst x{c['worst_of_four']['healed']:.2f}", "met" if c["targets_met_healed"] else "not met")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
