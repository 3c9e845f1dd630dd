"""Argument and input checks shared by every `relational-hf` command.

Two kinds of helpers live here:

- argparse ``type=`` functions (`positive_int`, `nonnegative_int`, `finite_float`, `positive_float`,
  `nonnegative_float`, `fraction_open`, `probability`, `existing_file`, `text_file`, ...): argparse reports their
  message as ``argument --flag: <message>``, so every message states the allowed range and the value given;
- checks run at the top of a command, before any model is loaded or trained (`check_text_file`, `require`, and
  `relational_hf.loading.check_model_argument` for model arguments): they raise `relational_hf.errors.UsageError`
  naming the flag or file.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from .errors import UsageError

_TEXT_CHUNK = 1 << 20
#: a Hub repository id: `name` or `namespace/name`
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


# ---------------------------------------------------------------------------------------------------------------
# argparse type= helpers
# ---------------------------------------------------------------------------------------------------------------


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


positive_int = int_at_least(1)
positive_int.__name__ = "positive_int"
nonnegative_int = int_at_least(0)
nonnegative_int.__name__ = "nonnegative_int"


def finite_float(text: str) -> float:
    """An argparse type: a finite number (no nan, no inf)."""
    value = _float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def float_in(
    low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite number in the interval given (None = unbounded on that side)."""
    left = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
    right = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
    interval = f"{left}, {right}"

    def parse(text: str) -> float:
        value = _float(text)
        ok = math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a finite number in {interval}, got {text!r}")
        return value

    parse.__name__ = f"float_in_{interval}"
    return parse


positive_float = float_in(0.0, low_open=True)
positive_float.__name__ = "positive_float"
nonnegative_float = float_in(0.0)
nonnegative_float.__name__ = "nonnegative_float"
fraction_open = float_in(0.0, 1.0, low_open=True, high_open=True)  # (0, 1)
fraction_open.__name__ = "fraction_open"
fraction_closed_open = float_in(0.0, 1.0, high_open=True)  # [0, 1)
fraction_closed_open.__name__ = "fraction_closed_open"


def nonempty_str(text: str) -> str:
    """An argparse type: a string with at least one non-blank character."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def existing_file(text: str) -> Path:
    """An argparse type: a path to an existing regular file."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text}")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a regular file")
    return path


def existing_dir(text: str) -> Path:
    """An argparse type: a path to an existing directory."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text}")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return path


def new_or_empty_dir(text: str) -> Path:
    """An argparse type: an output folder that does not exist yet, or an empty directory (never overwritten)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise argparse.ArgumentTypeError(f"{text} is not empty; choose a new or empty folder (nothing was changed)")
    return path


def text_file(text: str) -> Path:
    """An argparse type: an existing UTF-8 text file (no NUL bytes, valid UTF-8 throughout)."""
    path = existing_file(text)
    try:
        check_text_file(path)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return path


def text_or_ids_file(text: str) -> Path:
    """An argparse type: a `.pt` tensor of token ids (existence only) or a UTF-8 text file."""
    path = existing_file(text)
    return path if path.suffix == ".pt" else text_file(text)


# ---------------------------------------------------------------------------------------------------------------
# checks on inputs
# ---------------------------------------------------------------------------------------------------------------


def check_text_file(path: str | os.PathLike, flag: str | None = None) -> Path:
    """Raise `UsageError` unless `path` is a readable, non-empty UTF-8 text file without NUL bytes; returns it.

    The whole file is decoded incrementally, so an invalid byte anywhere is found, with its offset."""
    path = Path(path)
    where = f"{flag} {path}" if flag else str(path)
    if not path.exists():
        raise UsageError(f"{where}: no such file or directory")
    if not path.is_file():
        raise UsageError(f"{where}: not a regular file")
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, empty = 0, True
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(_TEXT_CHUNK):
                empty = False
                nul = chunk.find(b"\0")
                if nul >= 0:
                    raise UsageError(
                        f"{where}: binary file (NUL byte at offset {offset + nul}); a UTF-8 text file is needed"
                    )
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    raise UsageError(
                        f"{where}: not valid UTF-8 (byte 0x{chunk[err.start]:02x} at offset {offset + err.start}); "
                        "convert it to UTF-8 text"
                    ) from None
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UsageError(
            f"{where}: not valid UTF-8 (truncated sequence at the end); convert it to UTF-8 text"
        ) from None
    except PermissionError:
        raise UsageError(f"{where}: permission denied") from None
    if empty:
        raise UsageError(f"{where}: the file is empty")
    return path


def looks_like_local_path(text: str) -> bool:
    """True when `text` can only be meant as a local path, not a Hub id (`name` or `namespace/name`): it exists, is
    absolute, starts with ".", "/" or "~", holds a backslash or "..", names a weights/config file (.gguf,
    .safetensors, .json, .bin, .pt), is no valid Hub id, or its first component is an existing local folder
    ("checkpoints/run1" where ./checkpoints exists)."""
    if os.path.exists(text) or os.path.isabs(text) or text.startswith((".", "/", "~")) or "\\" in text:
        return True
    if ".." in text or not _HUB_ID.match(text):
        return True
    if text.lower().endswith((".gguf", ".safetensors", ".json", ".bin", ".pt")):
        return True
    head = text.split("/", 1)[0]
    return "/" in text and os.path.isdir(head)


