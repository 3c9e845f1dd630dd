"""Train a reference relational checkpoint on a corpus of ../shared/data and write its measured model card.

One command per reference model (run from the project root):
    python model_cards/build_reference.py tinyshakespeare-char    # characters of Tiny Shakespeare
    python model_cards/build_reference.py wikitext2               # WikiText-2 text, trained BPE tokenizer
    python model_cards/build_reference.py smollm2-converted       # SmolLM2-135M-Instruct converted exactly
    python model_cards/build_reference.py smollm2-compressed --from DIR   # a `relational-hf compress` output

Each run trains for at most --max-minutes (default 10) or --max-steps, evaluates on the held-out 10%, saves the
checkpoint, tokenizer and card to checkpoints/<name>/, and writes the card to model_cards/<name>.md with the measured
numbers in model_cards/<name>.json. Every number in a card comes from the run that wrote it. Publish a checkpoint
with `relational-hf push checkpoints/<name> <namespace>/<name>`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from dataclasses import replace
from pathlib import Path

from relational_hf.training.reference_models import PRESETS, build_reference

HERE = Path(__file__).resolve().parent


def load_smollm2_cards():
    """The sibling module smollm2_cards.py (loaded by path: this script also runs without model_cards/ on sys.path)."""
    spec = importlib.util.spec_from_file_location("smollm2_cards", HERE / "smollm2_cards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="presets: " + ", ".join(PRESETS) + "; SmolLM2 cards: smollm2-converted, smollm2-compressed --from DIR",
    )
    parser.add_argument("preset", choices=sorted(PRESETS), help="which reference model to build")
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="training time budget (default: the preset's, 10)"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: the preset's, 3000)")
    parser.add_argument("--output-dir", default=None, help="checkpoint folder (default: checkpoints/<name>)")
    parser.add_argument(
        "--card-dir", default=str(HERE), help="where <name>.md and <name>.json go (default: model_cards/)"
    )
    parser.add_argument(
        "--repo-id", default=None, help="Hub repository named in the card (default: relational-hf/<name>)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of initialisation and sampling (default: 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("smollm2-"):  # cards of a real pretrained model (smollm2_cards.py)
        return load_smollm2_cards().main(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = PRESETS[args.preset]
    changes = {"max_minutes": args.max_minutes, "max_steps": args.max_steps, "seed": args.seed}
    spec = replace(spec, **{key: value for key, value in changes.items() if value is not None})
    result = build_reference(
        spec,
        project_root=HERE.parent,
        output_dir=args.output_dir,
        card_path=Path(args.card_dir) / f"{spec.name}.md",
        repo_id=args.repo_id,
    )
    print(
        f"{result.name}: {result.steps} steps in {result.seconds / 60:.1f} min; validation perplexity "
        f"{result.val_perplexity:.3f} (unigram {result.unigram_perplexity:.3f}); {result.parameters:,} parameters "
        f"(free gauge {result.free_gauge_parameters:,}, Llama {result.llama_parameters:,})\n"
        f"checkpoint: {result.output_dir}; card: {Path(args.card_dir) / (result.name + '.md')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
