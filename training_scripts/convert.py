"""Convert a Llama-family checkpoint to the relational form (exact; optional principal-gauge slicing).

A thin front over `relational_hf.commands.convert`; `relational-hf convert` runs the same code and prints the
conversion report (parameter counts, logit difference, perplexity change when slicing).
Example:
    python training_scripts/convert.py path/to/llama-checkpoint checkpoints/relational-converted
"""

import sys

from relational_hf.commands.main import run_command


def main(argv: list[str] | None = None) -> int:
    return run_command("convert", argv)


if __name__ == "__main__":
    sys.exit(main())
