"""Fine-tune a causal LM checkpoint, fully or with LoRA, optionally with projected updates and parallel suppression.

    relational-hf finetune MODEL [--train-file FILE | --dataset NAME] [--method full|lora] [--projection update] ...

Works on relational checkpoints (either gauge; LoRA reaches the gauge-fixed k_proj/v_proj/up_proj through
`relational_hf.training.peft_support`) and on any causal LM an architecture adapter knows (Llama, Mistral, Qwen2/3,
GPT-2). Prints validation perplexity before and after, the total and trainable parameter counts, and saves the
result: the full model (and tokenizer), or the LoRA adapter (plus, with --merge, the merged model in
OUTPUT_DIR/merged), as `relational_hf.outputs` describes: checked before any work, locked, staged and swapped in.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
from transformers import set_seed

from ..errors import UsageError
from .checks import check_model_argument
from .options import (
    CommandArguments,
    LoadDtypeOptions,
    ModelSourceOptions,
    NonEmptyStr,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    fraction_closed_open,
    option,
    positional,
    with_default,
)
from .runs import (
    DataArguments,
    DivergenceGuard,
    RunArguments,
    check_blocks,
    check_fsdp,
    check_trained,
    claimed_output,
    run_training,
    start_step,
    time_limit_note,
)

logger = logging.getLogger(__name__)

HELP = "fine-tune a checkpoint (full or LoRA) with projection / parallel suppression"
DEFAULT_OUTPUT_DIR = "checkpoints/finetuned"


@dataclass
class FinetunePaths:
    model: str = positional("checkpoint to start from: a local directory, a Hub id or a GGUF file (causal LM)", "MODEL")


@dataclass
class TokenizerOptions:
    _argument_group_name = "model source"

    tokenizer: str | None = option(
        None,
        "tokenizer directory or Hub id, or 'byte' for the project's byte-level tokenizer (checkpoints trained by "
        "`relational-hf train` with the default tokenizer); unset: the checkpoint's own",
    )


@dataclass
class MethodArguments:
    """Full fine-tuning or PEFT LoRA, and the LoRA settings (defaults filled by `check`)."""

    _argument_group_name = "method"

    method: Literal["full", "lora"] = option(
        "full", "full: every weight trains; lora: PEFT LoRA adapters on --lora-targets, base weights frozen"
    )
    lora_r: PositiveInt | None = option(None, "LoRA rank r; unset: 8")
    lora_alpha: PositiveFloat | None = option(None, "LoRA alpha > 0; the update is scaled by alpha / r; unset: 16")
    lora_dropout: Annotated[float, fraction_closed_open] | None = option(
        None, "dropout on the LoRA input, in [0, 1); unset: 0"
    )
    lora_targets: NonEmptyStr | None = option(
        None,
        "comma-separated module names to adapt; unset: q,k,v,o,gate,up,down_proj where the model has them, else all "
        "linear layers",
    )
    merge: bool = option(
        False, "with --method lora: also save the merged model (back in the pivot gauge) to OUTPUT_DIR/merged"
    )


@dataclass
class FinetuneRunArguments(RunArguments):
    """The training run of `finetune`: `RunArguments` with fine-tuning defaults, and the reporting integrations."""

    output_dir: str = with_default(RunArguments, "output_dir", DEFAULT_OUTPUT_DIR)
    batch_size: PositiveInt = with_default(RunArguments, "batch_size", 8)
    max_steps: PositiveInt = with_default(RunArguments, "max_steps", 200)
    max_minutes: PositiveFloat = with_default(RunArguments, "max_minutes", 10.0)
    learning_rate: PositiveFloat | None = with_default(
        RunArguments, "learning_rate", None, "peak AdamW learning rate (cosine schedule); unset: 1e-3 LoRA, 3e-4 full"
    )
    warmup_steps: NonNegativeInt = with_default(RunArguments, "warmup_steps", 10)
    logging_steps: PositiveInt = with_default(RunArguments, "logging_steps", 10)
    save_steps: PositiveInt = with_default(RunArguments, "save_steps", 100)
    eval_blocks: PositiveInt = with_default(RunArguments, "eval_blocks", 32)
    report_to: str = option("none", "Trainer logging integrations, comma-separated, e.g. tensorboard; none or all")


@dataclass
class FinetuneArguments(
    CommandArguments,
    FinetuneRunArguments,
    MethodArguments,
    DataArguments,
    LoadDtypeOptions,
    ModelSourceOptions,
    TokenizerOptions,
    FinetunePaths,
):
    """Every option of `relational-hf finetune` and `training_scripts/finetune.py` in one checked instance;
    `check` tests the combinations."""

    POSITIONALS = FinetunePaths
    PARSER_GROUPS = (
        DataArguments,
        MethodArguments,
        FinetuneRunArguments,
        TokenizerOptions,
        ModelSourceOptions,
        LoadDtypeOptions,
    )


@dataclass
class FinetuneResult:
    output_dir: str
    method: str
    parameters: int
    trainable_parameters: int
    perplexity_before: float
    perplexity_after: float
    steps: int
    seconds: float
    merged_dir: str | None = None
    main_process: bool = True
    max_steps: int = 0  # the steps asked for
    time_limited: bool = False  # --max-minutes stopped the run before max_steps


def _load_tokenizer(args: FinetuneArguments):
    from transformers import AutoTokenizer

    from ..lm.data import byte_level_tokenizer
    from ..loading import load_tokenizer_from, resolve_model_source, usable_tokenizer

    if args.tokenizer == "byte":
        return byte_level_tokenizer()
    source = args.tokenizer or args.model
    try:
        if args.tokenizer is None:
            return load_tokenizer_from(
                resolve_model_source(args.model, args.gguf_file), trust_remote_code=args.trust_remote_code
            )
        return usable_tokenizer(AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code), source)
    except (OSError, ValueError) as err:
        raise UsageError(
            f"could not load a tokenizer from {source!r} ({err}); pass --tokenizer PATH, or --tokenizer byte for "
            "checkpoints trained with the byte-level tokenizer"
        ) from None


def lora_targets(model: torch.nn.Module, requested: str | None) -> list[str] | str:
    """The LoRA target module names: `requested` (comma-separated), else the standard projection names the model
    has (`peft_support.RELATIONAL_LORA_TARGETS`), else PEFT's "all-linear"."""
    from ..training.peft_support import RELATIONAL_LORA_TARGETS

    if requested:
        return [name.strip() for name in requested.split(",") if name.strip()]
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    found = [name for name in RELATIONAL_LORA_TARGETS if name in present]
    return found or "all-linear"


