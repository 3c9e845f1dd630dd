"""What `train` and `finetune` share: the data and training-run options (mapped to `RelationalTrainingArguments` in
one place, `RunArguments.training_arguments`), the claimed output folder, and the checks on the token streams."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from transformers import TrainerCallback

from ..errors import UsageError
from ..training.arguments import Projection, RelationalTrainingArguments, SuppressionSite
from .checks import dataset_source
from .options import (
    Length,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    TextFile,
    TextPath,
    option,
)

#: the most training sequences a run may request (a dataset's length must fit `sys.maxsize`)
MAX_TRAIN_SAMPLES = 2**62


class FsdpConfigFile:
    """A JSON file holding one object of Transformers' `fsdp_config` settings, for FSDP version 2 (the version the
    update projection supports: its DTensor parameters are read whole, block by block)."""

    def read(self, path: str, flag: str = "--fsdp-config") -> dict[str, Any]:
        try:
            settings = json.loads(Path(path).read_text(encoding="utf-8"))
        except ValueError as err:
            raise UsageError(f"{flag}: {path} is not valid JSON ({err})") from None
        if not isinstance(settings, dict):
            raise UsageError(
                f"{flag}: {path} must hold a JSON object of fsdp_config settings, got {type(settings).__name__}"
            )
        version = settings.get("version", settings.get("fsdp_version", 2))
        if str(version) != "2":
            raise UsageError(f"{flag}: only FSDP version 2 is supported, {path} asks for version {version!r}")
        return settings

    def check(self, value: object, flag: str) -> None:
        """`UsageError` naming `flag` unless `value` is a readable JSON object with no version other than 2."""
        self.read(str(value), flag)


FsdpConfigPath = Annotated[str, TextFile(), FsdpConfigFile()]


@dataclass
class DataArguments:
    """Where the training text comes from (`relational_hf.lm.data.load_texts`)."""

    _argument_group_name = "data"

    train_file: TextPath | None = option(None, "a UTF-8 text file to train on (the last 10%% of lines validate)")
    dataset: NonEmptyStr | None = option(
        None, "a `datasets.load_dataset` name (needs network or a local dataset folder)"
    )
    dataset_config: str | None = option(None, "the dataset configuration name, e.g. wikitext-2-raw-v1")
    text_column: NonEmptyStr | None = option(None, "dataset column holding the text (with --dataset); unset: text")

    def check_data(self) -> None:
        """`UsageError` for data options that contradict or do not apply: --train-file with --dataset,
        --dataset-config or --text-column without --dataset, a --dataset path that does not exist."""
        if self.train_file and self.dataset:
            raise UsageError("give either --train-file or --dataset, not both")
        for flag, value in (("--dataset-config", self.dataset_config), ("--text-column", self.text_column)):
            if value is not None and not self.dataset:
                raise UsageError(f"{flag} applies only to --dataset (it names a part of a `datasets` dataset)")
        dataset_source(self.dataset)

    def load(self, command: str) -> tuple[str, str, str]:
        """(train text, validation text, source description) of these options (`relational_hf.lm.data.load_texts`);
        without --train-file and --dataset says on stderr, in one line, that the built-in corpus is used."""
        from ..lm.data import load_texts

        train, val, source = load_texts(self.train_file, self.dataset, self.dataset_config, self.text_column or "text")
        if not (self.train_file or self.dataset):
            print(
                f"relational-hf {command}: no --train-file or --dataset given: training on the {source}: synthetic "
                "text, not natural language",
                file=sys.stderr,
            )
        return train, val, source


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
        "own folder, full fine-tuning only); its checkpoint files are replaced by the final save, other files kept "
        "(also in trainer_state/). Without it, a clash is refused before training",
    )
    block_size: Length = option(128, "context length in tokens (>= 2)")
    batch_size: PositiveInt = option(16, "sequences per micro-batch and process")
    gradient_accumulation_steps: PositiveInt = option(1, "micro-batches per optimizer step")
    max_steps: PositiveInt = option(300, "optimizer steps (the time limit may stop earlier)")
    max_minutes: PositiveFloat = option(2.5, "stop training after this many minutes")
    learning_rate: PositiveFloat | None = option(5e-3, "peak AdamW learning rate (cosine schedule)")
    warmup_steps: NonNegativeInt = option(20, "linear warm-up steps before the cosine decay")
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
    fsdp: bool = option(
        False,
        "shard weights, gradients and optimizer state over the processes with FSDP2, one unit per decoder layer "
        "(launch with torchrun or accelerate launch; Accelerate enables FSDP on GPUs and other accelerators, CPU "
        "processes train with DDP instead)",
    )
    fsdp_config: FsdpConfigPath | None = option(
        None,
        "a JSON file of Transformers fsdp_config settings (e.g. reshard_after_forward, cpu_offload, "
        "activation_checkpointing, state_dict_type); version 2 only; implies --fsdp",
    )

    @property
    def uses_fsdp(self) -> bool:
        """--fsdp or --fsdp-config."""
        return self.fsdp or self.fsdp_config is not None

    @property
    def train_samples(self) -> int:
        """Training sequences the run draws: max_steps x batch_size x gradient_accumulation_steps."""
        return self.max_steps * self.batch_size * self.gradient_accumulation_steps

    def check_run(self) -> None:
        """`UsageError` naming the flags when the requested samples (--max-steps x --batch-size x
        --gradient-accumulation-steps) do not fit a 64-bit count (the dataset's length)."""
        if self.train_samples > MAX_TRAIN_SAMPLES:
            raise UsageError(
                f"--max-steps {self.max_steps} x --batch-size {self.batch_size} x --gradient-accumulation-steps "
                f"{self.gradient_accumulation_steps} = {self.train_samples:.3g} training sequences, more than "
                f"{MAX_TRAIN_SAMPLES:.3g}: lower --max-steps (--max-minutes limits the time anyway)"
            )

    def training_arguments(self, trainer_dir: str | os.PathLike, **settings: Any) -> RelationalTrainingArguments:
        """The one place where the command's options become Trainer settings: `RelationalTrainingArguments` with the
        batch size, accumulation, steps, peak learning rate (cosine schedule, linear warm-up), weight decay, seed,
        logging and checkpoint intervals, projection and suppression of these options, one kept trainer
        checkpoint in `trainer_dir` (rotated by `CheckpointRotation` in `run_training`, not by the Trainer), no
        reporting integration, the CPU where there is no GPU, and with --fsdp
        `fsdp=True` and `fsdp_config` version 2 (updated from --fsdp-config; the sharding units are the model's
        `_no_split_modules`, its decoder layers). `settings` adds or overrides TrainingArguments fields."""
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
            "save_total_limit": None,  # one kept, rotated by `CheckpointRotation` (keeps the user's files)
            "report_to": [],
            # the divergence guard reads the logged losses: the step-1 loss is its reference, and a NaN loss must be
            # logged as NaN (the Trainer's filter would replace it by the running mean)
            "logging_first_step": True,
            "logging_nan_inf_filter": False,
            "dataloader_num_workers": 0,
            # the windows of RandomBlockDataset are random already; a shuffled sampler would hold a permutation of
            # every requested sample (memory growing with --max-steps)
            "train_sampling_strategy": "sequential",
            "use_cpu": not torch.cuda.is_available(),
            "symmetry_projection": self.projection,
            "parallel_suppression_coef": self.parallel_suppression,
            "parallel_suppression_site": self.parallel_suppression_site,
        }
        if self.uses_fsdp:
            extra = {} if self.fsdp_config is None else FsdpConfigFile().read(self.fsdp_config)
            values["fsdp"] = True
            values["fsdp_config"] = {"version": 2, **extra}
        return RelationalTrainingArguments(**values | settings)


