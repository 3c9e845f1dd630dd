"""Fine-tune a causal LM checkpoint, fully or with LoRA, optionally with projected updates and parallel suppression.

Works on relational checkpoints (either gauge; LoRA reaches the gauge-fixed k_proj/v_proj/up_proj through
`peft_support`) and on any causal LM an architecture adapter knows (Llama, Mistral, Qwen2/3, GPT-2). Prints validation
perplexity before and after, the total and trainable parameter counts, and saves the result: the full model (and
tokenizer), or the LoRA adapter (plus, with --merge, the merged model in OUTPUT_DIR/merged).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, set_seed

from ..loading import add_model_source_arguments, load_model, load_tokenizer
from .arguments import PROJECTIONS, SUPPRESSION_SITES, RelationalTrainingArguments
from .data import RandomBlockDataset, byte_level_tokenizer, encode, lm_blocks, load_texts
from .metrics import perplexity
from .pretrain import TimeLimitCallback, last_checkpoint, save_atomically
from .trainer import RelationalTrainer

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "checkpoints/finetuned"


def add_finetune_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `relational-hf finetune` and `training_scripts/finetune.py`."""
    parser.add_argument("model", help="checkpoint to start from: a local directory or a Hub id (causal LM)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory or Hub id (default: the checkpoint's own); 'byte' for the project's byte-level "
        "tokenizer (checkpoints trained by `relational-hf train` with the default tokenizer)",
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow checkpoints whose modeling code lives in the repo"
    )
    data = parser.add_argument_group("data")
    data.add_argument("--train-file", help="a UTF-8 text file to train on (last 10%% of lines validate)")
    data.add_argument("--dataset", help="a `datasets.load_dataset` name (needs network or a local dataset dir)")
    data.add_argument("--dataset-config", help="the dataset configuration name, e.g. wikitext-2-raw-v1")
    data.add_argument("--text-column", default="text", help="dataset column holding the text (default: %(default)s)")
    method = parser.add_argument_group("method")
    method.add_argument(
        "--method",
        choices=["full", "lora"],
        default="full",
        help="full: every weight trains; lora: PEFT LoRA adapters on --lora-targets, base weights frozen",
    )
    method.add_argument("--lora-r", type=int, default=8, help="LoRA rank r (default: %(default)s)")
    method.add_argument(
        "--lora-alpha",
        type=float,
        default=16.0,
        help="LoRA alpha; the update is scaled by alpha / r (default: %(default)s)",
    )
    method.add_argument(
        "--lora-dropout", type=float, default=0.0, help="dropout on the LoRA input (default: %(default)s)"
    )
    method.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated module names to adapt (default: q,k,v,o,gate,up,down_proj where the model has them, "
        "else all linear layers)",
    )
    method.add_argument(
        "--merge",
        action="store_true",
        help="with --method lora: also save the merged model (back in the pivot gauge) to OUTPUT_DIR/merged",
    )
    method.add_argument(
        "--projection",
        choices=list(PROJECTIONS),
        default="none",
        help="update: project every optimizer update onto the horizontal space, no motion along symmetry orbits "
        "(full fine-tuning only; default: %(default)s)",
    )
    method.add_argument(
        "--parallel-suppression",
        type=float,
        default=0.0,
        help="lambda of the soft parallel-suppression term lambda * mean cos^2(y, z) (default: %(default)s = off)",
    )
    method.add_argument(
        "--parallel-suppression-site",
        choices=list(SUPPRESSION_SITES),
        default="residual",
        help="residual: attention/MLP outputs vs the hidden state; value: per-head output vs own value "
        "(default: %(default)s)",
    )
    train = parser.add_argument_group("training")
    train.add_argument(
        "--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"where results go (default: {DEFAULT_OUTPUT_DIR})"
    )
    train.add_argument("--block-size", type=int, default=128, help="context length in tokens (default: %(default)s)")
    train.add_argument(
        "--batch-size", type=int, default=8, help="sequences per micro-batch and process (default: %(default)s)"
    )
    train.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="micro-batches per optimizer step (default: %(default)s)",
    )
    train.add_argument(
        "--max-steps",
        type=int,
        default=200,
        help="optimizer steps; the time limit may stop earlier (default: %(default)s)",
    )
    train.add_argument(
        "--max-minutes", type=float, default=10.0, help="stop training after this many minutes (default: %(default)s)"
    )
    train.add_argument("--learning-rate", type=float, default=None, help="peak LR (default: 1e-3 LoRA, 3e-4 full)")
    train.add_argument(
        "--warmup-steps",
        type=int,
        default=10,
        help="linear warm-up steps before the cosine decay (default: %(default)s)",
    )
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    train.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of LoRA initialisation, data sampling and order (default: %(default)s)",
    )
    train.add_argument(
        "--logging-steps",
        type=int,
        default=10,
        help="log loss and the relational metrics every N steps (default: %(default)s)",
    )
    train.add_argument(
        "--save-steps", type=int, default=100, help="trainer checkpoint interval, for --resume (default: %(default)s)"
    )
    train.add_argument(
        "--resume", action="store_true", help="continue from the last trainer checkpoint in OUTPUT_DIR/trainer_state"
    )
    train.add_argument(
        "--eval-blocks", type=int, default=32, help="validation blocks used for perplexity (default: %(default)s)"
    )
    train.add_argument(
        "--report-to", default="none", help="Trainer logging integrations, e.g. tensorboard (default: none)"
    )
    add_model_source_arguments(parser)
    return parser


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


