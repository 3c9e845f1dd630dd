"""Training: the relational Trainer and its arguments, the callbacks of the training jobs, PEFT support and the
reference checkpoints.

The data, tokenizers and metrics live in `relational_hf.lm` and parallel suppression in
`relational_hf.directional.suppression`; the `train` and `finetune` commands in `relational_hf.commands`.
"""

from .arguments import RelationalTrainingArguments
from .callbacks import TimeLimitCallback
from .trainer import RelationalTrainer

__all__ = ["RelationalTrainer", "RelationalTrainingArguments", "TimeLimitCallback"]