#: a logged training loss this many nats above the step-1 loss means the run diverged (the loss of a healthy run
#: falls; an average over a logging interval this far above the start holds a blow-up)
LOSS_RISE_LIMIT = 1.0


class DivergenceGuard(TrainerCallback):
    """Watches the logged training losses (`logging_first_step`, NaN logged as NaN: `training_arguments`): a
    non-finite loss, or a loss more than `LOSS_RISE_LIMIT` nats above the step-1 loss, stops training at once, without
    a trainer checkpoint at that step, and is kept in `reason` for `check_trained`."""

    def __init__(self) -> None:
        self.first: tuple[int, float] | None = None
        self.reason: str | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is None or self.reason is not None:
            return control
        step = state.global_step
        if not math.isfinite(loss):
            self.reason = f"the training loss became {loss} at step {step}"
        elif self.first is None:
            self.first = (step, loss)
        elif loss > self.first[1] + LOSS_RISE_LIMIT:
            self.reason = (
                f"the training loss rose from {self.first[1]:.3f} at step {self.first[0]} to {loss:.3f} at step {step}"
            )
        if self.reason is not None:
            control.should_training_stop = True
            control.should_save = False  # no trainer checkpoint of a diverged model
        return control


@torch.no_grad()
def collapsed_output(model: torch.nn.Module, blocks: torch.Tensor) -> bool:
    """True when the model gives every token the same logit at every position of the first validation block: its
    output collapsed to the uniform distribution (what a blown-up residual stream does once the final norm divides
    by an infinite RMS), which no trained or freshly initialised model does."""
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=blocks[:1].to(device), use_cache=False).logits.float()
    finally:
        model.train(was_training)
    spread = logits.amax(dim=-1) - logits.amin(dim=-1)
    return bool(torch.isfinite(spread).all() and (spread == 0).all())


