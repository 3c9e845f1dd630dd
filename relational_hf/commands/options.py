"""How every `relational-hf` command declares and parses its options: dataclasses, read by Transformers'
`HfArgumentParser`.

A command's options are one flat dataclass (`CommandArguments` subclass) built from groups: `PARSER_GROUPS` (each a
dataclass with an `_argument_group_name`, HfArgumentParser's convention) become `--options`, spelled both
`--name-with-dashes` and `--name_with_underscores`; `POSITIONALS` (a dataclass whose fields carry `positional` in
their metadata) become the positional arguments, named by their `metavar`. Building the instance checks every value
against the rule in its type (`Annotated[int, Interval(...)]`, `Literal[...]`), from the command line and from Python
alike, and raises `UsageError` naming the option, the allowed range and the value.

The value rules (`Interval` and its instances `positive_int`, `fraction_open`, ...; `NonEmpty`; `TextFile`) work both
as that `Annotated` metadata and as argparse ``type=`` functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Literal

from transformers import HfArgumentParser

from ..errors import UsageError

# ---------------------------------------------------------------------------------------------------------------
# rules for option values
# ---------------------------------------------------------------------------------------------------------------


class Interval:
    """An allowed range of numbers, one rule used two ways with one message ("must be an integer >= 1, got 0"):

    - as metadata of a dataclass option, ``Annotated[int, Interval(1, integer=True)]``: `check_fields` calls
      ``check(value, flag)``, which raises `UsageError` naming the flag;
    - as an argparse ``type=``: ``Interval(...)(text)`` parses the text and raises `argparse.ArgumentTypeError`
      (argparse reports ``argument --flag: <message>``).

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
    """An integer >= `low`."""
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
    """A string with at least one non-blank character."""

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
    """An existing, non-empty UTF-8 text file (`relational_hf.lm.data.check_text_file`)."""

    def check(self, value: object, flag: str) -> None:
        """`UsageError` naming `flag` and the file unless it is readable UTF-8 text."""
        from ..lm.data import check_text_file

        check_text_file(value, flag)


class EachInterval:
    """Every number of a list option inside `interval` (e.g. ``Annotated[list[float], EachInterval(finite_float)]``)."""

    def __init__(self, interval: Interval) -> None:
        self.interval = interval

    def check(self, value: object, flag: str) -> None:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            self.interval.check(item, flag)


class OneOf:
    """Every item of a list option (or the one value) among `choices`; pass the same choices to argparse with
    ``option(..., choices=...)``."""

    def __init__(self, choices) -> None:
        self.choices = tuple(choices)

    def check(self, value: object, flag: str) -> None:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item not in self.choices:
                raise UsageError(f"{flag}: must be one of {', '.join(self.choices)}, got {item!r}")


#: option types with their allowed range (HfArgumentParser sees the plain type, `check_fields` the rule)
PositiveInt = Annotated[int, positive_int]
NonNegativeInt = Annotated[int, nonnegative_int]
PositiveFloat = Annotated[float, positive_float]
NonNegativeFloat = Annotated[float, nonnegative_float]
OpenFraction = Annotated[float, fraction_open]
Fraction = Annotated[float, fraction_closed_open]
Share = Annotated[float, float_in(0.0, 1.0)]  # [0, 1]
Length = Annotated[int, int_at_least(2)]
NonEmptyStr = Annotated[str, nonempty_str]
TextPath = Annotated[str, TextFile()]