def check(args: FinetuneArguments) -> None:
    """Check the flag combinations of `finetune` before any model is loaded (each option's range was checked when
    `args` was built): `UsageError` naming the flag. Resolves the model and tokenizer sources (a missing local path
    is named as such) and fills the LoRA and learning-rate defaults."""
    args.model = check_model_argument(args.model, "MODEL", gguf_file=args.gguf_file)
    if args.tokenizer not in (None, "byte"):
        args.tokenizer = check_model_argument(args.tokenizer, "--tokenizer", model=False)
    args.check_data()
    args.check_run()
    lora_flags = {"--lora-r": args.lora_r, "--lora-alpha": args.lora_alpha, "--lora-dropout": args.lora_dropout}
    lora_flags["--lora-targets"] = args.lora_targets
    if args.method != "lora":
        given = [flag for flag, value in lora_flags.items() if value is not None]
        if given or args.merge:
            given += ["--merge"] * args.merge
            raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to --method lora")
    if args.method == "lora" and args.projection != "none":
        raise UsageError("--projection update acts on full weights; use it with --method full")
    check_fsdp(args)
    if args.method == "lora" and args.uses_fsdp:
        raise UsageError("--fsdp shards full fine-tuning (--method full); LoRA adapters are small: train them with DDP")
    if args.parallel_suppression_site != "residual" and args.parallel_suppression == 0:
        raise UsageError("--parallel-suppression-site needs --parallel-suppression > 0")
    if args.report_to not in ("none", "", "all"):
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

        unknown = [name for name in args.report_to.split(",") if name not in INTEGRATION_TO_CALLBACK]
        if unknown:
            raise UsageError(
                f"--report-to: unknown integration(s) {', '.join(unknown)}; known: none, all, "
                f"{', '.join(INTEGRATION_TO_CALLBACK)}"
            )
    args.lora_r = args.lora_r or 8
    args.lora_alpha = args.lora_alpha or 16.0
    args.lora_dropout = args.lora_dropout or 0.0
    args.learning_rate = args.learning_rate or (1e-3 if args.method == "lora" else 3e-4)
    from ..outputs import normalise_output_dir

    out = normalise_output_dir(args.output_dir)
    if os.path.isdir(args.model) and out == Path(os.path.realpath(args.model)):
        if args.method == "lora":
            raise UsageError(
                f"--output-dir {args.output_dir} is the model's own folder: LoRA adapter files beside its weights "
                "would make it unloadable; choose another directory"
            )
        if not args.overwrite:
            raise UsageError(
                f"--output-dir {args.output_dir} is the model's own folder: the fine-tuned weights would replace "
                "the base; choose another directory, or pass --overwrite"
            )