def check_trained(
    model: torch.nn.Module,
    perplexity: float,
    blocks: torch.Tensor,
    guard: DivergenceGuard,
    args: RunArguments,
    what: str,
    trainer_dir: Path,
    start_step: int,
) -> None:
    """`RuntimeError` when the run diverged: a non-finite validation perplexity, a non-finite weight, a training loss
    that became non-finite or rose far above its start (`DivergenceGuard`), or an output collapsed to uniform
    (`collapsed_output`). Nothing of the run is kept: its trainer checkpoints (those after `start_step`, the step it
    started or resumed from) are removed and the previous run's set-aside checkpoints restored
    (`discard_run_checkpoints`); the model was not saved yet, so the output folder keeps its previous content."""
    reason = guard.reason
    if reason is None and not math.isfinite(perplexity):
        reason = f"validation perplexity {perplexity}"
    if reason is None:
        bad = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
        reason = None if bad is None else f"the weight {bad} holds NaN or infinite values"
    if reason is None and collapsed_output(model, blocks):
        reason = "the model gives every token the same probability (its output collapsed to uniform)"
    if reason is not None:
        if is_main_process():
            from ..outputs import discard_run_checkpoints

            discard_run_checkpoints(trainer_dir, start_step)
        raise RuntimeError(
            f"{what} diverged ({reason}); nothing was saved and {args.output_dir} keeps its previous content: "
            f"lower --learning-rate (now {args.learning_rate:g})"
        )


def start_step(resume_from: str | None) -> int:
    """The optimizer step a run starts from: 0, or the step of the trainer checkpoint it resumes (`checkpoint-N`)."""
    if resume_from is None:
        return 0
    name = Path(resume_from).name
    return int(name.rsplit("-", 1)[1]) if name.startswith("checkpoint-") else 0


class CheckpointRotation(TrainerCallback):
    """After each trainer checkpoint save (on the main process): record the new checkpoint's files and remove the
    older checkpoints' (`relational_hf.outputs.rotate_checkpoints`), keeping what the user put in them; the
    Trainer's own rotation would delete the folders whole."""

    def on_save(self, args, state, control, **kwargs):
        from ..outputs.trainer_state import rotate_checkpoints

        if state.is_world_process_zero:
            rotate_checkpoints(args.output_dir, keep=1)


def run_training(trainer, resume_from: str | None, trainer_dir: Path, args: RunArguments) -> None:
    """`trainer.train(resume_from_checkpoint=resume_from)` with `CheckpointRotation` (added last: after the
    trainer's own savers), and a full disk while the Trainer writes a checkpoint into `trainer_dir` reported in one
    line ("no space left on device"): the checkpoint it left half-written (which no --resume could use) is removed
    (its files: nothing of the user's), and the output folder keeps its previous model."""
    from ..outputs import DiskFullError, checkpoint_is_complete, reporting_disk_full
    from ..outputs.trainer_state import remove_checkpoint

    trainer.add_callback(CheckpointRotation())
    try:
        with reporting_disk_full(trainer_dir, f"{args.output_dir} keeps its previous model"):
            trainer.train(resume_from_checkpoint=resume_from)
    except DiskFullError:
        for folder in trainer_dir.glob("checkpoint-*") if trainer_dir.is_dir() else ():
            if folder.is_dir() and not checkpoint_is_complete(folder):
                remove_checkpoint(folder)
        raise


def time_limit_note(command: str, steps: int, max_steps: int, output_dir: str) -> str:
    """What the summary of a run that --max-minutes cut says: how many steps ran of how many, that the model is
    undertrained, and how to run the rest (--resume continues from the trainer checkpoint written at the cut)."""
    return (
        f"stopped by the time limit (--max-minutes) after {steps:,} of {max_steps:,} steps: the model is undertrained "
        f"(its learning-rate schedule is set for {max_steps:,} steps). To run the remaining {max_steps - steps:,} "
        f"steps, rerun the same `relational-hf {command}` command with --resume: it continues from the trainer "
        f"checkpoint saved at the cut ({output_dir}/trainer_state) with a new --max-minutes budget."
    )


def check_fsdp(args: RunArguments) -> None:
    """`UsageError` for --fsdp / --fsdp-config in a single process (FSDP shards over the processes that torchrun or
    accelerate launch start)."""
    if args.uses_fsdp and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        flag = "--fsdp" if args.fsdp else "--fsdp-config"
        raise UsageError(
            f"{flag} shards the model over several processes: launch with torchrun --nproc_per_node N or "
            "accelerate launch --num_processes N"
        )


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
    from ..outputs import OutputLock, normalise_output_dir, prepare_output_dir, unclaimed_on_failure

    out = normalise_output_dir(args.output_dir)
    if not is_main_process():
        yield out
        return
    with OutputLock(out), unclaimed_on_failure(out):
        yield prepare_output_dir(out, overwrite=args.overwrite, resume=args.resume, command=command, kind=kind)


__all__ = [
    "DataArguments",
    "DivergenceGuard",
    "FsdpConfigFile",
    "RunArguments",
    "check_blocks",
    "check_fsdp",
    "CheckpointRotation",
    "check_trained",
    "claimed_output",
    "collapsed_output",
    "is_main_process",
    "run_training",
    "start_step",
    "time_limit_note",
]
