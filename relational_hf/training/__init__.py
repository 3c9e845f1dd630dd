"""Training: the relational Trainer and its arguments, the callbacks of the training jobs, PEFT support, saving a
model FSDP2 sharded (`fsdp`: `gathered_for_saving`, `unsharded_class`) and the reference checkpoints.

The data, tokenizers and metrics live in `relational_hf.lm` and parallel suppression in
`relational_hf.directional.suppression`; the `train` and `finetune` commands in `relational_hf.commands`.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers; at run time each is imported when first read
    from .arguments import RelationalTrainingArguments
    from .callbacks import TimeLimitCallback
    from .trainer import RelationalTrainer

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".arguments": ("RelationalTrainingArguments",),
        ".callbacks": ("TimeLimitCallback",),
        ".trainer": ("RelationalTrainer",),
    },
)

__all__ = ["RelationalTrainer", "RelationalTrainingArguments", "TimeLimitCallback"]
