"""`RelationalTrainingArguments`: Transformers' `TrainingArguments` plus the quotient-optimisation and
parallel-suppression settings of DESIGN.md sections 2.3 and 3; and the option dataclasses of the `train` and
`finetune` commands (`CommandArguments`, `DataArguments`, `RunArguments`), parsed with Transformers'
`HfArgumentParser`, each option checked with its range, and mapped to `RelationalTrainingArguments` in one place
(`RunArguments.training_arguments`)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Literal, get_args

import torch
from transformers import HfArgumentParser, TrainingArguments

from ..validate import (
    TextFile,
    check_fields,
    int_at_least,
    nonempty_str,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)

Projection = Literal["none", "update"]
SuppressionSite = Literal["residual", "value"]
PROJECTIONS: tuple[str, ...] = get_args(Projection)
SUPPRESSION_SITES: tuple[str, ...] = get_args(SuppressionSite)


@dataclass
class RelationalTrainingArguments(TrainingArguments):
    """`TrainingArguments` with three more fields (all default to plain `Trainer` behaviour):

    - `symmetry_projection`: "none", or "update" to wrap the optimiser in `relational_hf.symmetry.ProjectedOptimizer`
      so that every step delta is replaced by its horizontal part delta - P_V(delta);
    - `parallel_suppression_coef`: lambda of the soft suppression term lambda * mean cos^2(y, z) added to the task
      loss (0 turns it off and installs no hook);
    - `parallel_suppression_site`: "residual" (y = attention output and MLP output, z = the hidden state entering
      that sublayer) or "value" (per head before W_O, y = o_t = sum_s A_ts v_s, z = v_t).
    """

    symmetry_projection: str = field(
        default="none",
        metadata={
            "help": "'update': project every optimizer update onto the horizontal space (no motion along symmetry "
            "orbits); 'none': plain optimizer.",
            "choices": list(PROJECTIONS),
        },
    )
    parallel_suppression_coef: float = field(
        default=0.0,
        metadata={"help": "lambda of the soft parallel-suppression term lambda * mean cos^2(y, z); 0 = off."},
    )
    parallel_suppression_site: str = field(
        default="residual",
        metadata={
            "help": "where cos^2(y, z) is taken: 'residual' (attention and MLP outputs vs the hidden state entering "
            "the sublayer) or 'value' (per-head attention output o_t vs the token's own value v_t).",
            "choices": list(SUPPRESSION_SITES),
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.symmetry_projection not in PROJECTIONS:
            raise ValueError(f"symmetry_projection must be one of {PROJECTIONS}, got {self.symmetry_projection!r}")
        if self.parallel_suppression_site not in SUPPRESSION_SITES:
            raise ValueError(
                f"parallel_suppression_site must be one of {SUPPRESSION_SITES}, got {self.parallel_suppression_site!r}"
            )
        if not 0.0 <= self.parallel_suppression_coef < math.inf:
            raise ValueError(
                f"parallel_suppression_coef must be a finite number >= 0, got {self.parallel_suppression_coef}"
            )


# ---------------------------------------------------------------------------------------------------------------
# the options of the `train` and `finetune` commands: dataclasses parsed with Transformers' HfArgumentParser
# ---------------------------------------------------------------------------------------------------------------

#: option types with their allowed range (`Annotated` metadata read by `relational_hf.validate.check_fields`;
#: HfArgumentParser sees the plain type)
PositiveInt = Annotated[int, positive_int]
NonNegativeInt = Annotated[int, nonnegative_int]
PositiveFloat = Annotated[float, positive_float]
NonNegativeFloat = Annotated[float, nonnegative_float]
BlockSize = Annotated[int, int_at_least(2)]
NonEmptyStr = Annotated[str, nonempty_str]
TextPath = Annotated[str, TextFile()]


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field for a command option: its default and its --help text (argparse formats the help, so a
    literal % is written %%)."""
    return field(default=default, metadata={"help": help, **metadata})


def with_default(options: type, name: str, default: Any, help: str | None = None) -> Any:
    """The option `name` of the dataclass `options` declared again with a command's own `default` (and `help`):
    for a subclass that shares an option but not its default."""
    inherited = {item.name: item for item in fields(options)}[name]
    return field(default=default, metadata={**inherited.metadata, **({"help": help} if help else {})})


class CommandArguments:
    """Base of the option dataclasses of a command. Every instance is checked when built (`__post_init__`:
    `check_fields`, a `UsageError` naming the flag, the allowed range and the value), whether it comes from the
    command line or from Python. A subclass lists its parser groups in `PARSER_GROUPS` (each a dataclass with an
    `_argument_group_name`, HfArgumentParser's convention) and inherits from all of them, so that one flat instance
    holds every option."""

    PARSER_GROUPS: tuple[type, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def argument_parser(cls, **kwargs: Any) -> HfArgumentParser:
        """An `HfArgumentParser` over `PARSER_GROUPS`: each field is an option spelled --name_with_underscores and
        --name-with-dashes, its help from the field's metadata, bool fields as switches. `kwargs` go to
        `argparse.ArgumentParser` (e.g. ``add_help=False`` for a parser used through ``parents=[...]``)."""
        return HfArgumentParser(cls.PARSER_GROUPS, **kwargs)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace):
        """The checked instance holding the options of a parsed command line (other attributes are ignored)."""
        values = vars(namespace)
        return cls(**{item.name: values[item.name] for item in fields(cls) if item.init and item.name in values})


@dataclass
class DataArguments(CommandArguments):
    """Where the training text comes from (`relational_hf.lm.data.load_texts`)."""

    _argument_group_name = "data"

    train_file: TextPath | None = option(None, "a UTF-8 text file to train on (the last 10%% of lines validate)")
    dataset: NonEmptyStr | None = option(
        None, "a `datasets.load_dataset` name (needs network or a local dataset folder)"
    )
    dataset_config: str | None = option(None, "the dataset configuration name, e.g. wikitext-2-raw-v1")
    text_column: NonEmptyStr = option("text", "dataset column holding the text")


@dataclass
class RunArguments(CommandArguments):
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
    block_size: BlockSize = option(128, "context length in tokens (>= 2)")
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