def check_weights_for_projection(model: torch.nn.Module, projection: str) -> None:
    """`--projection update` solves eigen-problems on the weights: fp16/bf16 weights are refused with a clear
    message (before any training) instead of failing inside `torch.linalg.eigh`."""
    if projection == "none":
        return
    low = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for p in model.parameters()
            if p.dtype not in (torch.float32, torch.float64)
        }
    )
    if low:
        raise UsageError(
            f"--projection update needs fp32 weights; the model's are {', '.join(low)} (save it in float32, or "
            "fine-tune without --projection)"
        )


def finetune(args: FinetuneArguments) -> FinetuneResult:
    """Fine-tune as the options say; returns the measured figures (see the module docstring). Every option, the
    output directory and the data are checked before training starts; the save never leaves a half-written
    directory."""
    check(args)
    with claimed_output(args, "finetune", args.method) as out:
        return _finetune(args, out)


def run(args: FinetuneArguments) -> int:
    result = finetune(args)
    if result.main_process:
        print(format_finetune_result(result))
    return 0


def _finetune(args: FinetuneArguments, output_dir: Path) -> FinetuneResult:
    from ..lm.data import RandomBlockDataset, encode, lm_blocks
    from ..lm.metrics import perplexity
    from ..loading import load_config_from, load_model_from, resolve_model_source, warn_beyond_context
    from ..outputs import TRAINER_DIR, complete_checkpoint, drop_set_aside_checkpoints, save_tokenizer, stage_and_swap
    from ..training.callbacks import TimeLimitCallback
    from ..training.fsdp import gathered_for_saving
    from ..training.trainer import RelationalTrainer

    set_seed(args.seed)
    started = time.monotonic()
    train_text, val_text, corpus = args.load("finetune")
    tokenizer = _load_tokenizer(args)
    train_ids, val_ids = encode(tokenizer, train_text), encode(tokenizer, val_text)
    check_blocks(train_ids, args.block_size, f"the training text ({corpus})", extra=1)
    check_blocks(val_ids, args.block_size, f"the validation text (the last 10% of {corpus})")
    source = resolve_model_source(args.model, args.gguf_file)
    config = load_config_from(source, trust_remote_code=args.trust_remote_code)  # no weights yet
    warn_beyond_context(config, {"--block-size": args.block_size})
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size is not None and int(max(train_ids.max(), val_ids.max())) >= vocab_size:
        raise UsageError(
            f"the tokenizer produces ids up to {int(max(train_ids.max(), val_ids.max()))} but the model's vocabulary "
            f"has {vocab_size} entries: pass the tokenizer the checkpoint was trained with (--tokenizer)"
        )
    model = load_model_from(source, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    check_weights_for_projection(model, args.projection)
    logger.info("corpus: %s; %d train / %d validation tokens", corpus, train_ids.numel(), val_ids.numel())
    val_blocks = lm_blocks(val_ids, args.block_size)[: args.eval_blocks]
    ppl_before = perplexity(model, val_blocks, progress=True)

    if args.method == "lora":
        from peft import get_peft_model

        from ..training.peft_support import relational_lora_config

        config = relational_lora_config(
            target_modules=lora_targets(model, args.lora_targets),
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
        )
        try:
            model = get_peft_model(model, config)
        except ValueError as err:
            raise UsageError(f"--lora-targets: {err}") from None
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    trainer_dir = output_dir / TRAINER_DIR
    resume_from = complete_checkpoint(trainer_dir) if args.resume else None
    report_to = [] if args.report_to in ("none", "") else args.report_to.split(",")
    training_args = args.training_arguments(trainer_dir, report_to=report_to)
    time_limit, guard = TimeLimitCallback(args.max_minutes * 60.0 - (time.monotonic() - started)), DivergenceGuard()
    trainer = RelationalTrainer(
        model=model,
        args=training_args,
        train_dataset=RandomBlockDataset(train_ids, args.block_size, args.train_samples, seed=args.seed),
        callbacks=[time_limit, guard],
    )
    run_training(trainer, resume_from, trainer_dir, args)
    ppl_after = perplexity(model, val_blocks, progress=True)
    check_trained(model, ppl_after, val_blocks, guard, args, "fine-tuning", trainer_dir, start_step(resume_from))

    merged_dir = str(output_dir / "merged") if args.merge else None
    saved = gathered_for_saving(trainer, model)  # every process: under FSDP the shards are gathered to rank 0
    main_process = trainer.is_world_process_zero()
    if main_process:  # under torchrun / accelerate launch one process writes

        def write(folder: Path) -> None:
            saved.save_pretrained(folder)
            save_tokenizer(tokenizer, folder)
            if args.merge:
                from ..training.peft_support import merge_and_unload

                merge_and_unload(model).save_pretrained(folder / "merged")
                save_tokenizer(tokenizer, folder / "merged")

        stage_and_swap(output_dir, write, command="finetune", kind=args.method, overwrite=args.overwrite)
        drop_set_aside_checkpoints(trainer_dir)
    trainer.accelerator.wait_for_everyone()
    return FinetuneResult(
        str(args.output_dir),
        args.method,
        n_params,
        n_trainable,
        ppl_before,
        ppl_after,
        trainer.state.global_step,
        time.monotonic() - started,
        merged_dir,
        main_process,
        max_steps=args.max_steps,
        time_limited=time_limit.stopped_at is not None,
    )


def format_finetune_result(result: FinetuneResult) -> str:
    """The short human summary of a fine-tuning run."""
    share = 100.0 * result.trainable_parameters / max(1, result.parameters)
    change = math.log(result.perplexity_after / result.perplexity_before)  # of the mean loss: negative is better
    steps = f"{result.steps:,}" + (f" of {result.max_steps:,}" if result.max_steps else "")
    lines = [
        f"method: {result.method}; {steps} steps in {result.seconds:.0f} s",
        f"parameters: {result.parameters:,} total, {result.trainable_parameters:,} trainable ({share:.2f}%)",
        f"validation perplexity: {result.perplexity_before:.3f} -> {result.perplexity_after:.3f} "
        f"(loss {change:+.3f} nats/token)",
        f"saved to {result.output_dir}" + (" (LoRA adapter)" if result.method == "lora" else ""),
    ]
    if result.merged_dir:
        lines.append(f"merged model saved to {result.merged_dir}")
    if result.time_limited:
        lines.append(time_limit_note("finetune", result.steps, result.max_steps, result.output_dir))
    return "\n".join(lines)


Arguments = FinetuneArguments
LOG_LEVEL = "INFO"


def main(argv: list[str] | None = None) -> int:
    """`training_scripts/finetune.py`: the same command, parsed on its own."""
    from .main import run_command

    return run_command("finetune", argv)


if __name__ == "__main__":
    sys.exit(main())
