"""Publish a checkpoint to the Hugging Face Hub with a generated model card.

A thin front over `relational_hf.hub.push_checkpoint` (with the options of `relational-hf push`) that can also measure the
checkpoint's perplexity on a text first and put it into the card's model-index
(`relational_hf.hub.reference_cards.card_for_checkpoint`). Tokens come from --token, HF_TOKEN or `hf auth login`
and never appear in logs or in the card. Example:
    python training_scripts/push_to_hub.py checkpoints/relational-default me/relational-small \\
        --eval-text ../shared/data/tinyshakespeare/input.txt --dataset-id karpathy/tiny_shakespeare
"""

import logging
import sys
from dataclasses import dataclass

from relational_hf.commands.options import CommandArguments, PositiveInt, option
from relational_hf.commands.push import PushOptions, PushPaths
from relational_hf.commands.push import check as check_push
from relational_hf.hub import push_checkpoint
from relational_hf.hub.card import stored_parameters
from relational_hf.hub.reference_cards import card_for_checkpoint


@dataclass
class CardOptions:
    _argument_group_name = "model card"

    eval_text: str | None = option(None, "UTF-8 text to measure perplexity on before publishing", metavar="FILE")
    dataset_id: str | None = option(None, "Hub id of the data set (card metadata), e.g. Salesforce/wikitext")
    dataset_name: str | None = option(None, "readable name of the evaluation text (default: file name)")
    base_model: str | None = option(None, "Hub id of the model this one derives from (card metadata)")
    license: str = option("apache-2.0", "license identifier for the card")
    block_size: PositiveInt = option(256, "tokens per evaluation block")
    eval_blocks: PositiveInt = option(64, "evaluation blocks at most")


@dataclass
class PushToHubArguments(CommandArguments, CardOptions, PushOptions, PushPaths):
    POSITIONALS = PushPaths
    PARSER_GROUPS = (PushOptions, CardOptions)


def main(argv: list[str] | None = None) -> int:
    args = PushToHubArguments.parse(argv, description=__doc__.splitlines()[0])
    check_push(args)
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
