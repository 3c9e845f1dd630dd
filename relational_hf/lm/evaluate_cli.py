"""`relational-hf evaluate MODEL --text FILE [--window 512] [--windows N] [--batch-size B] [--max-memory 4GiB]
[--offload-folder DIR] [--dtype D] [--json OUT]`: perplexity of a causal LM on a text, also for a model that does
not fit in memory.

The text (UTF-8, tokenised with MODEL's tokenizer, or a .pt tensor of token ids) is cut into consecutive windows of
--window tokens (the first --windows of them); the perplexity is exp(mean next-token NLL) over every predicted
token (`relational_hf.lm.metrics.perplexity`). With --max-memory or --offload-folder the model is loaded with
Accelerate's big-model loading (`relational_hf.lm.offload.load_offloaded`): the decoder layers that do not fit in
--max-memory of CPU memory stay on disk and are read in when they run. Prints the perplexity, the device map
(how many modules sit where) and the peak resident memory of the process; --json writes them atomically."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from ..errors import UsageError
from ..loading import add_model_source_arguments, load_model_from, load_tokenizer_from, resolve_model_source
from ..shards import parse_size
from ..validate import int_at_least, positive_int, text_or_ids_file
from .metrics import perplexity
from .offload import load_offloaded

logger = logging.getLogger(__name__)


def memory_size(text: str) -> int:
    """An argparse type: a memory size in bytes from "4GiB", "500MB", "2GB" or a plain number of bytes."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive size such as 4GiB, 500MB or 2000000 (bytes), got {text!r}"
        ) from None


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `evaluate` command's arguments to `parser`."""
    parser.add_argument("model", metavar="MODEL", help="Hub id, local checkpoint folder or GGUF file of a causal LM")
    parser.add_argument(
        "--text",
        type=text_or_ids_file,
        required=True,
        metavar="FILE",
        help="UTF-8 text to evaluate on (tokenised with MODEL's tokenizer), or a .pt tensor of token ids",
    )
    parser.add_argument("--window", type=int_at_least(2), default=512, metavar="T", help="tokens per evaluated window")
    parser.add_argument(
        "--windows", type=positive_int, default=None, metavar="N", help="evaluate at most this many windows"
    )
    parser.add_argument("--batch-size", type=positive_int, default=4, metavar="B", help="windows per forward pass")
    parser.add_argument(
        "--max-memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="CPU memory for the weights (e.g. 4GiB); the layers beyond it are offloaded to disk (Accelerate)",
    )
    parser.add_argument(
        "--offload-folder",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder for the offloaded weights (default with --max-memory: a temporary folder, removed after)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results to this JSON file")
    parser.add_argument("--trust-remote-code", action="store_true", help="passed to from_pretrained")
    add_model_source_arguments(parser)
    return parser


def _check(args: argparse.Namespace) -> None:
    if args.json is not None and args.json.is_dir():
        raise UsageError(f"--json {args.json}: is a directory; pass a file name")
    if args.offload_folder is not None and args.offload_folder.exists() and not args.offload_folder.is_dir():
        raise UsageError(f"--offload-folder {args.offload_folder}: exists and is not a folder")


def _token_ids(path: Path, source, trust_remote_code: bool) -> torch.Tensor:
    if path.suffix == ".pt":
        try:
            ids = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for a file that is not a tensor
            raise UsageError(f"--text {path}: not a tensor of token ids ({err})") from None
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
            raise UsageError(f"--text {path}: expected an integer tensor of token ids")
        return ids.long().reshape(-1)
    try:
        tokenizer = load_tokenizer_from(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(
            f"no tokenizer loads from {source} ({err}); pass --text as a .pt tensor of token ids"
        ) from None
    text = path.read_text(encoding="utf-8")
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def _windows(ids: torch.Tensor, window: int, limit: int | None) -> torch.Tensor:
    n = ids.numel() // window
    if n == 0:
        raise UsageError(f"--text holds {ids.numel()} tokens, fewer than one --window of {window}")
    if limit is not None:
        n = min(n, limit)
    return ids[: n * window].reshape(n, window)


def device_map_summary(device_map: dict[str, str]) -> dict[str, int]:
    """How many modules of a device map sit on each device ({} for a model loaded whole: everything on its device)."""
    return dict(sorted(Counter(str(v) for v in device_map.values()).items()))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes; Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write `payload` as JSON to `path` through a temporary sibling renamed over it (never a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run_evaluate(args: argparse.Namespace) -> int:
    """Load MODEL (offloaded with --max-memory / --offload-folder, whole otherwise), evaluate the perplexity of the
    windows of --text, print it with the device map and the peak RSS, write --json."""
    _check(args)
    source = resolve_model_source(args.model, args.gguf_file)
    offload = args.max_memory is not None or args.offload_folder is not None
    if offload and source.gguf_file is not None:
        raise UsageError("--max-memory / --offload-folder need a Transformers checkpoint; a GGUF file loads whole")
    inputs = _windows(_token_ids(args.text, source, args.trust_remote_code), args.window, args.windows)
    start = time.perf_counter()
    if offload:
        model = load_offloaded(
            source.location,
            max_memory=None if args.max_memory is None else {"cpu": args.max_memory},
            offload_folder=args.offload_folder,
            dtype=args.dtype,
            trust_remote_code=args.trust_remote_code,
        )
        device_map = {k: str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()}
        device_map = device_map or {"": "cpu"}  # everything fitted in --max-memory: Accelerate placed it whole
    else:
        model = load_model_from(source, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
        device_map = {"": str(next(model.parameters()).device)}
    vocab = model.get_input_embeddings().weight.shape[0]
    if int(inputs.max()) >= vocab or int(inputs.min()) < 0:
        raise UsageError(f"--text: token ids must lie in [0, {vocab}) for this model, got {int(inputs.max())}")
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
        "max_memory_bytes": args.max_memory,
        "device_map": summary,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "seconds": seconds,
    }
    where = ", ".join(f"{device}: {count} module(s)" for device, count in summary.items())
    if list(device_map) == [""]:
        where = f"the whole model on {device_map['']}"
    sys.stdout.write(
        f"perplexity {ppl:.4f} over {result['predicted_tokens']} predicted tokens ({result['windows']} windows of "
        f"{args.window})\ndevice map: {where}\npeak RSS {result['peak_rss_mib']:.0f} MiB; {seconds:.1f} s\n"
    )
    if args.json is not None:
        write_json_atomic(args.json, result)
        sys.stdout.write(f"wrote {args.json}\n")
    return 0


__all__ = ["add_evaluate_arguments", "device_map_summary", "memory_size", "peak_rss_bytes", "run_evaluate"]