# ---------------------------------------------------------------------------------------------------------------
# the option dataclasses
# ---------------------------------------------------------------------------------------------------------------


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field for a command option: its default and its --help text (argparse formats the help, so a
    literal % is written %%). `metadata` goes to argparse (e.g. metavar)."""
    if isinstance(default, list):
        values = list(default)
        return field(default_factory=lambda: list(values), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def positional(help: str, metavar: str, *, default: Any = None, nargs: str | None = None) -> Any:
    """A dataclass field for a positional argument named `metavar` on the command line (`nargs`: "+" for one or
    more, "?" for an optional one)."""
    metadata = {"help": help, "metavar": metavar, "positional": True, **({"nargs": nargs} if nargs else {})}
    if nargs == "+":
        return field(default_factory=list, metadata=metadata)
    return field(default=default, metadata=metadata)


def with_default(options: type, name: str, default: Any, help: str | None = None) -> Any:
    """The option `name` of the dataclass `options` declared again with a command's own `default` (and `help`):
    for a subclass that shares an option but not its default."""
    inherited = {item.name: item for item in fields(options)}[name]
    return field(default=default, metadata={**inherited.metadata, **({"help": help} if help else {})})


def is_switch(action: argparse.Action) -> bool:
    """Whether `action` is a bool field's option as HfArgumentParser declares it: `--flag` alone sets True (an
    optional value, `--flag false`, is still read)."""
    return bool(action.option_strings) and action.nargs == "?" and action.const is True


class OptionsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The commands' help: each option named once, as the documentation spells it (--name-with-dashes; its
    --name_with_underscores twin still parses), a switch without a value placeholder (`--stream`, not
    `--stream [STREAM]`); descriptions kept as written."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        names = [n for n in action.option_strings if not ("_" in n and n.replace("_", "-") in action.option_strings)]
        if action.nargs == 0 or is_switch(action):
            return ", ".join(names)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(f"{name} {value}" for name in names)

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        return "" if is_switch(action) else super()._format_args(action, default_metavar)

    def _format_actions_usage(self, actions, groups) -> str:
        return super()._format_actions_usage(actions, groups).replace(" ]", "]")  # a switch's empty value


def option_flag(name: str, owner: type | None = None) -> str:
    """The command-line spelling of a dataclass field: `batch_size` -> "--batch-size"; a positional field of
    `owner` -> its metavar ("SRC")."""
    if owner is not None and dataclasses.is_dataclass(owner):
        for item in fields(owner):
            if item.name == name and item.metadata.get("positional"):
                return item.metadata["metavar"]
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
    metadata (`Interval`, `NonEmpty`, `TextFile`, `OneOf`, ...) and its `Literal` choices. None passes (an unset
    optional). Raises `UsageError` naming the option's flag (`option_flag`), what is allowed and the value."""
    hints = typing.get_type_hints(type(options), include_extras=True)
    for item in dataclasses.fields(options):
        value = getattr(options, item.name)
        if value is None or item.name not in hints:
            continue
        flag = option_flag(item.name, type(options))
        rules, choices = _rules(hints[item.name])
        if choices is not None and value not in choices:
            raise UsageError(f"{flag}: must be one of {', '.join(map(str, choices))}, got {value!r}")
        for rule in rules:
            rule.check(value, flag)