def check_dataset_source(name: str | None, flag: str = "--dataset") -> None:
    """A `datasets.load_dataset` name that can only be a local path must exist (else "no such file or directory",
    not a failed download)."""
    if name and looks_like_local_path(name) and not os.path.exists(os.path.expanduser(name)):
        raise UsageError(f"{flag} {name}: no such file or directory (and not a dataset name on the Hub)")


def require(condition: bool, message: str) -> None:
    """Raise `UsageError(message)` unless `condition`."""
    if not condition:
        raise UsageError(message)


# ---------------------------------------------------------------------------------------------------------------
# per-command checks, called first thing by each command's run function (no model is loaded before them)
# ---------------------------------------------------------------------------------------------------------------


def _output_folder(path: str | os.PathLike | None, flag: str) -> None:
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory")


def _output_file(path: str | os.PathLike | None, flag: str) -> None:
    if path is not None and Path(path).is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name")


def check_convert_args(args: argparse.Namespace) -> None:
    """`relational-hf convert`: SRC exists (or is a Hub id); OUT is new, empty, or an earlier conversion output
    (holding conversion_report.json), never SRC itself; --slice needs --calibration."""
    from .loading import check_model_argument

    args.src = check_model_argument(args.src, "SRC", gguf_file=getattr(args, "gguf_file", None))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {out}: exists and is not a directory")
    if os.path.isdir(args.src) and out.exists() and os.path.samefile(args.src, out):
        raise UsageError(f"OUT {out} is SRC's own folder; choose another folder (nothing was changed)")
    from .outputs import is_project_output

    earlier = (out / "conversion_report.json").is_file() or is_project_output(out)
    if out.is_dir() and any(out.iterdir()) and not earlier:
        raise UsageError(
            f"OUT {out} is not empty and holds no earlier conversion (conversion_report.json); choose a new or empty "
            "folder (nothing was changed)"
        )
    if args.slice_fraction > 0 and args.calibration is None:
        raise UsageError("--slice needs --calibration FILE")


def check_redundancy_args(args: argparse.Namespace) -> None:
    """`relational-hf redundancy`: MODEL_OR_DIR exists (or is a Hub id); output paths are usable."""
    from .loading import check_model_argument

    args.model = check_model_argument(args.model, "MODEL_OR_DIR", gguf_file=getattr(args, "gguf_file", None))
    _output_file(args.png, "--png")
    _output_file(args.json, "--json")
    _output_folder(args.heatmap_dir, "--heatmap-dir")
    if args.meta and args.heatmap_dir is not None:
        raise UsageError("--heatmap-dir needs the weights' descriptors, which --meta does not compute")


def check_analyze_args(args: argparse.Namespace) -> None:
    """`relational-hf analyze`: MODEL_OR_DIR exists (or is a Hub id); --text is UTF-8 text; sizes agree."""
    from .loading import check_model_argument

    args.model = check_model_argument(args.model, "MODEL_OR_DIR", gguf_file=getattr(args, "gguf_file", None))
    check_text_file(args.text, "--text")
    _output_folder(args.out, "--out")
    if args.max_tokens < args.seq_len:
        raise UsageError(f"--max-tokens {args.max_tokens} is smaller than one --seq-len row of {args.seq_len}")


def check_dynamics_args(args: argparse.Namespace) -> None:
    """`relational-hf dynamics`: every RUN_DIR exists and yields readable trajectory files; --out is a folder."""
    from .dynamics.trajectory import find_trajectories, load_trajectory

    for run in args.runs:
        if not Path(run).exists():
            raise UsageError(f"RUN_DIR {run}: no such file or directory")
    try:
        found = find_trajectories(args.runs)
    except FileNotFoundError as err:
        raise UsageError(f"RUN_DIR: {err}") from None
    for path in found:
        try:
            load_trajectory(path)
        except Exception as err:  # a truncated or foreign file: name it, whatever NumPy raised
            raise UsageError(f"{path}: not a readable trajectory file ({type(err).__name__}: {err})") from None
    _output_folder(args.out, "--out")


__all__ = [
    "check_analyze_args",
    "check_convert_args",
    "check_dataset_source",
    "check_dynamics_args",
    "check_redundancy_args",
    "check_text_file",
    "existing_dir",
    "existing_file",
    "finite_float",
    "float_in",
    "fraction_closed_open",
    "fraction_open",
    "int_at_least",
    "looks_like_local_path",
    "nonempty_str",
    "nonnegative_float",
    "new_or_empty_dir",
    "nonnegative_int",
    "positive_float",
    "positive_int",
    "require",
    "text_file",
    "text_or_ids_file",
]
