"""`relational-hf canonicalize SRC OUT [--stream | --no-stream] [--dtype D] [--overwrite]`: write the canonical
representative of a checkpoint's symmetry orbit (DESIGN.md 2.2), computing the same function.

Streaming (the default for a local folder with safetensors weights): one decoder layer at a time from the shards
(`stream_canonicalize`), memory of one layer, each tensor in its stored dtype unless --dtype. Otherwise the whole
model is loaded in fp32 (any source `relational_hf.loading` accepts: Hub id, folder, GGUF file) and moved by
`canonicalize`. OUT is staged beside and renamed into place when complete; a non-empty OUT is refused unless
--overwrite (its checkpoint files are then replaced in one swap, other files kept)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ..errors import UsageError
from ..loading import add_model_source_arguments, load_model_from, load_tokenizer_from, resolve_model_source
from ..shards import (
    add_stream_arguments,
    check_output_dir,
    is_safetensors_checkpoint,
    parse_dtype,
    parse_size,
    publish,
    staging_dir,
)
from .canonical import canonicalize
from .canonical_stream import REPORT_NAME, _report_dict, stream_canonicalize


def add_canonicalize_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `canonicalize` command's arguments to `parser`."""
    parser.add_argument("src", metavar="SRC", help="Hub id, local checkpoint folder or GGUF file of a causal LM")
    parser.add_argument("out", metavar="OUT", type=Path, help="output folder for the canonical checkpoint")
    add_stream_arguments(
        parser,
        "one layer at a time from SRC's safetensors shards (default for a local safetensors folder): "
        "memory of one layer, SRC's dtype kept on disk",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the checkpoint files of a non-empty OUT (others are kept)"
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="passed to from_pretrained")
    add_model_source_arguments(parser, dtype=False)  # --dtype above is the saved dtype
    return parser


def run_canonicalize(args: argparse.Namespace) -> int:
    """Check the arguments, canonicalise SRC into OUT (streaming or in memory), print the report's summary."""
    parse_dtype(args.dtype)
    try:
        parse_size(args.max_shard_size)
    except ValueError as err:
        raise UsageError(f"--max-shard-size: {err}") from None
    if not args.overwrite:
        try:
            check_output_dir(args.out)
        except FileExistsError as err:
            raise UsageError(f"OUT {err}; or pass --overwrite") from None
    streamable = args.gguf_file is None and is_safetensors_checkpoint(args.src)
    stream = streamable if args.stream is None else args.stream
    if stream and not streamable:
        raise UsageError(
            f"--stream needs a local folder with config.json and safetensors weights: {args.src} (use --no-stream)"
        )
    if stream:
        report = stream_canonicalize(
            args.src,
            args.out,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            trust_remote_code=args.trust_remote_code,
        )
    else:
        report = _in_memory(args)
    sys.stdout.write(f"{report}\nsaved {args.out}\n")
    return 0


def _in_memory(args: argparse.Namespace):
    from ..outputs import normalise_output_dir, stage_and_swap, write_marker

    source = resolve_model_source(args.src, args.gguf_file)
    model = load_model_from(source, dtype="float32", trust_remote_code=args.trust_remote_code)
    canonical, report = canonicalize(model, return_report=True)
    out_dtype = parse_dtype(args.dtype)
    if out_dtype is not None:
        canonical.to(out_dtype)
    del model

    def write(stage: Path) -> None:
        from ..loading import save_tokenizer

        canonical.save_pretrained(stage, max_shard_size=args.max_shard_size)
        try:
            save_tokenizer(load_tokenizer_from(source, trust_remote_code=args.trust_remote_code), stage)
        except (OSError, ValueError, TypeError):
            sys.stderr.write(f"no tokenizer found at {args.src}; {args.out} has none\n")
        (stage / REPORT_NAME).write_text(json.dumps(_report_dict(report), indent=2))

    if args.overwrite:
        stage_and_swap(normalise_output_dir(args.out, "OUT"), write, command="canonicalize", kind="full")
        return report
    stage = staging_dir(args.out)
    try:
        write(stage)
        write_marker(stage, "canonicalize", "full")
        publish(stage, args.out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return report


__all__ = ["add_canonicalize_arguments", "run_canonicalize"]