class CommandArguments:
    """Base of the option dataclasses of a command. Every instance is checked when built (`__post_init__`:
    `check_fields`), whether it comes from the command line or from Python. A subclass lists its option groups in
    `PARSER_GROUPS` and its positional arguments in `POSITIONALS`, and inherits from all of them, so that one flat
    instance holds every value."""

    PARSER_GROUPS: tuple[type, ...] = ()
    POSITIONALS: type | None = None

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def add_to(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Declare the positional arguments of `POSITIONALS` on `parser` and return it; the options come from
        `option_parser` (used as a parent)."""
        if cls.POSITIONALS is not None:
            for item in fields(cls.POSITIONALS):
                kwargs = {k: v for k, v in item.metadata.items() if k != "positional"}
                if "nargs" not in kwargs and item.default is not dataclasses.MISSING and item.default is not None:
                    kwargs["nargs"] = "?"
                    kwargs["default"] = item.default
                parser.add_argument(item.name, **kwargs)
        return parser

    @classmethod
    def option_parser(cls, **kwargs: Any) -> HfArgumentParser:
        """An `HfArgumentParser` over `PARSER_GROUPS`: each field an option spelled --name-with-dashes (first: the
        spelling the help shows, `OptionsHelpFormatter`) and --name_with_underscores, its help from the field's
        metadata, bool fields as switches. `kwargs` go to `argparse.ArgumentParser` (e.g. ``add_help=False`` for a
        parser used through ``parents=[...]``)."""
        parser = HfArgumentParser(cls.PARSER_GROUPS, **kwargs)
        for action in parser._actions:
            action.option_strings.sort(key=lambda name: "_" in name)  # stable: the dashed spelling first
        return parser

    @classmethod
    def argument_parser(cls, **kwargs: Any) -> argparse.ArgumentParser:
        """The whole parser of the command: positional arguments and options (for scripts that parse alone)."""
        kwargs.setdefault("formatter_class", OptionsHelpFormatter)
        parser = argparse.ArgumentParser(parents=[cls.option_parser(add_help=False)], **kwargs)
        return cls.add_to(parser)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace):
        """The checked instance holding the values of a parsed command line (other attributes are ignored)."""
        values = vars(namespace)
        return cls(**{item.name: values[item.name] for item in fields(cls) if item.init and item.name in values})

    @classmethod
    def parse(cls, argv: list[str] | None = None, **kwargs: Any):
        """Parse `argv` with `argument_parser` into a checked instance (a `UsageError` for a rule broken)."""
        return cls.from_namespace(cls.argument_parser(**kwargs).parse_args(argv))


# ---------------------------------------------------------------------------------------------------------------
# option groups shared by several commands
# ---------------------------------------------------------------------------------------------------------------

DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "auto")


@dataclass
class ModelSourceOptions:
    """How the model argument is loaded (`relational_hf.loading`): a GGUF file inside a folder or Hub repo, and
    remote code."""

    _argument_group_name = "model source"

    gguf_file: str | None = option(
        None,
        "load this GGUF file from the model folder or Hub repo (Transformers' GGUF loader, needs the gguf package); "
        "the model is dequantised and rebuilt as a plain fp32 checkpoint. A path ending in .gguf can also be given "
        "directly as the model",
        metavar="NAME",
    )
    trust_remote_code: bool = option(False, "allow model code shipped with the checkpoint (passed to from_pretrained)")


@dataclass
class LoadDtypeOptions:
    """The dtype a command loads its model in."""

    _argument_group_name = "model source"

    dtype: Literal["float32", "float16", "bfloat16", "auto"] = option(
        "float32", "dtype the model is loaded in (auto: the dtype stored in the checkpoint)"
    )


@dataclass
class OffloadOptions:
    """Big-model loading with Accelerate's disk offload (`relational_hf.lm.offload`)."""

    _argument_group_name = "memory"

    max_memory: str | None = option(
        None,
        "CPU memory for the weights (e.g. 4GiB); the layers beyond it are offloaded to disk (Accelerate)",
        metavar="SIZE",
    )
    offload_folder: str | None = option(
        None,
        "folder for the offloaded weights (default with --max-memory: a temporary folder, removed after)",
        metavar="DIR",
    )

    def offload_budget(self) -> int | None:
        """--max-memory in bytes (None without it); a `UsageError` for anything but a positive size."""
        from ..shards import parse_size

        if self.max_memory is None:
            return None
        try:
            return parse_size(self.max_memory, "--max-memory")
        except ValueError:
            raise UsageError(
                f"--max-memory: must be a positive size such as 4GiB, 500MB or 2000000 (bytes), got {self.max_memory!r}"
            ) from None

    def offloading(self) -> bool:
        """Whether the model is loaded with disk offload (--max-memory or --offload-folder given)."""
        return self.max_memory is not None or self.offload_folder is not None


@dataclass
class StreamOptions:
    """Layer-by-layer processing of safetensors checkpoints (`relational_hf.shards`)."""

    _argument_group_name = "streaming"

    stream: bool = option(
        False, "process one layer at a time from SRC's safetensors shards (the default for a local safetensors folder)"
    )
    no_stream: bool = option(False, "load the whole model in fp32 instead of streaming")
    dtype: Literal["float32", "float16", "bfloat16", "auto"] | None = option(
        None, "dtype of the saved tensors (default: SRC's own)"
    )
    max_shard_size: NonEmptyStr = option("5GB", "largest output shard when streaming (e.g. 2GB)")

    def streaming(self) -> bool | None:
        """True (--stream), False (--no-stream) or None (neither: the command decides); both is a `UsageError`."""
        if self.stream and self.no_stream:
            raise UsageError("give either --stream or --no-stream, not both")
        return True if self.stream else (False if self.no_stream else None)


__all__ = [
    "CommandArguments",
    "DTYPES",
    "EachInterval",
    "Fraction",
    "Interval",
    "Length",
    "LoadDtypeOptions",
    "ModelSourceOptions",
    "NonEmpty",
    "OneOf",
    "NonEmptyStr",
    "NonNegativeFloat",
    "NonNegativeInt",
    "OffloadOptions",
    "OpenFraction",
    "PositiveFloat",
    "PositiveInt",
    "Share",
    "StreamOptions",
    "TextFile",
    "TextPath",
    "check_fields",
    "finite_float",
    "float_in",
    "fraction_closed_open",
    "fraction_open",
    "int_at_least",
    "nonempty_str",
    "nonnegative_float",
    "nonnegative_int",
    "option",
    "option_flag",
    "positional",
    "positive_float",
    "positive_int",
    "with_default",
]
