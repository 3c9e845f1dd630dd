"""Train a small causal LM from scratch: the project's main job (`relational-hf train`).

With no arguments it trains a relational transformer on the built-in generated corpus with a byte-level
tokenizer for at most about 3 minutes on 2 CPU cores, prints validation perplexity next to the corpus's unigram
perplexity, saves a checkpoint and tokenizer that the Auto classes load, and prints a short sample.
Every flag and the data are checked before training; the output directory is claimed, locked and written as
`relational_hf.outputs` describes (never a foreign non-empty folder without --overwrite, never a half-written one).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments, set_seed

from ..errors import UsageError
from ..lm.data import (
    RandomBlockDataset,
    byte_level_tokenizer,
    encode,
    lm_blocks,
    load_texts,
    train_bpe_tokenizer,
    unigram_perplexity,
)
from ..lm.metrics import perplexity
from ..loading import save_tokenizer
from ..modeling import RelationalConfig, RelationalForCausalLM
from ..outputs import (
    TRAINER_DIR,
    OutputLock,
    complete_checkpoint,
    drop_set_aside_checkpoints,
    normalise_output_dir,
    prepare_output_dir,
    remove_if_unused,
    stage_and_swap,
)
from ..validate import (
    check_dataset_source,
    int_at_least,
    nonempty_str,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    text_file,
)

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "checkpoints/relational-default"
MIN_BPE_VOCAB = 260
DEFAULT_BPE_VOCAB = 4096


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `relational-hf train` and `training_scripts/pretrain.py` (each checked when parsed; the
    combinations by `validate_train_args`)."""
    data = parser.add_argument_group("data")
    data.add_argument(
        "--train-file", type=text_file, help="a UTF-8 text file to train on (last 10%% of lines validate)"
    )
    data.add_argument(
        "--dataset", type=nonempty_str, help="a `datasets.load_dataset` name (needs network or a local dataset dir)"
    )
    data.add_argument("--dataset-config", help="the dataset configuration name, e.g. wikitext-2-raw-v1")
    data.add_argument(
        "--text-column", type=nonempty_str, default="text", help="dataset column holding the text (default: text)"
    )
    data.add_argument(
        "--tokenizer",
        choices=["byte", "bpe"],
        default="byte",
        help="byte: 256 byte tokens + 3 specials, no training; bpe: byte-level BPE trained on the train split",
    )
    data.add_argument(
        "--bpe-vocab-size",
        type=int_at_least(MIN_BPE_VOCAB),
        default=None,
        help=f"vocabulary size of the trained BPE tokenizer (>= {MIN_BPE_VOCAB}: 256 bytes + 3 specials + merges; "
        f"default: {DEFAULT_BPE_VOCAB})",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--architecture",
        choices=["relational", "llama"],
        default="relational",
        help="relational-transformer, or Transformers' Llama of the same dimensions as a baseline",
    )
    model.add_argument("--hidden-size", type=positive_int, default=128, help="residual width d")
    model.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    model.add_argument("--heads", type=positive_int, default=4, help="query heads (must divide --hidden-size)")
    model.add_argument(
        "--kv-heads",
        type=positive_int,
        default=None,
        help="key/value heads (GQA, must divide --heads); default: --heads",
    )
    model.add_argument("--intermediate-size", type=positive_int, default=None, help="SwiGLU width; default: 3 x hidden")
    model.add_argument(
        "--qk-rank", type=positive_int, default=None, help="rank of each QK form (relational only); default: head_dim"
    )
    model.add_argument(
        "--gauge", choices=["pivot", "free"], default=None, help="relational parameterisation (default: pivot)"
    )
    model.add_argument(
        "--position-encoding",
        choices=["rope", "none"],
        default=None,
        help="rotary positions on the QK coordinates, or none (relational only; default: rope)",
    )
    model.add_argument(
        "--value-parallel-removal",
        action="store_true",
        help="remove the value-space parallel component per head (hard parallel suppression; relational only)",
    )
    train = parser.add_argument_group("training")
    train.add_argument(
        "--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"where the model goes (default: {DEFAULT_OUTPUT_DIR})"
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="allow an --output-dir that is not empty and was not written by relational-hf (its checkpoint files "
        "are replaced, other files kept)",
    )
    train.add_argument("--block-size", type=int_at_least(2), default=128, help="context length in tokens (>= 2)")
    train.add_argument("--batch-size", type=positive_int, default=16, help="sequences per optimizer step")
    train.add_argument(
        "--max-steps", type=positive_int, default=1000, help="optimizer steps (the time limit may stop earlier)"
    )
    train.add_argument("--max-minutes", type=positive_float, default=2.5, help="stop training after this many minutes")
    train.add_argument(
        "--learning-rate", type=positive_float, default=3e-3, help="peak AdamW learning rate (cosine schedule)"
    )
    train.add_argument("--warmup-steps", type=nonnegative_int, default=30, help="linear warm-up steps")
    train.add_argument("--weight-decay", type=nonnegative_float, default=0.0, help="AdamW weight decay (>= 0)")
    train.add_argument(
        "--seed", type=nonnegative_int, default=0, help="seed of initialisation, data order and sampling"
    )
    train.add_argument(
        "--save-steps", type=positive_int, default=250, help="trainer checkpoint interval (for --resume)"
    )
    train.add_argument(
        "--resume", action="store_true", help="continue from the newest complete trainer checkpoint in --output-dir"
    )
    train.add_argument("--eval-blocks", type=positive_int, default=64, help="validation blocks used for perplexity")
    train.add_argument(
        "--sample-tokens", type=nonnegative_int, default=120, help="length of the printed sample (0: no sample)"
    )
    train.add_argument(
        "--projection",
        choices=["none", "update"],
        default="none",
        help="project optimizer updates onto the quotient (free-gauge or Llama models)",
    )
    train.add_argument(
        "--parallel-suppression",
        type=nonnegative_float,
        default=0.0,
        help="lambda of the soft parallel-suppression loss (>= 0; 0 = off)",
    )
    train.add_argument(
        "--parallel-suppression-site",
        choices=["residual", "value"],
        default="residual",
        help="where the suppression loss reads cos^2(y, z): residual updates vs the incoming hidden state, or each "
        "head's pre-W_O output vs its own value",
    )
    return parser


