"""Package layering of relational_hf: each top-level package or module imports only layers below it, at module level
and inside functions alike, so the import graph has no cycle and nothing runs back up; command-line code lives only in
`relational_hf.commands`; the analysis toolkit loads neither Trainer nor PEFT; no library file grows past 600 lines
(the model files, which travel to the Hub, past 800)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "relational_hf"

#: The layers, lowest first: a unit (a top-level subpackage or module of relational_hf; "__init__" is the package's
#: own __init__.py) may import, at module level, only units before it in this list (or itself). A strict order means
#: the package-level import graph has no cycle.
ORDER = (
    "modeling",  # self-contained: travels with trust_remote_code checkpoints, imports nothing of ours
    "errors",  # UsageError, the one error a user can fix, for every layer above
    "_lazy",  # lazy_exports: package names imported on first read
    "outputs",  # everything a command writes: owned output folders, staging, atomic files, tokenizers
    "renaming",  # the names Transformers gives checkpoint tensors while loading (its conversion mappings)
    "shards",  # safetensors checkpoints read and written a tensor / a layer at a time
    "pretrained",  # the offline SmolLM2 checkpoint and GGUF -> plain models
    "loading",  # model sources (directories, Hub ids, GGUF files)
    "params",  # parameter formulas and stored-parameter counts
    "registration",  # the Auto* registration of the model classes
    "__init__",  # the package face: registers the architecture on import; the toolkits load on first use
    "architectures",  # adapters: a model family's modules mapped to roles, read by every toolkit
    "symmetry",  # groups, invariants and canonical gauges of the weights (principal rotations for slicing)
    "lm",  # LM data and metrics, below every user of them
    "compress",  # compression maths (weight ops, slicing, truncation, baselines): no conversion, no training
    "directional",  # the directional toolkit: its compression diagnostics measure what `compress` does
    "convert",  # checkpoints -> relational models (slicing from `compress`, perplexity from `lm`)
    "hub",  # model cards and publishing (the reference models of `training` write cards)
    "training",  # the Trainer, PEFT and healing of compressed models (suppression from `directional`)
    "jobs",  # library jobs that compose convert, compress and training (`compress_model`)
    "dynamics",  # the quotient-dynamics recorder: a Trainer callback over symmetry and directional measures
    "commands",  # the command line: one module per command, above every library package
)

#: library packages: no command-line parsing inside them (commands live in `commands`)
LIBRARY_PACKAGES = ("symmetry", "convert", "compress", "directional", "dynamics", "lm", "hub", "training", "jobs")

MAX_LINES = 600
#: the model files travel to the Hub as they are (trust_remote_code); they may be longer, up to `MODEL_MAX_LINES`
MODEL_MAX_LINES = 800


def _unit(parts: list[str]) -> str:
    """The layer of a dotted module path inside relational_hf (parts without the leading 'relational_hf')."""
    return parts[0] if parts else "__init__"


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported unit, at module level?, line) for every import of relational_hf code in `path`."""
    package = list(path.relative_to(PACKAGE).parts[:-1])  # the package a relative import starts from
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    assert child.level - 1 <= len(package), f"{path}: relative import beyond relational_hf"
                    base = package[: len(package) - child.level + 1]
                    target = base + (child.module.split(".") if child.module else [])
                    if child.module:
                        found.append((_unit(target), module_level, child.lineno))
                    else:  # from . import a, b: at the top, each name is its own unit
                        found.extend(
                            (_unit(target or [alias.name]), module_level, child.lineno) for alias in child.names
                        )
                elif child.module and child.module.split(".")[0] == "relational_hf":
                    found.append((_unit(child.module.split(".")[1:]), module_level, child.lineno))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "relational_hf":
                        found.append((_unit(alias.name.split(".")[1:]), module_level, child.lineno))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            else:  # module body, class bodies, if/try blocks at import time
                visit(child, module_level)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), True)
    return found


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def test_every_unit_has_a_layer():
    units = {_unit(list(p.relative_to(PACKAGE).with_suffix("").parts)) for p in _files()}
    assert units - set(ORDER) == set(), "add the new package or module to ORDER in tests/test_layering.py"


def test_imports_go_only_down_the_layers():
    rank = {unit: i for i, unit in enumerate(ORDER)}
    upward = []
    for path in _files():
        own = _unit(list(path.relative_to(PACKAGE).with_suffix("").parts))
        for target, module_level, line in _imports(path):
            if target == own or target not in rank or rank[target] < rank[own]:
                continue
            kind = "module-level" if module_level else "function-level"
            upward.append(f"{_name(path)}:{line} ({own}) imports {target}: {kind}")
    assert upward == [], "imports up the layer order (a cycle risk):\n" + "\n".join(upward)


