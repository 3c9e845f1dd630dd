"""Convert a Llama-family checkpoint to the relational form (exact; optional principal-gauge slicing).

A thin front over `relational_hf.convert` (`add_convert_arguments`, `run_convert`); `relational-hf convert` runs the
same code and prints the conversion report (parameter counts, logit difference, perplexity change when slicing).
Example:
    python training_scripts/convert.py path/to/llama-checkpoint checkpoints/relational-converted
"""

import argparse
import sys

from relational_hf.convert import add_convert_arguments, run_convert


def main(argv: list[str] | None = None) -> int:
    parser = add_convert_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
