"""Write the canonical representative of a checkpoint's symmetry orbit (DESIGN.md 2.2), computing the same function.

    relational-hf canonicalize SRC OUT [--stream | --no-stream] [--dtype D] [--overwrite]

Streaming (the default for a local folder with safetensors weights): one decoder layer at a time from the shards
(`stream_canonicalize`), memory of one layer, each tensor in its stored dtype unless --dtype. Otherwise the whole
model is loaded in fp32 (any source `relational_hf.loading` accepts: Hub id, folder, GGUF file) and moved by
`canonicalize`. OUT is written beside and moved into place when complete; a non-empty OUT is refused unless
--overwrite (then only the files an earlier relational-hf run wrote there are replaced; other files are kept).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .checks import check_model_argument
from .options import CommandArguments, ModelSourceOptions, StreamOptions, option, positional

HELP = "move a checkpoint to the canonical point of its symmetry orbit (same function; streamed layer by layer)"


@dataclass
class CanonicalizePaths:
    src: str = positional("Hub id, local checkpoint folder or GGUF file of a causal LM", "SRC")
    out: str = positional("output folder for the canonical checkpoint", "OUT")


@dataclass
class CanonicalizeOptions:
    _argument_group_name = "output"

    overwrite: bool = option(
        False, "write into a non-empty OUT: files relational-hf wrote there are replaced, all others are kept"
    )


@dataclass
class CanonicalizeArguments(
    CommandArguments, ModelSourceOptions, StreamOptions, CanonicalizeOptions, CanonicalizePaths
):
    POSITIONALS = CanonicalizePaths
    PARSER_GROUPS = (CanonicalizeOptions, StreamOptions, ModelSourceOptions)


Arguments = CanonicalizeArguments


def run(args: CanonicalizeArguments) -> int:
    """Check the arguments, canonicalise SRC into OUT (streaming or in memory), print the report's summary."""
    from ..outputs import OutputLock, check_new_output
    from ..shards import is_safetensors_checkpoint, parse_size

    args.src = check_model_argument(args.src, "SRC", gguf_file=args.gguf_file)
    try:
        parse_size(args.max_shard_size, "--max-shard-size")
    except ValueError as err:
        raise UsageError(str(err)) from None
    check_new_output(args.out, "OUT", source=args.src, overwrite=args.overwrite, overwrite_flag="--overwrite")
    streamable = args.gguf_file is None and is_safetensors_checkpoint(args.src)
    stream = streamable if args.streaming() is None else args.streaming()
    if stream and not streamable:
        raise UsageError(
            f"--stream needs a local folder with config.json and safetensors weights: {args.src} (use --no-stream)"
        )
    with OutputLock(args.out) as lock:  # one writer per OUT, from before the work starts
        report = _canonicalize(args, stream, lock)
    sys.stdout.write(f"{report}\nsaved {args.out}\n")
    return 0


def _canonicalize(args: CanonicalizeArguments, stream: bool, lock):
    if stream:
        from ..symmetry.canonical_stream import stream_canonicalize

        report = stream_canonicalize(
            args.src,
            args.out,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            trust_remote_code=args.trust_remote_code,
            lock=lock,
        )
    else:
        report = _in_memory(args, lock)
    return report


def _in_memory(args: CanonicalizeArguments, lock):
    from ..loading import load_model_from, load_tokenizer_from, resolve_model_source
    from ..outputs import save_tokenizer, write_output
    from ..shards import parse_dtype
    from ..symmetry.canonical import canonicalize
    from ..symmetry.canonical_stream import REPORT_NAME, report_dict

    source = resolve_model_source(args.src, args.gguf_file)
    model = load_model_from(source, dtype="float32", trust_remote_code=args.trust_remote_code)
    canonical, report = canonicalize(model, return_report=True)
    out_dtype = parse_dtype(args.dtype)
    if out_dtype is not None:
        canonical.to(out_dtype)
    del model

    def write(stage: Path) -> None:
        canonical.save_pretrained(stage, max_shard_size=args.max_shard_size)
        try:
            save_tokenizer(load_tokenizer_from(source, trust_remote_code=args.trust_remote_code), stage)
        except (OSError, ValueError, TypeError):
            sys.stderr.write(f"no tokenizer found at {args.src}; {args.out} has none\n")
        (stage / REPORT_NAME).write_text(json.dumps(report_dict(report), indent=2))

    write_output(args.out, write, command="canonicalize", kind="full", overwrite=args.overwrite, lock=lock)
    return report
