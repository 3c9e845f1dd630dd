"""Convert a Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 / Phi-3 / Gemma 3 / GPT-2 / GPT-NeoX checkpoint into a
relational one: exact, or sliced (principal gauge).

    relational-hf convert SRC OUT [--slice F --calibration FILE] [--stream | --no-stream] [--dtype D]

Streaming (the default for a local safetensors folder without --slice): one layer at a time
(`relational_hf.convert.stream_to_relational`), each layer checked against its source. Otherwise SRC is loaded in
fp32 and converted by `to_relational`, verified on the held-out part of --calibration when given. OUT must be new or
empty; it is written beside and moved into place when complete (`relational_hf.outputs`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UsageError
from ..outputs import check_new_output, write_new_output
from .checks import check_model_argument, read_token_ids, text_or_ids
from .options import (
    CommandArguments,
    Fraction,
    Length,
    ModelSourceOptions,
    NonNegativeInt,
    OpenFraction,
    PositiveFloat,
    PositiveInt,
    StreamOptions,
    option,
    positional,
)

HELP = (
    "convert a Llama/Mistral/Qwen2/Qwen3/SmolLM3/Phi-3/Gemma 3/GPT-2/GPT-NeoX checkpoint into a relational one "
    "(exact, or sliced)"
)


@dataclass
class ConvertPaths:
    src: str = positional(
        "Hub id, local checkpoint or GGUF file of a Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 / Phi-3 / Gemma 3 / "
        "GPT-2 / GPT-NeoX causal LM",
        "SRC",
    )
    out: str = positional("output folder for the relational checkpoint (new or empty)", "OUT")


@dataclass
class ConvertOptions:
    _argument_group_name = "conversion"

    slice: Fraction = option(
        0.0, "fraction of residual directions to drop after the principal gauge (0: exact conversion)"
    )
    calibration: str | None = option(
        None,
        "calibration text (tokenised with SRC's tokenizer) or a .pt tensor of token ids; the last --eval-fraction "
        "of it is held out to report the perplexity change",
        metavar="FILE",
    )
    seq_len: Length = option(128, "calibration sequence length in tokens")
    calibration_samples: PositiveInt = option(64, "at most this many calibration sequences")
    eval_fraction: OpenFraction = option(0.2, "share of the calibration tokens held out")
    tolerance: PositiveFloat = option(
        1e-4,
        "max |logit difference| accepted, relative to the logit scale max(1, max |logit|) (fp32 check); streaming: "
        "the same on each layer's outputs",
    )
    verify_layers: NonNegativeInt | None = option(
        None, "streaming: check this many evenly spaced layers against the source layer (default: all; 0: none)"
    )


@dataclass
class ConvertArguments(CommandArguments, StreamOptions, ModelSourceOptions, ConvertOptions, ConvertPaths):
    POSITIONALS = ConvertPaths
    PARSER_GROUPS = (ConvertOptions, StreamOptions, ModelSourceOptions)


Arguments = ConvertArguments


def check(args: ConvertArguments) -> None:
    """SRC exists (or is a Hub id); OUT is new or empty and not SRC; --slice needs --calibration and the whole model."""
    args.src = check_model_argument(args.src, "SRC", gguf_file=args.gguf_file)
    check_new_output(args.out, "OUT", source=args.src)
    if args.calibration is not None:
        text_or_ids(args.calibration, "--calibration")
    if args.slice > 0 and args.calibration is None:
        raise UsageError("--slice needs --calibration FILE")
    if args.slice > 0 and args.streaming():
        raise UsageError("--slice needs calibration activations of the whole model: use --no-stream")


def _split(ids: torch.Tensor, seq_len: int, samples: int, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a token stream into (calibration, held-out) batches of seq_len tokens; held out = the last part."""
    n = ids.numel() // seq_len
    if n < 2:
        raise UsageError(f"--calibration: {ids.numel()} tokens are too few for two --seq-len {seq_len} sequences")
    chunks = ids[: n * seq_len].reshape(n, seq_len)
    n_eval = max(1, int(round(eval_fraction * n)))
    if n_eval >= n:
        raise UsageError(f"--eval-fraction {eval_fraction} leaves no calibration sequence of the {n} in the data")
    return chunks[: n - n_eval][:samples], chunks[n - n_eval :][:samples]


def run(args: ConvertArguments) -> int:
    """Check everything, then convert under the lock of OUT (a second run into the same OUT is refused at once)."""
    from ..outputs import OutputLock

    check(args)
    with OutputLock(args.out) as lock:
        return _run(args, lock)


def _run(args: ConvertArguments, lock) -> int:
    from ..convert import stream_to_relational, to_relational
    from ..loading import load_model_from, load_tokenizer_from, resolve_model_source
    from ..outputs import save_tokenizer
    from ..shards import is_safetensors_checkpoint, parse_dtype

    streamable = args.gguf_file is None and is_safetensors_checkpoint(args.src)
    stream = args.streaming() if args.streaming() is not None else (streamable and args.slice == 0)
    if stream:
        if not streamable:
            raise UsageError(f"--stream needs a local folder with config.json and safetensors weights: {args.src}")
        report = stream_to_relational(
            args.src,
            args.out,
            dtype=args.dtype or "auto",
            tolerance=args.tolerance,
            verify_layers=args.verify_layers,
            max_shard_size=args.max_shard_size,
            trust_remote_code=args.trust_remote_code,
            lock=lock,
        )
        sys.stdout.write(report.to_markdown())
        if not any((Path(args.out) / name).exists() for name in ("tokenizer_config.json", "tokenizer.json")):
            sys.stderr.write(f"no tokenizer found at {args.src}; {args.out} has none\n")
        sys.stdout.write(f"saved {args.out}\n")
        return 0
    out_dtype = parse_dtype(args.dtype)
    source = resolve_model_source(args.src, args.gguf_file)
    calibration = evaluation = None
    if args.calibration is not None:  # also the exactness check's text: real tokens, not random ones
        ids = read_token_ids(
            Path(args.calibration),
            lambda: load_tokenizer_from(source, trust_remote_code=args.trust_remote_code),
            "--calibration",
        )
        calibration, evaluation = _split(ids, args.seq_len, args.calibration_samples, args.eval_fraction)
    model = load_model_from(source, dtype="float32", trust_remote_code=args.trust_remote_code)
    relational, report = to_relational(
        model,
        args.slice,
        calibration,
        eval_data=evaluation if args.slice > 0 else None,
        tolerance=args.tolerance,
        verify_data=evaluation,
        return_report=True,
    )
    if out_dtype is not None:
        relational.to(out_dtype)

    def write(folder: Path) -> None:
        relational.save_pretrained(folder)
        try:
            save_tokenizer(load_tokenizer_from(source, trust_remote_code=args.trust_remote_code), folder)
        except (OSError, ValueError, TypeError):
            sys.stderr.write(f"no tokenizer found at {args.src}; {args.out} has none\n")
        (folder / "conversion_report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))

    write_new_output(args.out, write, command="convert", kind="relational", lock=lock)
    sys.stdout.write(report.to_markdown())
    sys.stdout.write(f"saved {args.out}\n")
    return 0
