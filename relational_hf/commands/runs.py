"""What `train` and `finetune` share: the data and training-run options (mapped to `RelationalTrainingArguments` in
one place, `RunArguments.training_arguments`), the claimed output folder, and the checks on the token streams."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..training.arguments import Projection, RelationalTrainingArguments, SuppressionSite
from .options import (
    Length,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    TextPath,
    option,
)


@dataclass
class DataArguments:
    """Where the training text comes from (`relational_hf.lm.data.load_texts`)."""

    _argument_group_name = "data"

    train_file: TextPath | None = option(None, "a UTF-8 text file to train on (the last 10%% of lines validate)")
    dataset: NonEmptyStr | None = option(
        None, "a `datasets.load_dataset` name (needs network or a local dataset folder)"
    )
    dataset_config: str | None = option(None, "the dataset configuration name, e.g. wikitext-2-raw-v1")
    text_column: NonEmptyStr = option("text", "dataset column holding the text")


@dataclass
class RunArguments:
    """The training run: output folder, Trainer settings (`training_arguments` maps them), time limit, evaluation,
    and the quotient options (projected updates, parallel suppression). Defaults are those of `train`; `finetune`
    declares its own with `with_default`."""

    _argument_group_name = "training"

    output_dir: str = option("checkpoints/run", "where the model goes")
    overwrite: bool = option(
        False,
        "allow an --output-dir that is not empty and was not written by relational-hf (finetune: also the model's "
        "own folder, full fine-tuning only); its checkpoint files are replaced, other files kept",
    )
    block_size: Length = option(128, "context length in tokens (>= 2)")
    batch_size: PositiveInt = option(16, "sequences per micro-batch and process")
    gradient_accumulation_steps: PositiveInt = option(1, "micro-batches per optimizer step")
    max_steps: PositiveInt = option(1000, "optimizer steps (the time limit may stop earlier)")
    max_minutes: PositiveFloat = option(2.5, "stop training after this many minutes")
    learning_rate: PositiveFloat | None = option(3e-3, "peak AdamW learning rate (cosine schedule)")
    warmup_steps: NonNegativeInt = option(30, "linear warm-up steps before the cosine decay")
    weight_decay: NonNegativeFloat = option(0.0, "AdamW weight decay")
    seed: NonNegativeInt = option(0, "seed of initialisation, data order and sampling")
    logging_steps: PositiveInt = option(50, "log the loss (and the relational metrics) every N optimizer steps")
    save_steps: PositiveInt = option(250, "trainer checkpoint interval in optimizer steps (for --resume)")
    resume: bool = option(False, "continue from the newest complete trainer checkpoint in OUTPUT_DIR/trainer_state")
    eval_blocks: PositiveInt = option(64, "validation blocks used for perplexity")
    projection: Projection = option(
        "none",
        "update: project every optimizer update onto the horizontal space, no motion along symmetry orbits "
        "(free-gauge or Llama weights, full training)",
    )
    parallel_suppression: NonNegativeFloat = option(
        0.0, "lambda of the soft parallel-suppression term lambda * mean cos^2(y, z); 0 = off"
    )
    parallel_suppression_site: SuppressionSite = option(
        "residual",
        "where cos^2(y, z) is taken: residual (attention/MLP outputs vs the hidden state entering the sublayer) "
        "or value (each head's output before W_O vs its own value)",
    )

    @property
    def train_samples(self) -> int:
        """Training sequences the run draws: max_steps x batch_size x gradient_accumulation_steps."""
        return self.max_steps * self.batch_size * self.gradient_accumulation_steps

    def training_arguments(self, trainer_dir: str | os.PathLike, **settings: Any) -> RelationalTrainingArguments:
        """The one place where the command's options become Trainer settings: `RelationalTrainingArguments` with the
        batch size, accumulation, steps, peak learning rate (cosine schedule, linear warm-up), weight decay, seed,
        logging and checkpoint intervals, projection and suppression of these options, one kept trainer
        checkpoint in `trainer_dir`, no reporting integration, the CPU where there is no GPU. `settings` adds or
        overrides TrainingArguments fields."""
        values: dict[str, Any] = {
            "output_dir": str(trainer_dir),
            "per_device_train_batch_size": self.batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "max_steps": self.max_steps,
            "learning_rate": self.learning_rate,
            "lr_scheduler_type": "cosine",
            "warmup_steps": self.warmup_steps,
            "weight_decay": self.weight_decay,
            "seed": self.seed,
            "logging_steps": self.logging_steps,
            "save_steps": self.save_steps,
            "save_total_limit": 1,
            "report_to": [],
            "dataloader_num_workers": 0,
            "use_cpu": not torch.cuda.is_available(),
            "symmetry_projection": self.projection,
            "parallel_suppression_coef": self.parallel_suppression,
            "parallel_suppression_site": self.parallel_suppression_site,
        }
        return RelationalTrainingArguments(**values | settings)


def check_blocks(ids: torch.Tensor, block_size: int, what: str, extra: int = 0) -> None:
    """`UsageError` unless the token stream `ids` holds at least one --block-size block plus `extra` tokens (checked
    before training: random training windows need one token more than a block)."""
    if ids.numel() < block_size + extra:
        raise UsageError(
            f"{what} has {ids.numel()} tokens, fewer than {block_size + extra} (one --block-size block of {block_size}"
            f"{' plus one' if extra else ''}): use more text or a smaller --block-size"
        )


def is_main_process() -> bool:
    """True outside torchrun/accelerate and on the global rank 0 (the process that claims and writes the output)."""
    return int(os.environ.get("RANK", "0")) == 0


@contextmanager
def claimed_output(args: RunArguments, command: str, kind: str) -> Iterator[Path]:
    """Check, lock and mark `args.output_dir` for the whole run (`relational_hf.outputs`); other ranks only check."""
    from ..outputs import OutputLock, normalise_output_dir, prepare_output_dir, remove_if_unused

    out = normalise_output_dir(args.output_dir)
    if not is_main_process():
        yield out
        return
    with OutputLock(out):
        existed = out.exists()
        prepared = prepare_output_dir(out, overwrite=args.overwrite, resume=args.resume, command=command, kind=kind)
        try:
            yield prepared
        except BaseException:
            if not existed:  # a run that failed before writing anything leaves no empty folder behind
                remove_if_unused(prepared)
            raise


__all__ = ["DataArguments", "RunArguments", "check_blocks", "claimed_output", "is_main_process"]
