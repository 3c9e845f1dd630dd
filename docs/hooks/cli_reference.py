"""The command-line reference page, generated from the commands' option dataclasses.

Every `relational-hf` command is a module of `relational_hf.commands` with `HELP`, a docstring (its description) and
`Arguments`, a `CommandArguments` dataclass whose `POSITIONALS` and `PARSER_GROUPS` declare every argument with its
type, allowed range, default and help (`relational_hf.commands.options`). This module turns them into one Markdown
page; the site's build runs it (hooks/site.py), so the page always says what the code parses.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing

from relational_hf.commands.main import COMMANDS
from relational_hf.commands.options import Interval, option_flag


def _cell(text: object) -> str:
    """Text for one Markdown table cell: argparse's %% written %, pipes and line breaks escaped."""
    return str(text).replace("%%", "%").replace("|", "\\|").replace("\n", " ")


def describe_type(hint: object) -> str:
    """What an option takes, from its type hint: "switch", "one of a, b", "an integer >= 1", "text", ..."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `X | None`: an option that may stay unset
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    rules: list[object] = []
    if typing.get_origin(hint) is typing.Annotated:
        hint, *rules = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if hint is bool:
        return "switch"
    if origin is typing.Literal:
        text = "one of " + ", ".join(f"`{choice}`" for choice in typing.get_args(hint))
    elif origin is list:
        (item,) = typing.get_args(hint) or (str,)
        text = "one or more: " + describe_type(item)
    else:
        described = [rule.describe() for rule in rules if isinstance(rule, Interval)]
        names = {int: "an integer", float: "a number", str: "text"}
        text = described[0] if described else names.get(hint, getattr(hint, "__name__", str(hint)))
        if any(type(rule).__name__ == "TextFile" for rule in rules):
            text = "a UTF-8 text file"
        elif any(type(rule).__name__ == "NonEmpty" for rule in rules):
            text = "non-empty text"
    return text


def describe_default(item: dataclasses.Field) -> str:
    """A field's default as the page shows it."""
    if item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
    elif item.default is not dataclasses.MISSING:
        value = item.default
    else:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "off" if not value else "on"
    if isinstance(value, list):
        return " ".join(f"`{v}`" for v in value) if value else "none"
    return f"`{value}`"


def command_section(name: str) -> str:
    """The Markdown section of one command: help line, usage, description, positional arguments, option groups."""
    module = importlib.import_module(f"relational_hf.commands.{name}")
    arguments = module.Arguments
    parser = arguments.argument_parser(prog=f"relational-hf {name}", description=module.__doc__)
    usage = parser.format_usage().removeprefix("usage: ").strip()
    lines = [f"## `relational-hf {name}`", "", module.HELP[0].upper() + module.HELP[1:] + ".", ""]
    lines += ["```text", usage, "```", ""]
    description = (module.__doc__ or "").strip()
    if description:
        lines += [
            '??? note "Description (`--help`)"',
            "",
            *("    " + row if row else "" for row in ["```text", *description.splitlines(), "```"]),
            "",
        ]
    if arguments.POSITIONALS is not None:
        lines += ["| argument | help |", "|---|---|"]
        for item in dataclasses.fields(arguments.POSITIONALS):
            metavar = item.metadata["metavar"]
            more = {"+": " (one or more)", "?": " (optional)"}.get(item.metadata.get("nargs"), "")
            lines.append(f"| `{metavar}`{more} | {_cell(item.metadata['help'])} |")
        lines.append("")
    for group in arguments.PARSER_GROUPS:
        hints = typing.get_type_hints(group, include_extras=True)
        title = getattr(group, "_argument_group_name", None) or group.__name__
        lines += [
            f"**{_cell(title)}** (`{group.__name__}`)",
            "",
            "| option | takes | default | help |",
            "|---|---|---|---|",
        ]
        for item in dataclasses.fields(group):
            if not item.init or item.name.startswith("_"):
                continue
            lines.append(
                f"| `{option_flag(item.name)}` | {_cell(describe_type(hints[item.name]))} | "
                f"{_cell(describe_default(item))} | {_cell(item.metadata.get('help', ''))} |"
            )
            if hints[item.name] is bool and item.default is True:  # HfArgumentParser adds the switch that turns it off
                lines.append(f"| `--no-{item.name.replace('_', '-')}` | switch | off | turns `{option_flag(item.name)}` off |")
        lines.append("")
    return "\n".join(lines)


def cli_reference_markdown() -> str:
    """The whole page: every command of `relational-hf`, in the order `relational-hf --help` lists them."""
    head = [
        "# Command-line reference",
        "",
        "Generated when the site is built from the commands' option dataclasses (`relational_hf/commands/options.py`",
        "and each command's `Arguments`), so it says what the code parses. Every option is also accepted spelled",
        "with underscores (`--max_steps`); a switch takes no value; an option outside its range is refused before",
        "any work with one line naming it (exit status 2). `relational-hf COMMAND --help` prints the same.",
        "",
        " · ".join(f"[`{name}`](#relational-hf-{name})" for name in COMMANDS),
        "",
    ]
    return "\n".join(head) + "\n" + "\n".join(command_section(name) for name in COMMANDS)
