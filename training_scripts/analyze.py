"""Directional analysis of a causal LM on a text file (DESIGN.md section 3).

A thin front over `relational_hf.directional` (`add_analyze_arguments`, `run_analyze`); `relational-hf analyze` runs
the same code. It prints per-site parallel ratios, the perplexity sweeps and compression errors, writes report.json
and figures to --out, and ends with the model's perplexity and parameter count.
Example:
    python training_scripts/analyze.py checkpoints/relational-default --text ../shared/data/wikitext-2/valid.txt \\
        --max-tokens 8192 --compression int8 wanda-2:4
"""

import argparse
import sys

from relational_hf.directional import add_analyze_arguments, run_analyze
from relational_hf.hub.card import stored_parameters


def main(argv: list[str] | None = None) -> int:
    parser = add_analyze_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    report = run_analyze(args)
    stored = stored_parameters(args.model)
    counted = "" if stored is None else f"; {stored:,} values stored in the checkpoint's safetensors"
    print(f"summary: perplexity {report['perplexity']:.3f} on {report['tokens_analysed']:,} tokens{counted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
