"""The documentation site (mkdocs.yml, docs/): the generated command-line reference says exactly what the commands
parse, every page is in the navigation, and every figure or result a page or the README points at exists.

The pages' code blocks run in tests/test_readme_examples.py; `mkdocs build --strict` runs in CI (.ci/run) and in
tests/test_docs_screenshots.py where Chromium is installed."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

import pytest

from relational_hf.commands.main import COMMANDS

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DOCS = PROJECT_ROOT / "docs"
RESULTS = PROJECT_ROOT / "benchmarks" / "results"
sys.path.insert(0, str(DOCS / "hooks"))

from cli_reference import cli_reference_markdown, command_section  # noqa: E402


def _parser(name: str):
    module = importlib.import_module(f"relational_hf.commands.{name}")
    return module.Arguments.argument_parser(prog=f"relational-hf {name}")


@pytest.mark.parametrize("name", COMMANDS)
def test_the_cli_reference_lists_exactly_what_each_command_parses(name):
    section = command_section(name)
    parser = _parser(name)
    listed = set(re.findall(r"^\| `(--[a-z0-9-]+)` \|", section, flags=re.M))
    accepted = {
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and "_" not in flag and flag != "--help"
    }
    assert listed == accepted, f"{name}: page-only {sorted(listed - accepted)}, parser-only {sorted(accepted - listed)}"
    positionals = [action.metavar for action in parser._actions if not action.option_strings]
    assert re.findall(r"^\| `([^`-][^`]*)`", section, flags=re.M) == positionals
    for action in parser._actions:
        off_switch = isinstance(action, argparse._StoreFalseAction)  # HfArgumentParser's --no-X of a True default
        if action.option_strings and action.help and action.option_strings[0] != "-h" and not off_switch:
            row = next(line for line in section.splitlines() if line.startswith(f"| `{action.option_strings[0]}` |"))
            assert action.help.replace("%%", "%").replace("|", "\\|").replace("\n", " ") in row


def test_the_cli_reference_covers_every_command_with_its_defaults():
    page = cli_reference_markdown()
    assert [m for m in re.findall(r"^## `relational-hf ([a-z]+)`", page, flags=re.M)] == list(COMMANDS)
    train = command_section("train")
    assert "| `--max-steps` | an integer >= 1 | `300` |" in train
    assert "| `--tokenizer` | one of `byte`, `bpe` | `byte` |" in train
    assert "| `--value-parallel-removal` | switch | off |" in train


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation_and_every_entry_exists():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((PROJECT_ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    written = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts}
    assert written | {"cli.md"} == set(nav), "a page outside the navigation, or an entry without its page"
    assert len(nav) == len(set(nav))


LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def test_the_readme_and_the_pages_point_only_at_files_that_exist():
    for link in LINK.findall((PROJECT_ROOT / "README.md").read_text(encoding="utf-8")):
        if not link.startswith("http"):
            assert (PROJECT_ROOT / link).exists(), f"README.md links to {link}, which is not there"
    for page in DOCS.glob("*.md"):
        for link in LINK.findall(page.read_text(encoding="utf-8")):
            if link.startswith("results/"):
                assert (RESULTS / link.removeprefix("results/")).is_file(), f"{page.name}: no {link}"
            elif not link.startswith("http"):
                assert link == "cli.md" or (DOCS / link).is_file(), f"{page.name}: no {link}"


def test_every_results_file_the_readme_or_a_page_names_exists():
    named = set()
    for page in [PROJECT_ROOT / "README.md", *DOCS.glob("*.md")]:
        named |= set(re.findall(r"benchmarks/results/([\w./-]+\.(?:json|png))", page.read_text(encoding="utf-8")))
    missing = sorted(name for name in named if not (RESULTS / name).is_file())
    assert not missing, f"named but not in benchmarks/results/: {missing}"
