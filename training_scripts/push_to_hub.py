"""Publish a checkpoint to the Hugging Face Hub with a generated model card.

A thin front over `relational_hf.hub.push_checkpoint` (as `relational-hf push`) that can also measure the
checkpoint's perplexity on a text first and put it into the card's model-index
(`relational_hf.hub.reference.card_for_checkpoint`). Tokens come from --token, HF_TOKEN or `hf auth login`
and never appear in logs or in the card. Example:
    python training_scripts/push_to_hub.py checkpoints/relational-default me/relational-small \\
        --eval-text ../shared/data/tinyshakespeare/input.txt --dataset-id karpathy/tiny_shakespeare
"""

import argparse
import logging
import sys

from relational_hf.hub import add_push_arguments, push_checkpoint
from relational_hf.hub.card import stored_parameters
from relational_hf.hub.reference import card_for_checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = add_push_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    card = parser.add_argument_group("model card")
    card.add_argument("--eval-text", default=None, help="UTF-8 text to measure perplexity on before publishing")
    card.add_argument(
        "--dataset-id", default=None, help="Hub id of the data set (card metadata), e.g. Salesforce/wikitext"
    )
    card.add_argument("--dataset-name", default=None, help="readable name of the evaluation text (default: file name)")
    card.add_argument("--base-model", default=None, help="Hub id of the model this one derives from (card metadata)")
    card.add_argument("--license", default="apache-2.0", help="license identifier for the card (default: %(default)s)")
    card.add_argument("--block-size", type=int, default=256, help="tokens per evaluation block (default: %(default)s)")
    card.add_argument("--eval-blocks", type=int, default=64, help="evaluation blocks at most (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    card, measured = card_for_checkpoint(
        args.checkpoint_dir,
        args.repo_id,
        eval_text=args.eval_text,
        dataset_id=args.dataset_id,
        dataset_name=args.dataset_name,
        block_size=args.block_size,
        max_blocks=args.eval_blocks,
        base_model=args.base_model,
        license=args.license,
    )
    url = push_checkpoint(
        args.checkpoint_dir,
        args.repo_id,
        private=args.private,
        endpoint=args.endpoint,
        token=args.token,
        card=card,
        commit_message=args.message,
    )
    stored = stored_parameters(args.checkpoint_dir)
    lines = [f"published {args.checkpoint_dir} as {args.repo_id}: {url}"]
    if "perplexity" in measured:
        lines.append(
            f"perplexity {measured['perplexity']:.3f} on {args.eval_text}; {int(measured['parameters']):,} parameters"
        )
    if stored is not None:
        lines.append(f"{stored:,} values stored in the safetensors files")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