def _load_tokenizer(args: argparse.Namespace):
    if args.tokenizer == "byte":
        return byte_level_tokenizer()
    source = args.tokenizer or args.model
    try:
        if args.tokenizer is None:
            return load_tokenizer(args)
        return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"could not load a tokenizer from {source!r} ({err}); pass --tokenizer PATH, or --tokenizer byte for "
            "checkpoints trained with the byte-level tokenizer"
        ) from None


def lora_targets(model: torch.nn.Module, requested: str | None) -> list[str] | str:
    """The LoRA target module names: `requested` (comma-separated), else the standard projection names the model
    has (`peft_support.RELATIONAL_LORA_TARGETS`), else PEFT's "all-linear"."""
    from .peft_support import RELATIONAL_LORA_TARGETS

    if requested:
        return [name.strip() for name in requested.split(",") if name.strip()]
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    found = [name for name in RELATIONAL_LORA_TARGETS if name in present]
    return found or "all-linear"


def run_finetune(args: argparse.Namespace) -> FinetuneResult:
    """Fine-tune as the flags say; returns the measured figures (see the module docstring)."""
    if args.method == "lora" and args.projection != "none":
        raise ValueError("--projection update acts on full weights; use it with --method full")
    if args.merge and args.method != "lora":
        raise ValueError("--merge applies to --method lora")
    set_seed(args.seed)
    started = time.monotonic()
    tokenizer = _load_tokenizer(args)
    model = load_model(args)
    train_text, val_text, source = load_texts(args.train_file, args.dataset, args.dataset_config, args.text_column)
    train_ids, val_ids = encode(tokenizer, train_text), encode(tokenizer, val_text)
    if int(max(train_ids.max(), val_ids.max())) >= model.config.vocab_size:
        raise ValueError(
            f"the tokenizer produces ids up to {int(max(train_ids.max(), val_ids.max()))} but the model's vocabulary "
            f"has {model.config.vocab_size} entries: pass the tokenizer the checkpoint was trained with"
        )
    logger.info("corpus: %s; %d train / %d validation tokens", source, train_ids.numel(), val_ids.numel())
    val_blocks = lm_blocks(val_ids, args.block_size)[: args.eval_blocks]
    ppl_before = perplexity(model, val_blocks, progress=True)

    if args.method == "lora":
        from peft import get_peft_model

        from .peft_support import relational_lora_config

        config = relational_lora_config(
            target_modules=lora_targets(model, args.lora_targets),
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
        )
        model = get_peft_model(model, config)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    output_dir = Path(args.output_dir)
    trainer_dir = output_dir / "trainer_state"
    learning_rate = args.learning_rate or (1e-3 if args.method == "lora" else 3e-4)
    samples = args.max_steps * args.batch_size * args.gradient_accumulation_steps
    training_args = RelationalTrainingArguments(
        output_dir=str(trainer_dir),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        save_total_limit=1,
        report_to=[] if args.report_to in ("none", "") else args.report_to.split(","),
        seed=args.seed,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        symmetry_projection=args.projection,
        parallel_suppression_coef=args.parallel_suppression,
        parallel_suppression_site=args.parallel_suppression_site,
    )
    trainer = RelationalTrainer(
        model=model,
        args=training_args,
        train_dataset=RandomBlockDataset(train_ids, args.block_size, samples, seed=args.seed),
        callbacks=[TimeLimitCallback(args.max_minutes * 60.0 - (time.monotonic() - started))],
    )
    trainer.train(resume_from_checkpoint=last_checkpoint(trainer_dir) if args.resume else None)
    ppl_after = perplexity(model, val_blocks, progress=True)

    merged_dir = str(output_dir / "merged") if args.merge else None
    main_process = trainer.is_world_process_zero()
    if main_process:  # under torchrun / accelerate launch one process writes
        if args.method == "lora":
            output_dir.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(output_dir)
            tokenizer.save_pretrained(output_dir)
            if args.merge:
                from .peft_support import merge_and_unload

                save_atomically(merge_and_unload(model), tokenizer, merged_dir)
        else:
            save_atomically(model, tokenizer, output_dir)
    trainer.accelerator.wait_for_everyone()
    return FinetuneResult(
        str(output_dir),
        args.method,
        n_params,
        n_trainable,
        ppl_before,
        ppl_after,
        trainer.state.global_step,
        time.monotonic() - started,
        merged_dir,
        main_process,
    )


def format_finetune_result(result: FinetuneResult) -> str:
    """The short human summary of a fine-tuning run."""
    share = 100.0 * result.trainable_parameters / max(1, result.parameters)
    gain = math.log(result.perplexity_before / result.perplexity_after)
    lines = [
        f"method: {result.method}; {result.steps} steps in {result.seconds:.0f} s",
        f"parameters: {result.parameters:,} total, {result.trainable_parameters:,} trainable ({share:.2f}%)",
        f"validation perplexity: {result.perplexity_before:.3f} -> {result.perplexity_after:.3f} "
        f"({gain:+.3f} nats/token)",
        f"saved to {result.output_dir}" + (" (LoRA adapter)" if result.method == "lora" else ""),
    ]
    if result.merged_dir:
        lines.append(f"merged model saved to {result.merged_dir}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = add_finetune_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = run_finetune(args)
    if result.main_process:
        print(format_finetune_result(result))
    return 0
