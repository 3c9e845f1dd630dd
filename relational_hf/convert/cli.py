"""`relational-hf convert SRC OUT [--slice F --calibration FILE]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..loading import add_model_source_arguments, load_model, load_tokenizer, save_tokenizer
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
    parser.add_argument("--tolerance", type=positive_float, default=1e-4, help="max |logit difference| accepted (fp32)")
    parser.add_argument("--trust-remote-code", action="store_true", help="passed to from_pretrained")
    add_model_source_arguments(parser)
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
    Load SRC in fp32, convert with `to_relational` (verified), save OUT (safetensors, config, code files for
    trust_remote_code, SRC's tokenizer when it has one, conversion_report.json) and print the report."""
    check_convert_args(args)
    model = load_model(args)
    calibration = evaluation = None
    if args.slice_fraction > 0:
        if args.calibration is None:
            raise SystemExit("--slice needs --calibration FILE")
        ids = _token_ids(args.calibration, args)
        calibration, evaluation = _split(ids, args.seq_len, args.calibration_samples, args.eval_fraction)
    relational, report = to_relational(
        model, args.slice_fraction, calibration, eval_data=evaluation, tolerance=args.tolerance, return_report=True
    )
    args.out.mkdir(parents=True, exist_ok=True)
    relational.save_pretrained(args.out)
    try:
        save_tokenizer(load_tokenizer(args), args.out)
    except (OSError, ValueError):
        sys.stderr.write(f"no tokenizer found at {args.src}; {args.out} has none\n")
    (args.out / "conversion_report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
    sys.stdout.write(report.to_markdown())
    sys.stdout.write(f"saved {args.out}\n")
    return 0


__all__ = ["add_convert_arguments", "run_convert"]