# config field -> the flag that sets it, for config errors reported at the command line
_CONFIG_FLAGS = {
    "vocab_size": "--bpe-vocab-size",
    "hidden_size": "--hidden-size",
    "intermediate_size": "--intermediate-size",
    "num_hidden_layers": "--layers",
    "num_attention_heads": "--heads",
    "num_key_value_heads": "--kv-heads",
    "head_dim": "head_dim (--hidden-size / --heads)",
    "qk_rank": "--qk-rank",
    "max_position_embeddings": "--block-size",
}


def validate_train_args(args: argparse.Namespace) -> None:
    """Check the flag combinations of `train` before any data is read or model built: `UsageError` naming the
    flags. Fills the relational defaults of --gauge and --position-encoding."""
    if args.train_file and args.dataset:
        raise UsageError("give either --train-file or --dataset, not both")
    if args.dataset_config and not args.dataset:
        raise UsageError("--dataset-config needs --dataset")
    check_dataset_source(args.dataset)
    if args.architecture == "llama":
        given = [
            flag
            for flag, value in (
                ("--qk-rank", args.qk_rank),
                ("--gauge", args.gauge),
                ("--position-encoding", args.position_encoding),
                ("--value-parallel-removal", args.value_parallel_removal or None),
            )
            if value is not None
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to --architecture relational "
                "(Llama ignores them)"
            )
    args.gauge = args.gauge or "pivot"
    args.position_encoding = args.position_encoding or "rope"
    if args.bpe_vocab_size is not None and args.tokenizer != "bpe":
        raise UsageError("--bpe-vocab-size applies only to --tokenizer bpe")
    args.bpe_vocab_size = args.bpe_vocab_size or DEFAULT_BPE_VOCAB
    if args.parallel_suppression_site != "residual" and args.parallel_suppression == 0:
        raise UsageError("--parallel-suppression-site needs --parallel-suppression > 0")
    if args.hidden_size % args.heads:
        raise UsageError(f"--heads {args.heads} must divide --hidden-size {args.hidden_size}")
    kv = args.kv_heads or args.heads
    if kv > args.heads or args.heads % kv:
        raise UsageError(f"--kv-heads {kv} must divide --heads {args.heads}")
    vocab = args.bpe_vocab_size if args.tokenizer == "bpe" else 259
    try:
        model_config(args, vocab, 0, 1, 2)
    except ValueError as err:
        message = str(err)
        for name, flag in _CONFIG_FLAGS.items():
            message = message.replace(f"`{name}`", flag)
        raise UsageError(f"model shape: {message}") from None


