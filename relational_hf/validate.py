"""Argument and input checks shared by every `relational-hf` command.

Two kinds of helpers live here:

- rules for option values (`Interval` with `positive_int`, `nonnegative_int`, `finite_float`, `positive_float`,
  `nonnegative_float`, `fraction_open`, ...; `nonempty_str`; `existing_file`, `text_file`, ...): as argparse
  ``type=`` functions argparse reports their message as ``argument --flag: <message>``; as ``Annotated`` metadata of
  a dataclass option `check_fields` raises `UsageError` with ``--flag: <message>``. Either way every message states
  the allowed range and the value given;
- checks run at the top of a command, before any model is loaded or trained (`check_text_file`, `require`, and
  `relational_hf.loading.check_model_argument` for model arguments): they raise `relational_hf.errors.UsageError`
  naming the flag or file.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path

from .errors import UsageError

_TEXT_CHUNK = 1 << 20
#: a Hub repository id: `name` or `namespace/name`
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


# ---------------------------------------------------------------------------------------------------------------
# rules for option values: argparse type= helpers and dataclass option checks
# ---------------------------------------------------------------------------------------------------------------


class Interval:
    """An allowed range of numbers, one rule used two ways with one message ("must be an integer >= 1, got 0"):

    - as an argparse ``type=``: ``Interval(...)(text)`` parses the text and raises `argparse.ArgumentTypeError`
      (argparse reports ``argument --flag: <message>``);
    - as metadata of a dataclass option, ``Annotated[int, Interval(1, integer=True)]``: `check_fields` calls
      ``check(value, flag)``, which raises `UsageError` naming the flag.

    `low` / `high`: the bounds (None = unbounded on that side), open where `low_open` / `high_open`; `integer`:
    whole numbers only. A float must also be finite."""

    def __init__(
        self,
        low: float | None = None,
        high: float | None = None,
        *,
        low_open: bool = False,
        high_open: bool = False,
        integer: bool = False,
    ) -> None:
        self.low, self.high, self.low_open, self.high_open, self.integer = low, high, low_open, high_open, integer

    def describe(self) -> str:
        """The allowed range in words: "an integer >= 2", "a finite number in (0, inf)"."""
        if self.integer and self.high is None and self.low is not None and not self.low_open:
            return f"an integer >= {self.low}"
        left = "(-inf" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
        right = "inf)" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
        return f"{'an integer' if self.integer else 'a finite number'} in {left}, {right}"

    def contains(self, value: object) -> bool:
        """True when `value` is a number of the right kind (int for `integer`), finite, and inside the range."""
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def check(self, value: object, flag: str) -> None:
        """`UsageError` "<flag>: must be <range>, got <value>" unless `contains(value)`."""
        if not self.contains(value):
            raise UsageError(f"{flag}: must be {self.describe()}, got {value!r}")

    def __call__(self, text: str) -> int | float:
        try:
            value = int(text) if self.integer else float(text)
        except (TypeError, ValueError):
            kind = "an integer" if self.integer else "a number"
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        if not self.contains(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        return value

    def __repr__(self) -> str:
        return f"Interval({self.describe()})"


def int_at_least(low: int) -> Interval:
    """An integer >= `low` (an argparse type, or `Annotated` metadata of a dataclass option)."""
    return Interval(low, integer=True)


def float_in(
    low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Interval:
    """A finite number in the interval given (None = unbounded on that side)."""
    return Interval(low, high, low_open=low_open, high_open=high_open)


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
finite_float = float_in()
positive_float = float_in(0.0, low_open=True)
nonnegative_float = float_in(0.0)
fraction_open = float_in(0.0, 1.0, low_open=True, high_open=True)  # (0, 1)
fraction_closed_open = float_in(0.0, 1.0, high_open=True)  # [0, 1)


class NonEmpty:
    """A string with at least one non-blank character (an argparse type, or `Annotated` metadata)."""

    def __call__(self, text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("must not be empty")
        return text

    def check(self, value: object, flag: str) -> None:
        """`UsageError` naming `flag` unless `value` is a string with a non-blank character."""
        if not isinstance(value, str) or not value.strip():
            raise UsageError(f"{flag}: must not be empty, got {value!r}")


nonempty_str = NonEmpty()


class TextFile:
    """An existing, non-empty UTF-8 text file (`Annotated` metadata of a path option): `check_text_file`."""

    def check(self, value: object, flag: str) -> None:
        """`UsageError` naming `flag` and the file unless it is readable UTF-8 text."""
        check_text_file(value, flag)


def option_flag(name: str) -> str:
    """The command-line spelling of a dataclass option: `batch_size` -> "--batch-size"."""
    return "--" + name.replace("_", "-")


def _rules(hint: object) -> tuple[list[object], tuple | None]:
    """The checks (`Annotated` metadata with a `check` method) and the Literal choices inside a type hint, looking
    through `X | None`."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        base, *extras = typing.get_args(hint)
        rules, choices = _rules(base)
        return [*rules, *(extra for extra in extras if hasattr(extra, "check"))], choices
    if origin is typing.Literal:
        return [], typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rules, choices = [], None
        for arg in typing.get_args(hint):
            more, found = _rules(arg)
            rules, choices = rules + more, choices or found
        return rules, choices
    return [], None


def check_fields(options: object) -> None:
    """Check every field of the dataclass instance `options` against its type hint: the rules in its `Annotated`
    metadata (`Interval`, `NonEmpty`, `TextFile`) and its `Literal` choices. None passes (an unset optional).
    Raises `UsageError` naming the option's flag (`option_flag`), what is allowed and the value given."""
    hints = typing.get_type_hints(type(options), include_extras=True)
    for item in dataclasses.fields(options):
        value = getattr(options, item.name)
        if value is None or item.name not in hints:
            continue
        rules, choices = _rules(hints[item.name])
        if choices is not None and value not in choices:
            raise UsageError(f"{option_flag(item.name)}: must be one of {', '.join(map(str, choices))}, got {value!r}")
        for rule in rules:
            rule.check(value, option_flag(item.name))


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


def text_or_safetensors_file(text: str) -> Path:
    """An argparse type: a `.safetensors` file (existence only; its reader checks it) or a UTF-8 text file."""
    path = existing_file(text)
    return path if path.suffix == ".safetensors" else text_file(text)


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
    """`relational-hf convert`: SRC exists (or is a Hub id); OUT is new or empty (never replaced: the conversion is
    written with `relational_hf.outputs.write_new_output`), never SRC itself; --slice needs --calibration."""
    from .loading import check_model_argument

    args.src = check_model_argument(args.src, "SRC", gguf_file=getattr(args, "gguf_file", None))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {out}: exists and is not a directory")
    if os.path.isdir(args.src) and out.exists() and os.path.samefile(args.src, out):
        raise UsageError(f"OUT {out} is SRC's own folder; choose another folder (nothing was changed)")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"OUT {out} is not empty; choose a new or empty folder (nothing was changed)")
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
    "Interval",
    "NonEmpty",
    "TextFile",
    "check_fields",
    "option_flag",
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
    "text_or_safetensors_file",
]
