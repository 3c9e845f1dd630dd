"""Train a small causal LM from scratch: the project's main job.

    relational-hf train [--train-file FILE | --dataset NAME] [--architecture relational|llama] [--max-minutes M] ...

With no arguments it trains a relational transformer on the built-in generated corpus with a byte-level tokenizer
for at most about 3 minutes on 2 CPU cores, prints validation perplexity next to the corpus's unigram perplexity,
saves a checkpoint and tokenizer that the Auto classes load, and prints a short sample. Every flag and the data are
checked before training; the output directory is claimed, locked and written as `relational_hf.outputs` describes
(never a foreign non-empty folder without --overwrite, never a half-written one).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
from transformers import set_seed

from ..errors import UsageError
from ..modeling import RelationalConfig, RelationalForCausalLM
from .options import CommandArguments, NonNegativeInt, PositiveInt, int_at_least, option, option_flag, with_default
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

HELP = "train a relational LM (no arguments: built-in corpus, about 3 minutes on CPU)"

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "checkpoints/relational-default"
MIN_BPE_VOCAB = 260
DEFAULT_BPE_VOCAB = 4096


@dataclass
class TrainDataArguments(DataArguments):
    """The training text (`DataArguments`) and the tokenizer trained on it."""

    tokenizer: Literal["byte", "bpe"] = option(
        "byte", "byte: 256 byte tokens + 3 specials, no training; bpe: byte-level BPE trained on the train split"
    )
    bpe_vocab_size: Annotated[int, int_at_least(MIN_BPE_VOCAB)] | None = option(
        None,
        f"vocabulary size of the trained BPE tokenizer (>= {MIN_BPE_VOCAB}: 256 bytes + 3 specials + merges); "
        f"unset: {DEFAULT_BPE_VOCAB}",
    )


@dataclass
class ModelShapeArguments:
    """The model `train` builds (`model_config`)."""

    _argument_group_name = "model"

    architecture: Literal["relational", "llama"] = option(
        "relational", "relational-transformer, or Transformers' Llama of the same dimensions as a baseline"
    )
    hidden_size: PositiveInt = option(64, "residual width d")
    layers: PositiveInt = option(4, "decoder layers")
    heads: PositiveInt = option(4, "query heads (must divide --hidden-size)")
    kv_heads: PositiveInt | None = option(None, "key/value heads (GQA, must divide --heads); unset: --heads")
    intermediate_size: PositiveInt | None = option(None, "SwiGLU width; unset: 3 x --hidden-size")
    qk_rank: PositiveInt | None = option(None, "rank of each QK form (relational only); unset: head_dim")
    gauge: Literal["pivot", "free"] | None = option(None, "relational parameterisation; unset: pivot")
    position_encoding: Literal["rope", "none"] | None = option(
        None, "rotary positions on the QK coordinates, or none (relational only); unset: rope"
    )
    value_parallel_removal: bool = option(
        False, "remove the value-space parallel component per head (hard parallel suppression; relational only)"
    )


@dataclass
class TrainRunArguments(RunArguments):
    """The training run of `train` (`RunArguments` with its defaults) and the printed sample."""

    output_dir: str = with_default(RunArguments, "output_dir", DEFAULT_OUTPUT_DIR)
    sample_tokens: NonNegativeInt = option(120, "length of the printed sample (0: no sample)")


@dataclass
class TrainArguments(CommandArguments, TrainRunArguments, ModelShapeArguments, TrainDataArguments):
    """Every option of `relational-hf train` and `training_scripts/pretrain.py` in one checked instance; the
    command line shows them in the groups data, model and training. `check` tests the
    combinations."""

    PARSER_GROUPS = (TrainDataArguments, ModelShapeArguments, TrainRunArguments)


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


def check(args: TrainArguments) -> None:
    """Check the flag combinations of `train` before any data is read or model built (each option's range was
    checked when `args` was built): `UsageError` naming the flags. Fills the relational defaults of --gauge and
    --position-encoding."""
    args.check_data()
    args.check_run()
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
    check_fsdp(args)
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
    max_steps: int = 0  # the steps asked for
    time_limited: bool = False  # --max-minutes stopped the run before max_steps


def model_config(args: TrainArguments, vocab_size: int, pad: int, bos: int, eos: int):
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


def build_model(args: TrainArguments, vocab_size: int, tokenizer) -> torch.nn.Module:
    """The model the flags describe (relational, or Transformers' Llama with the same dimensions)."""
    config = model_config(args, vocab_size, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    if args.architecture == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(config)
    return RelationalForCausalLM(config)


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
        f"{name} {saved[name]!r} (now {new.get(name)!r}; {_CONFIG_FLAGS.get(name, option_flag(name))})"
        for name in _RESUME_FIELDS
        if name in saved and saved[name] != new.get(name)
    ]
    if differ:
        raise UsageError(
            f"--resume: {checkpoint.name} was trained with {', '.join(differ)}; pass the model flags of that run"
        )


def train(args: TrainArguments) -> TrainResult:
    """Train, evaluate, save and sample as the options say; returns the measured figures. Every option, the output
    directory and the data are checked before training starts."""
    check(args)
    with claimed_output(args, "train", "full") as out:
        return _train(args, out)


def run(args: TrainArguments) -> int:
    print(format_result(train(args), args.architecture))
    return 0


def _train(args: TrainArguments, out: Path) -> TrainResult:
    from transformers import Trainer

    from ..lm.data import (
        RandomBlockDataset,
        byte_level_tokenizer,
        encode,
        lm_blocks,
        train_bpe_tokenizer,
        unigram_perplexity,
    )
    from ..lm.metrics import perplexity
    from ..outputs import TRAINER_DIR, complete_checkpoint, drop_set_aside_checkpoints, save_checkpoint
    from ..training.callbacks import TimeLimitCallback
    from ..training.fsdp import gathered_for_saving

    set_seed(args.seed)
    started = time.monotonic()
    train_text, val_text, source = args.load("train")
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
    train_set = RandomBlockDataset(train_ids, args.block_size, args.train_samples, seed=args.seed)
    training_args = args.training_arguments(trainer_dir, adam_beta2=0.99)
    trainer_cls = Trainer
    if args.projection != "none" or args.parallel_suppression > 0 or args.uses_fsdp:
        from ..training import RelationalTrainer

        trainer_cls = RelationalTrainer
    time_limit, guard = TimeLimitCallback(args.max_minutes * 60.0 - (time.monotonic() - started)), DivergenceGuard()
    trainer = trainer_cls(model=model, args=training_args, train_dataset=train_set, callbacks=[time_limit, guard])
    run_training(trainer, resume_from, trainer_dir, args)

    val_ppl = perplexity(model, val_blocks)
    check_trained(model, val_ppl, val_blocks, guard, args, "training", trainer_dir, start_step(resume_from))
    uni_ppl = unigram_perplexity(train_ids, val_ids, vocab_size)
    saved = gathered_for_saving(trainer, model)  # every rank: under FSDP the shards are gathered to rank 0
    if trainer.is_world_process_zero():  # under torchrun every rank holds the same model; one writes it
        save_checkpoint(saved, tokenizer, out, command="train", kind="full", overwrite=args.overwrite)
        drop_set_aside_checkpoints(trainer_dir)
    sample = generate_sample(model, tokenizer, val_text, args.sample_tokens, args.seed) if args.sample_tokens else ""
    return TrainResult(
        str(args.output_dir),
        n_params,
        val_ppl,
        uni_ppl,
        trainer.state.global_step,
        time.monotonic() - started,
        sample,
        max_steps=args.max_steps,
        time_limited=time_limit.stopped_at is not None,
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
    steps = f"{result.steps:,}" + (f" of {result.max_steps:,}" if result.max_steps else "")
    return "\n".join(
        [
            f"model: {model_name}, {result.parameters:,} parameters; {steps} steps in {result.seconds:.0f} s",
            f"validation perplexity: {result.val_perplexity:.3f}   (unigram perplexity of the corpus: "
            f"{result.unigram_perplexity:.3f}; {abs(gain):.2f} nats/token {'better' if gain >= 0 else 'worse'})",
            f"saved to {result.output_dir} (AutoModelForCausalLM / AutoTokenizer.from_pretrained load it)",
        ]
        + ([time_limit_note("train", result.steps, result.max_steps, result.output_dir)] if result.time_limited else [])
        + (["sample:", "  " + result.sample.replace("\n", "\n  ")] if result.sample else [])
    )


Arguments = TrainArguments


def main(argv: list[str] | None = None) -> int:
    """`training_scripts/pretrain.py`: the same command, parsed on its own."""
    from .main import run_command

    return run_command("train", argv)


if __name__ == "__main__":
    sys.exit(main())
