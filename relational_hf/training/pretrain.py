"""Train a small causal LM from scratch: the project's main job (`relational-hf train`).

With no arguments it trains a relational transformer on the built-in generated corpus with a byte-level
tokenizer for at most about 3 minutes on 2 CPU cores, prints validation perplexity next to the corpus's unigram
perplexity, saves a checkpoint and tokenizer that the Auto classes load, and prints a short sample.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments, set_seed

from ..modeling import RelationalConfig, RelationalForCausalLM
from .data import (
    RandomBlockDataset,
    byte_level_tokenizer,
    encode,
    lm_blocks,
    load_texts,
    train_bpe_tokenizer,
    unigram_perplexity,
)
from .metrics import perplexity

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "checkpoints/relational-default"


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `relational-hf train` and `training_scripts/pretrain.py`."""
    data = parser.add_argument_group("data")
    data.add_argument("--train-file", help="a UTF-8 text file to train on (last 10%% of lines validate)")
    data.add_argument("--dataset", help="a `datasets.load_dataset` name (needs network or a local dataset dir)")
    data.add_argument("--dataset-config", help="the dataset configuration name, e.g. wikitext-2-raw-v1")
    data.add_argument("--text-column", default="text", help="dataset column holding the text (default: text)")
    data.add_argument(
        "--tokenizer",
        choices=["byte", "bpe"],
        default="byte",
        help="byte: 256 byte tokens + 3 specials, no training; bpe: byte-level BPE trained on the train split",
    )
    data.add_argument("--bpe-vocab-size", type=int, default=4096, help="vocabulary size of the trained BPE tokenizer")
    model = parser.add_argument_group("model")
    model.add_argument(
        "--architecture",
        choices=["relational", "llama"],
        default="relational",
        help="relational-transformer, or Transformers' Llama of the same dimensions as a baseline",
    )
    model.add_argument("--hidden-size", type=int, default=128, help="residual width d")
    model.add_argument("--layers", type=int, default=4, help="decoder layers")
    model.add_argument("--heads", type=int, default=4, help="query heads")
    model.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: --heads")
    model.add_argument("--intermediate-size", type=int, default=None, help="SwiGLU width; default: 3 x hidden")
    model.add_argument("--qk-rank", type=int, default=None, help="rank of each QK form (relational); default: head_dim")
    model.add_argument("--gauge", choices=["pivot", "free"], default="pivot", help="relational parameterisation")
    model.add_argument(
        "--position-encoding",
        choices=["rope", "none"],
        default="rope",
        help="rotary positions on the QK coordinates, or none",
    )
    model.add_argument(
        "--value-parallel-removal",
        action="store_true",
        help="remove the value-space parallel component per head (hard parallel suppression)",
    )
    train = parser.add_argument_group("training")
    train.add_argument(
        "--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"where the model goes (default: {DEFAULT_OUTPUT_DIR})"
    )
    train.add_argument("--block-size", type=int, default=128, help="context length in tokens")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    train.add_argument("--max-steps", type=int, default=1000, help="optimizer steps (the time limit may stop earlier)")
    train.add_argument("--max-minutes", type=float, default=2.5, help="stop training after this many minutes")
    train.add_argument("--learning-rate", type=float, default=3e-3, help="peak AdamW learning rate (cosine schedule)")
    train.add_argument("--warmup-steps", type=int, default=30, help="linear warm-up steps")
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    train.add_argument("--seed", type=int, default=0, help="seed of initialisation, data order and sampling")
    train.add_argument("--save-steps", type=int, default=250, help="trainer checkpoint interval (for --resume)")
    train.add_argument(
        "--resume", action="store_true", help="continue from the last trainer checkpoint in --output-dir"
    )
    train.add_argument("--eval-blocks", type=int, default=64, help="validation blocks used for perplexity")
    train.add_argument("--sample-tokens", type=int, default=120, help="length of the printed sample")
    train.add_argument(
        "--projection",
        choices=["none", "update"],
        default="none",
        help="project optimizer updates onto the quotient (free-gauge or Llama models)",
    )
    train.add_argument(
        "--parallel-suppression", type=float, default=0.0, help="lambda of the soft parallel-suppression loss (0 = off)"
    )
    train.add_argument(
        "--parallel-suppression-site",
        choices=["residual", "value"],
        default="residual",
        help="where the suppression loss reads cos^2(y, z): residual updates vs the incoming hidden state, or each "
        "head's pre-W_O output vs its own value",
    )
    return parser


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
    """The newest trainer checkpoint under `trainer_dir` (for --resume); a clear error when there is none."""
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(str(trainer_dir)) if trainer_dir.is_dir() else None
    if found is None:
        raise FileNotFoundError(f"--resume: no trainer checkpoint under {trainer_dir}")
    return found


def build_model(args: argparse.Namespace, vocab_size: int, tokenizer) -> torch.nn.Module:
    """The model the flags describe (relational, or Transformers' Llama with the same dimensions)."""
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
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if args.architecture == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common))
    config = RelationalConfig(
        **common,
        qk_rank=args.qk_rank,
        gauge=args.gauge,
        position_encoding=args.position_encoding,
        value_parallel_removal=args.value_parallel_removal,
    )
    return RelationalForCausalLM(config)


def save_atomically(model, tokenizer, output_dir: str | os.PathLike) -> None:
    """Write model + tokenizer to a temporary sibling folder, then swap it in: a crash never leaves a half-written
    checkpoint where a good one was."""
    out = Path(output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        from ..loading import save_tokenizer  # a tokenizer_config every Transformers version loads

        save_tokenizer(tokenizer, tmp)
        keep = out / "trainer_state"
        if keep.is_dir():  # carry the resumable trainer checkpoints over
            shutil.move(str(keep), tmp / "trainer_state")
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_train(args: argparse.Namespace) -> TrainResult:
    """Train, evaluate, save and sample as the flags say; returns the measured figures."""
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
    vocab_size = len(tokenizer)
    model = build_model(args, vocab_size, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("corpus: %s; %d train / %d validation tokens", source, train_ids.numel(), val_ids.numel())

    trainer_dir = Path(args.output_dir) / "trainer_state"
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
    trainer.train(resume_from_checkpoint=last_checkpoint(trainer_dir) if args.resume else None)

    val_blocks = lm_blocks(val_ids, args.block_size)[: args.eval_blocks]
    val_ppl = perplexity(model, val_blocks)
    uni_ppl = unigram_perplexity(train_ids, val_ids, vocab_size)
    if trainer.is_world_process_zero():  # under torchrun every rank holds the same model; one writes it
        save_atomically(model, tokenizer, args.output_dir)
    sample = generate_sample(model, tokenizer, val_text, args.sample_tokens, args.seed)
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
            "sample:",
            "  " + result.sample.replace("\n", "\n  "),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = add_train_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    result = run_train(args)
    print(format_result(result, args.architecture))
    return 0
