"""Directional analysis of a causal LM on a text file (DESIGN.md section 3).

A thin front over `relational_hf.commands.analyze`; `relational-hf analyze` runs the same code. It prints per-site
parallel ratios, the perplexity sweeps and compression errors, writes report.json and figures to --out, and ends with
the model's perplexity and the values stored in its checkpoint.
Example:
    python training_scripts/analyze.py checkpoints/relational-default --text ../shared/data/wikitext-2/valid.txt \\
        --max-tokens 8192 --compression int8 wanda-2:4
"""

import sys

from relational_hf.commands.main import run_command


def main(argv: list[str] | None = None) -> int:
    return run_command("analyze", argv)


if __name__ == "__main__":
    sys.exit(main())