def test_package_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for path in _files():
        own = _unit(list(path.relative_to(PACKAGE).with_suffix("").parts))
        graph.setdefault(own, set()).update(t for t, module_level, _ in _imports(path) if module_level and t != own)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(unit: str, trail: list[str]) -> None:
        state[unit] = 1
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*trail, unit, nxt]))
            if nxt not in state:
                walk(nxt, [*trail, unit])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            walk(unit, [])


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The checks can fail: a module-level import of training from lm is reported."""
    fake = tmp_path / "relational_hf"
    (fake / "lm").mkdir(parents=True)
    (fake / "training").mkdir()
    (fake / "lm" / "__init__.py").write_text("from ..training import trainer\n")
    (fake / "training" / "__init__.py").write_text("from ..lm import data\n\ndef f():\n    from .. import cli\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match=r"lm/__init__.py:1 \(lm\) imports training: module-level"):
        test_imports_go_only_down_the_layers()
    with pytest.raises(AssertionError, match="import cycle: lm -> training -> lm"):
        test_package_graph_has_no_cycle()


def test_no_library_file_over_600_lines_and_no_model_file_over_800():
    long = {}
    for path in _files():
        limit = MODEL_MAX_LINES if path.parent.name == "modeling" else MAX_LINES
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > limit:
            long[_name(path)] = n
    assert long == {}, f"files over their limit ({MAX_LINES}; model files {MODEL_MAX_LINES}): split them by job: {long}"


def test_library_packages_parse_no_command_line():
    """Command-line parsing lives in `relational_hf.commands`: no library package imports argparse or declares
    arguments, and no package exports a `run_*` / `add_*_arguments` hook."""
    import importlib

    found = []
    for package in LIBRARY_PACKAGES:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if re.search(r"^\s*(import argparse|from argparse)|add_argument\(", text, re.MULTILINE):
                found.append(_name(path))
        exported = getattr(importlib.import_module(f"relational_hf.{package}"), "__all__", [])
        found += [f"relational_hf.{package}.{n}" for n in exported if re.match(r"^(run_\w+|add_\w*arguments)$", n)]
    assert found == [], f"command-line code in library packages: {found}"


def test_the_layering_checks_see_argparse_in_a_library_package(tmp_path, monkeypatch):
    fake = tmp_path / "relational_hf"
    (fake / "lm").mkdir(parents=True)
    (fake / "lm" / "__init__.py").write_text("")
    (fake / "lm" / "tool.py").write_text("import argparse\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY_PACKAGES", ("lm",))
    with pytest.raises(AssertionError, match="lm/tool.py"):
        test_library_packages_parse_no_command_line()


def _loaded_after(code: str, names: tuple[str, ...]) -> list[str]:
    """The modules among `names` (and their submodules) loaded in a fresh interpreter after running `code`."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith({names!r})))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return [m for m in loaded if any(m == n or m.startswith(n + ".") for n in names)]


def test_analysis_toolkit_loads_neither_trainer_nor_peft():
    """In a fresh interpreter: using the whole directional toolkit (its names are imported on first read), the LM
    data/metrics, the converter and the Hub cards leaves transformers.trainer, peft and relational_hf.training
    unloaded."""
    code = (
        "import relational_hf.lm, relational_hf.convert, relational_hf.hub.reference_cards\n"
        "from relational_hf.directional import directional_analysis, sweep_all, compression_report, plot_sweeps\n"
        "from relational_hf.directional import decompose, token_blocks\n"
        "assert callable(decompose) and callable(token_blocks)"
    )
    assert _loaded_after(code, ("transformers.trainer", "peft", "relational_hf.training")) == []


def test_the_command_line_parser_loads_no_plotting_data_or_trainer_modules():
    """Building the `relational-hf` parser (every command's options: what `--help` and every command pay at
    start-up) loads neither matplotlib, datasets, the Transformers Trainer, the relational trainer nor the
    directional analysis (each command imports what it runs when it runs)."""
    code = "from relational_hf.commands.main import build_parser\nbuild_parser()"
    heavy = ("matplotlib", "datasets", "transformers.trainer", "relational_hf.training.trainer")
    assert _loaded_after(code, (*heavy, "relational_hf.directional.analysis")) == []


@pytest.mark.parametrize("package", ["relational_hf", "directional", "dynamics", "training"])
def test_every_name_a_package_exports_resolves(package):
    """Each name of `__all__` of the packages that import on first read (written three times there: the type-checking
    imports, the `lazy_exports` table and `__all__`) resolves to an object, so the lists cannot drift apart."""
    module = importlib.import_module(package if package == "relational_hf" else f"relational_hf.{package}")
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert not isinstance(getattr(module, name), type(module)), f"{name} is a module, not the exported object"


def test_lazy_exports_import_on_first_read_and_keep_names_that_are_also_submodules():
    """A package of `lazy_exports`: a name is imported when read and then cached; `dir` lists it; a name that is
    also a submodule's name is the exported object, not the module; an unknown name is an AttributeError."""
    import relational_hf.directional as directional

    assert "plot_sweeps" in dir(directional) and "sweep_all" in directional.__all__
    assert directional.sweep_all is importlib.import_module("relational_hf.directional.evaluation").sweep_all
    assert "sweep_all" in vars(directional)  # cached after the first read
    assert callable(directional.decompose) and not isinstance(directional.decompose, type(directional))
    assert directional.plots is importlib.import_module("relational_hf.directional.plots")
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        directional.no_such_name  # noqa: B018


def test_every_subpackage_is_an_attribute_of_the_package():
    import relational_hf

    for path in sorted(PACKAGE.glob("*/__init__.py")):
        name = path.parent.name
        if name != "modeling":  # imported eagerly by relational_hf itself
            assert getattr(relational_hf, name) is importlib.import_module(f"relational_hf.{name}"), name
