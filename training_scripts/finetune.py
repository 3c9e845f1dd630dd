"""Fine-tune a causal LM checkpoint, fully or with LoRA, with optional projected updates and parallel suppression.

A thin front over `relational_hf.commands.finetune`; `relational-hf finetune` runs the same code with the same flags.
Examples:
    python training_scripts/finetune.py checkpoints/relational-default --tokenizer byte \\
        --train-file ../shared/data/tinyshakespeare/input.txt --method lora --merge
    python training_scripts/finetune.py checkpoints/relational-default --train-file notes.txt \\
        --projection update --parallel-suppression 0.05 --parallel-suppression-site value
"""

import sys

from relational_hf.commands.finetune import main

if __name__ == "__main__":
    sys.exit(main())
