"""Perplexity of a causal LM on a text, also for a model that does not fit in memory.

    relational-hf evaluate MODEL --text FILE [--window 512] [--windows N] [--batch-size B] [--max-memory 4GiB]
        [--offload-folder DIR] [--dtype D] [--json OUT]

The text (UTF-8, tokenised with MODEL's tokenizer, or a .pt tensor of token ids) is cut into consecutive windows of
--window tokens (the first --windows of them); the perplexity is exp(mean next-token NLL) over every predicted
token (`relational_hf.lm.metrics.perplexity`). With --max-memory or --offload-folder the model is loaded with
Accelerate's big-model loading (`relational_hf.lm.offload.load_offloaded`): the decoder layers that do not fit in
--max-memory of CPU memory stay on disk and are read in when they run. Prints the perplexity, the device map
(how many modules sit where) and the peak resident memory of the process; --json writes them atomically.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UsageError
from .checks import check_model_argument, check_token_ids, output_file, output_folder, read_token_ids, text_or_ids
from .options import (
    CommandArguments,
    Length,
    LoadDtypeOptions,
    ModelSourceOptions,
    OffloadOptions,
    PositiveInt,
    option,
    positional,
)

HELP = "perplexity of a model on a text, with disk offload for models that do not fit in memory"


@dataclass
class EvaluatePaths:
    model: str = positional("Hub id, local checkpoint folder or GGUF file of a causal LM", "MODEL")


@dataclass
class EvaluateOptions:
    _argument_group_name = "evaluation"

    text: str | None = option(
        None,
        "UTF-8 text to evaluate on (tokenised with MODEL's tokenizer), or a .pt tensor of token ids (required)",
        metavar="FILE",
    )
    window: Length = option(512, "tokens per evaluated window", metavar="T")
    windows: PositiveInt | None = option(None, "evaluate at most this many windows", metavar="N")
    batch_size: PositiveInt = option(4, "windows per forward pass", metavar="B")
    json: str | None = option(
        None,
        "write the results as JSON: a file (replaced atomically; a symbolic link's target), or - / /dev/stdout / a "
        "FIFO / a device, written through as a stream; checked before the evaluation",
        metavar="OUT",
    )


@dataclass
class EvaluateArguments(
    CommandArguments, OffloadOptions, LoadDtypeOptions, ModelSourceOptions, EvaluateOptions, EvaluatePaths
):
    POSITIONALS = EvaluatePaths
    PARSER_GROUPS = (EvaluateOptions, OffloadOptions, ModelSourceOptions, LoadDtypeOptions)


Arguments = EvaluateArguments


def check(args: EvaluateArguments) -> int | None:
    """Everything checked before loading; returns --max-memory in bytes."""
    if args.text is None:
        raise UsageError("--text is required: the UTF-8 text (or .pt token ids) to evaluate on")
    args.model = check_model_argument(args.model, "MODEL", gguf_file=args.gguf_file)
    text_or_ids(args.text, "--text")
    output_file(args.json, "--json")
    output_folder(args.offload_folder, "--offload-folder")
    return args.offload_budget()


def _windows(ids: torch.Tensor, window: int, limit: int | None) -> torch.Tensor:
    n = ids.numel() // window
    if n == 0:
        raise UsageError(f"--text holds {ids.numel()} tokens, fewer than one --window of {window}")
    if limit is not None:
        n = min(n, limit)
    return ids[: n * window].reshape(n, window)


def run(args: EvaluateArguments) -> int:
    """Load MODEL (offloaded with --max-memory / --offload-folder, whole otherwise), evaluate the perplexity of the
    windows of --text, print it with the device map and the peak RSS, write --json."""
    from ..lm.metrics import perplexity
    from ..lm.offload import GGUF_NOT_OFFLOADED, device_map_line, device_map_summary, load_model, peak_rss_bytes
    from ..loading import load_config_from, load_tokenizer_from, resolve_model_source, warn_beyond_context
    from ..outputs.paths import say_wrote, write_file

    max_memory = check(args)
    source = resolve_model_source(args.model, args.gguf_file)
    offload = args.offloading()
    if offload and source.gguf_file is not None and not source.local:
        raise UsageError(GGUF_NOT_OFFLOADED)
    ids = read_token_ids(
        Path(args.text), lambda: load_tokenizer_from(source, trust_remote_code=args.trust_remote_code), "--text"
    )
    inputs = _windows(ids, args.window, args.windows)
    warn_beyond_context(load_config_from(source, trust_remote_code=args.trust_remote_code), {"--window": args.window})
    start = time.perf_counter()
    model, device_map = load_model(
        source,
        max_memory=max_memory,
        offload_folder=args.offload_folder,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
    )
    check_token_ids(inputs, model.get_input_embeddings().weight.shape[0], "--text")
    ppl = perplexity(model, inputs, batch_size=args.batch_size, progress=True)
    seconds = time.perf_counter() - start
    summary = device_map_summary(device_map)
    result = {
        "model": str(source),
        "text": str(args.text),
        "perplexity": ppl,
        "mean_nll": math.log(ppl),
        "windows": int(inputs.shape[0]),
        "window": args.window,
        "predicted_tokens": int(inputs.shape[0] * (inputs.shape[1] - 1)),
        "offloaded": offload,
        "max_memory_bytes": max_memory,
        "device_map": summary,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "seconds": seconds,
    }
    where = device_map_line(device_map)
    sys.stdout.write(
        f"perplexity {ppl:.4f} over {result['predicted_tokens']} predicted tokens ({result['windows']} windows of "
        f"{args.window})\ndevice map: {where}\npeak RSS {result['peak_rss_mib']:.0f} MiB; {seconds:.1f} s\n"
    )
    if args.json is not None:
        say_wrote(write_file(args.json, json.dumps(result, indent=2) + "\n", "--json"))
    return 0