@dataclass
class TrainResult:
    output_dir: str
    parameters: int
    val_perplexity: float
    unigram_perplexity: float
    steps: int
    seconds: float
    sample: str


class TimeLimitCallback(TrainerCallback):
    """Stops training once the wall-clock budget is spent (the model is still evaluated and saved)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() - self.start > self.seconds:
            control.should_training_stop = True
        return control


def last_checkpoint(trainer_dir: Path) -> str:
    """The newest complete trainer checkpoint under `trainer_dir` (for --resume); `UsageError` when there is none
    (`relational_hf.outputs.complete_checkpoint`)."""
    return complete_checkpoint(trainer_dir)


def model_config(args: argparse.Namespace, vocab_size: int, pad: int, bos: int, eos: int):
    """The model configuration the flags describe (relational, or Transformers' Llama with the same dimensions)."""
    intermediate = args.intermediate_size or 3 * args.hidden_size
    common = dict(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.block_size, 256),
        tie_word_embeddings=True,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    if args.architecture == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    return RelationalConfig(
        **common,
        qk_rank=args.qk_rank,
        gauge=args.gauge or "pivot",
        position_encoding=args.position_encoding or "rope",
        value_parallel_removal=args.value_parallel_removal,
    )


def build_model(args: argparse.Namespace, vocab_size: int, tokenizer) -> torch.nn.Module:
    """The model the flags describe (relational, or Transformers' Llama with the same dimensions)."""
    config = model_config(args, vocab_size, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    if args.architecture == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(config)
    return RelationalForCausalLM(config)


def save_atomically(
    model, tokenizer, output_dir: str | os.PathLike, *, command: str = "train", kind: str = "full"
) -> None:
    """Save model + tokenizer with `relational_hf.outputs.stage_and_swap`: written beside, fsynced, swapped in;
    a crash at any point leaves a complete old or new checkpoint, and the trainer checkpoints and the user's
    other files in the folder are kept."""

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        save_tokenizer(tokenizer, folder)  # a tokenizer_config every Transformers version loads

    stage_and_swap(output_dir, write, command=command, kind=kind)


_RESUME_FIELDS = (*_CONFIG_FLAGS, "model_type", "gauge", "position_encoding", "value_parallel_removal")


def check_resume_config(config, checkpoint: Path) -> None:
    """`UsageError` when the model the flags describe differs from the one saved in the trainer checkpoint that
    --resume would continue (the weights would not fit), naming each differing setting and its flag."""
    try:
        saved = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a checkpoint without a readable config: the Trainer reports what it cannot load
    new = config.to_dict()
    differ = [
        f"{name} {saved[name]!r} (now {new.get(name)!r}; {_CONFIG_FLAGS.get(name, '--' + name.replace('_', '-'))})"
        for name in _RESUME_FIELDS
        if name in saved and saved[name] != new.get(name)
    ]
    if differ:
        raise UsageError(
            f"--resume: {checkpoint.name} was trained with {', '.join(differ)}; pass the model flags of that run"
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
def claimed_output(args: argparse.Namespace, command: str, kind: str) -> Iterator[Path]:
    """Check, lock and mark `args.output_dir` for the whole run (`relational_hf.outputs`); other ranks only check."""
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


def run_train(args: argparse.Namespace) -> TrainResult:
    """Train, evaluate, save and sample as the flags say; returns the measured figures. Every flag, the output
    directory and the data are checked before training starts."""
    validate_train_args(args)
    with claimed_output(args, "train", "full") as out:
        return _train(args, out)


def _train(args: argparse.Namespace, out: Path) -> TrainResult:
    from transformers import Trainer

    set_seed(args.seed)
    started = time.monotonic()
    train_text, val_text, source = load_texts(args.train_file, args.dataset, args.dataset_config, args.text_column)
    tokenizer = (
        byte_level_tokenizer()
        if args.tokenizer == "byte"
        else train_bpe_tokenizer(train_text.splitlines(), args.bpe_vocab_size)
    )
    train_ids, val_ids = encode(tokenizer, train_text), encode(tokenizer, val_text)
    check_blocks(train_ids, args.block_size, f"the training text ({source})", extra=1)
    check_blocks(val_ids, args.block_size, f"the validation text (the last 10% of {source})")
    val_blocks = lm_blocks(val_ids, args.block_size)[: args.eval_blocks]
    vocab_size = len(tokenizer)
    model = build_model(args, vocab_size, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("corpus: %s; %d train / %d validation tokens", source, train_ids.numel(), val_ids.numel())

    trainer_dir = out / TRAINER_DIR
    resume_from = complete_checkpoint(trainer_dir) if args.resume else None
    if resume_from is not None:
        check_resume_config(model.config, Path(resume_from))
    train_set = RandomBlockDataset(train_ids, args.block_size, args.max_steps * args.batch_size, seed=args.seed)
    training_args = TrainingArguments(
        output_dir=str(trainer_dir),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        adam_beta2=0.99,
        logging_steps=50,
        save_steps=args.save_steps,
        save_total_limit=1,
        report_to=[],
        seed=args.seed,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer_cls, extra = Trainer, {}
    if args.projection != "none" or args.parallel_suppression > 0:
        from . import RelationalTrainer, RelationalTrainingArguments

        training_args = RelationalTrainingArguments(
            **training_args.to_dict()
            | {
                "symmetry_projection": args.projection,
                "parallel_suppression_coef": args.parallel_suppression,
                "parallel_suppression_site": args.parallel_suppression_site,
            }
        )
        trainer_cls = RelationalTrainer
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=train_set,
        callbacks=[TimeLimitCallback(args.max_minutes * 60.0 - (time.monotonic() - started))],
        **extra,
    )
    trainer.train(resume_from_checkpoint=resume_from)

    val_ppl = perplexity(model, val_blocks)
    if not math.isfinite(val_ppl):
        raise RuntimeError(
            f"training diverged (validation perplexity {val_ppl}); the model was not saved and {args.output_dir} "
            "keeps its previous checkpoint: lower --learning-rate"
        )
    uni_ppl = unigram_perplexity(train_ids, val_ids, vocab_size)
    if trainer.is_world_process_zero():  # under torchrun every rank holds the same model; one writes it
        save_atomically(model, tokenizer, out, command="train", kind="full")
        drop_set_aside_checkpoints(trainer_dir)
    sample = generate_sample(model, tokenizer, val_text, args.sample_tokens, args.seed) if args.sample_tokens else ""
    return TrainResult(
        str(args.output_dir), n_params, val_ppl, uni_ppl, trainer.state.global_step, time.monotonic() - started, sample
    )


@torch.no_grad()
def generate_sample(model, tokenizer, prompt_source: str, max_new_tokens: int, seed: int) -> str:
    """A sampled continuation (temperature 0.8, top-k 20) of the first few words of `prompt_source`."""
    first_line = prompt_source.strip().splitlines()[0] if prompt_source.strip() else "the"
    prompt = " ".join(first_line.split()[:3]) or "the"
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
    torch.manual_seed(seed)
    model.eval()
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=0.8,
        top_k=20,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0], skip_special_tokens=True)


def format_result(result: TrainResult, model_name: str) -> str:
    """The short human summary the main job prints."""
    gain = math.log(result.unigram_perplexity / result.val_perplexity)
    return "\n".join(
        [
            f"model: {model_name}, {result.parameters:,} parameters; {result.steps} steps in {result.seconds:.0f} s",
            f"validation perplexity: {result.val_perplexity:.3f}   (unigram perplexity of the corpus: "
            f"{result.unigram_perplexity:.3f}; {gain:.2f} nats/token better)",
            f"saved to {result.output_dir} (AutoModelForCausalLM / AutoTokenizer.from_pretrained load it)",
        ]
        + (["sample:", "  " + result.sample.replace("\n", "\n  ")] if result.sample else [])
    )


def main(argv: list[str] | None = None) -> int:
    parser = add_train_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    try:
        result = run_train(args)
    except UsageError as err:  # one line naming the flag, as for the parser's own errors (exit 2)
        parser.error(str(err))
    print(format_result(result, args.architecture))
    return 0
