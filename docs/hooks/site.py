"""MkDocs hooks of the documentation site (mkdocs.yml, `hooks:`).

- The command-line reference page, `cli.md`, is generated at build time from the commands' option dataclasses
  (`cli_reference.cli_reference_markdown`): it cannot drift from the code.
- The benchmark results (`benchmarks/results/`, the figures and their JSON) are published under `results/`, so a page
  shows a plot as `![...](results/NAME.png)` and links its numbers as `[NAME.json](results/NAME.json)`; a link to a
  file that is not there fails `mkdocs build --strict`.
- MathJax is served from the installed `jupyter-server-mathjax` package under `assets/mathjax/` (no network).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

HOOKS = Path(__file__).resolve().parent
PROJECT_ROOT = HOOKS.parents[1]
RESULTS = PROJECT_ROOT / "benchmarks" / "results"
sys.path.insert(0, str(HOOKS))

from cli_reference import cli_reference_markdown  # noqa: E402

#: files of the MathJax package a page needs (its translations are left out)
MATHJAX_SKIP = ("localization/",)


def mathjax_folder() -> Path:
    """The static MathJax 2 folder shipped by `jupyter-server-mathjax` (the `docs` extra)."""
    spec = importlib.util.find_spec("jupyter_server_mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("MathJax is not installed: pip install -e '.[docs]' (jupyter-server-mathjax)")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def _add(files: Files, config, uri: str, path: Path) -> None:
    files.append(File.generated(config, uri, abs_src_path=str(path)))


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "cli.md", content=cli_reference_markdown()))
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and not any(part.endswith("_runs") for part in path.relative_to(RESULTS).parts):
            _add(files, config, "results/" + path.relative_to(RESULTS).as_posix(), path)
    static = mathjax_folder()
    for path in sorted(static.rglob("*")):
        relative = path.relative_to(static).as_posix()
        if path.is_file() and not relative.startswith(MATHJAX_SKIP):
            _add(files, config, "assets/mathjax/" + relative, path)
    return files
