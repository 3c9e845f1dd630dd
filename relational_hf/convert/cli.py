"""`relational-hf convert SRC OUT [--slice F --calibration FILE] [--stream | --no-stream] [--dtype D]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..loading import add_model_source_arguments, load_model_from, load_tokenizer, resolve_model_source, save_tokenizer
from ..outputs import write_new_output
from ..shards import add_stream_arguments
from ..validate import (
    check_convert_args,
    fraction_closed_open,
    fraction_open,
    int_at_least,
    positive_float,
    positive_int,
    text_or_ids_file,
)
from .relational import to_relational
from .streaming import (
    check_output_dir,
    is_safetensors_checkpoint,
    parse_dtype,
    stream_to_relational,
)


def add_convert_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `convert` command's arguments to `parser`."""
    parser.add_argument("src", metavar="SRC", help="Hub id or local checkpoint of a Llama / Mistral / Qwen2 causal LM")
    parser.add_argument("out", metavar="OUT", type=Path, help="output folder for the relational checkpoint")
    parser.add_argument(
        "--slice",
        type=fraction_closed_open,
        default=0.0,
        dest="slice_fraction",
        help="fraction of residual directions to drop after the principal gauge (0: exact conversion)",
    )
    parser.add_argument(
        "--calibration",
        type=text_or_ids_file,
        default=None,
        help="calibration text (tokenised with SRC's tokenizer) or a .pt tensor of token ids; the last "
        "--eval-fraction of it is held out to report the perplexity change",
    )
    parser.add_argument("--seq-len", type=int_at_least(2), default=128, help="calibration sequence length in tokens")
    parser.add_argument(
        "--calibration-samples", type=positive_int, default=64, help="at most this many calibration sequences"
    )
    parser.add_argument(
        "--eval-fraction", type=fraction_open, default=0.2, help="share of the calibration tokens held out"
    )
    parser.add_argument(
        "--tolerance",
        type=positive_float,
        default=1e-4,
        help="max |logit difference| accepted, relative to the logit scale max(1, max |logit|) (fp32 check); "
        "streaming: the same on each layer's outputs",
    )
    add_stream_arguments(
        parser,
        "convert one layer at a time from SRC's safetensors shards (default for a local safetensors folder "
        "without --slice): memory of one layer, SRC's dtype kept on disk",
        "largest output shard when streaming (e.g. 2GB)",
    )
    parser.add_argument(
        "--verify-layers",
        type=int,
        default=None,
        help="streaming: check this many evenly spaced layers against the source layer (default: all)",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="passed to from_pretrained")
    add_model_source_arguments(parser, dtype=False)  # --dtype above is the saved dtype; the model loads in fp32
    return parser


def _token_ids(path: Path, args: argparse.Namespace) -> torch.Tensor:
    if path.suffix == ".pt":
        return torch.load(path).long().reshape(-1)
    try:
        tokenizer = load_tokenizer(args)
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"cannot tokenise {path}: no tokenizer loads from {args.src} ({err}); pass a .pt tensor of ids"
        ) from err
    return torch.tensor(tokenizer(path.read_text(encoding="utf-8"))["input_ids"], dtype=torch.long)


def _split(ids: torch.Tensor, seq_len: int, samples: int, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a token stream into (calibration, held-out) batches of seq_len tokens; held out = the last part."""
    n = ids.numel() // seq_len
    if n < 2:
        raise SystemExit(f"calibration data too short: {ids.numel()} tokens for --seq-len {seq_len}")
    chunks = ids[: n * seq_len].reshape(n, seq_len)
    n_eval = max(1, int(round(eval_fraction * n)))
    if n_eval >= n:
        raise SystemExit(f"--eval-fraction {eval_fraction} leaves no calibration sequence of the {n} in the data")
    return chunks[: n - n_eval][:samples], chunks[n - n_eval :][:samples]


def run_convert(args: argparse.Namespace) -> int:
    """(Importing this package registers the relational architecture with the Auto classes.)
    Streaming (`--stream`, the default for a local safetensors folder without --slice): `stream_to_relational`,
    one layer at a time. Otherwise load SRC in fp32, convert with `to_relational` (verified on the held-out
    calibration text when given), save OUT (safetensors, config, code files for trust_remote_code, SRC's tokenizer
    when it has one, conversion_report.json) and print the report. OUT is staged beside and renamed when
    complete (`relational_hf.outputs.write_new_output`); an existing non-empty OUT is refused."""
    check_convert_args(args)
    check_output_dir(args.out)
    streamable = is_safetensors_checkpoint(args.src)
    stream = args.stream if args.stream is not None else (streamable and args.slice_fraction == 0)
    if stream:
        if args.slice_fraction > 0:
            raise SystemExit("--slice needs calibration activations of the whole model: use --no-stream")
        if not streamable:
            raise SystemExit(f"--stream needs a local folder with config.json and safetensors weights: {args.src}")
        report = stream_to_relational(
            args.src,
            args.out,
            dtype=args.dtype,
            tolerance=args.tolerance,
            verify_layers=args.verify_layers,
            max_shard_size=args.max_shard_size,
            trust_remote_code=args.trust_remote_code,
        )
        sys.stdout.write(report.to_markdown())
        sys.stdout.write(f"saved {args.out}\n")
        return 0
    out_dtype = parse_dtype(args.dtype)
    source = resolve_model_source(args.src, args.gguf_file)
    model = load_model_from(source, dtype="float32", trust_remote_code=args.trust_remote_code)
    calibration = evaluation = None
    if args.slice_fraction > 0 and args.calibration is None:
        raise SystemExit("--slice needs --calibration FILE")
    if args.calibration is not None:  # also the exactness check's text: real tokens, not random ones
        ids = _token_ids(args.calibration, args)
        calibration, evaluation = _split(ids, args.seq_len, args.calibration_samples, args.eval_fraction)
    relational, report = to_relational(
        model,
        args.slice_fraction,
        calibration,
        eval_data=evaluation if args.slice_fraction > 0 else None,
        tolerance=args.tolerance,
        verify_data=evaluation,
        return_report=True,
    )
    if out_dtype is not None:
        relational.to(out_dtype)

    def write(folder: Path) -> None:
        relational.save_pretrained(folder)
        try:
            save_tokenizer(load_tokenizer(args), folder)
        except (OSError, ValueError):
            sys.stderr.write(f"no tokenizer found at {args.src}; {args.out} has none\n")
        (folder / "conversion_report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))

    write_new_output(args.out, write, command="convert", kind="relational")
    sys.stdout.write(report.to_markdown())
    sys.stdout.write(f"saved {args.out}\n")
    return 0


__all__ = ["add_convert_arguments", "run_convert"]
