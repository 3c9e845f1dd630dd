"""Pre-train a relational transformer (or a Llama baseline) from scratch.

A thin front over `relational_hf.commands.train`; `relational-hf train` runs the same code with the same flags.
Examples:
    python training_scripts/pretrain.py                                   # built-in corpus, about 3 minutes on CPU
    python training_scripts/pretrain.py --train-file ../shared/data/tinyshakespeare/input.txt --max-minutes 30
    python training_scripts/pretrain.py --dataset wikitext --dataset-config wikitext-2-raw-v1 --tokenizer bpe
    python training_scripts/pretrain.py --architecture llama --output-dir checkpoints/llama-baseline
"""

import sys

from relational_hf.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
