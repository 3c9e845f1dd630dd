"""The README's and the documentation's examples run as written: every ```python and ```bash block of README.md and
of every page under docs/ is executed.

A block may be preceded by a marker comment `<!-- readme-test: ... -->` with `;`-separated clauses:
- `skip: REASON` — not run (only for examples that need the network or other machines; the reason is shown);
- `given: NAME, ...` — names the example takes from the reader's context, provided here by `GIVEN_PYTHON` (Python
  variables) or `GIVEN_BASH` (environment variables and files in the working folder);
- `long: FLAGS` — the README says the example is long; FLAGS are appended to each command line to keep it short.
Python blocks run in a fresh namespace, bash blocks line by line with `bash -e`, both in a temporary folder (with
`training_scripts/` linked in) and with this checkout first on PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
README = PROJECT_ROOT / "README.md"
DOCS = PROJECT_ROOT / "docs"
#: every page whose code blocks run: the README and each page of the documentation site
PAGES = (README, *sorted(DOCS.rglob("*.md")))
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
RUNNABLE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}


@dataclass
class Example:
    line: int
    language: str
    code: str
    marker: dict[str, str]
    source: str = "README.md"

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}-{self.language}"


def parse_marker(text: str) -> dict[str, str]:
    """{'skip': reason, 'given': names, 'long': flags} from the body of a marker comment."""
    clauses = {}
    for clause in filter(None, (c.strip() for c in text.split(";"))):
        key, _, value = clause.partition(":")
        if key.strip() not in ("skip", "given", "long"):
            raise ValueError(f"unknown readme-test clause {clause!r} (allowed: skip, given, long)")
        clauses[key.strip()] = value.strip()
    return clauses


def readme_examples(text: str, source: str = "README.md") -> list[Example]:
    """The runnable fenced blocks of `text` (the page `source`) with the marker directly above each (blank lines
    allowed between)."""
    lines, examples, i = text.splitlines(), [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        language = RUNNABLE.get(match.group(1).lower())
        if language:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(before.strip())
            examples.append(
                Example(
                    i + 1,
                    language,
                    "\n".join(lines[i + 1 : end]),
                    parse_marker(marker.group(1)) if marker else {},
                    source,
                )
            )
        i = end + 1
    return examples


# ----------------------------------------------------------------------------------------------------------------
# What a `given:` clause provides
# ----------------------------------------------------------------------------------------------------------------


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _tiny_relational():
    from relational_hf import RelationalConfig, RelationalForCausalLM

    config = RelationalConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4)  # fmt: skip
    return RelationalForCausalLM(config).eval()


def _ids():
    return torch.randint(0, 128, (4, 32))


def _dataset():
    return [{"input_ids": row, "labels": row} for row in torch.randint(0, 128, (8, 16))]


GIVEN_PYTHON = {
    "torch": lambda: torch,
    "llama": _tiny_llama,  # a Transformers Llama
    "model": _tiny_relational,  # any causal LM; here a relational one
    "dense": _tiny_llama,
    "compressed": lambda: __import__("relational_hf.compress", fromlist=["compress_weights"]).compress_weights(
        _tiny_llama(), "int8"
    ),
    "ids": _ids,
    "input_ids": _ids,
    "ds": _dataset,
}


def _given_checkpoint(folder: Path, env: dict) -> None:
    """CKPT: a tiny relational checkpoint with the project's byte-level tokenizer."""
    from relational_hf import RelationalConfig, RelationalForCausalLM
    from relational_hf.lm.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    config = RelationalConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    RelationalForCausalLM(config).save_pretrained(folder / "given-checkpoint")
    tokenizer.save_pretrained(folder / "given-checkpoint")
    env["CKPT"] = str(folder / "given-checkpoint")


def _given_text(folder: Path, env: dict) -> None:
    """data.txt: a text file (the project's generated corpus)."""
    from relational_hf.lm.data import generate_corpus

    (folder / "data.txt").write_text(generate_corpus(300, seed=1), encoding="utf-8")


def _given_llama(folder: Path, env: dict) -> None:
    """LLAMA: a tiny Llama checkpoint saved as bf16 safetensors shards (what the streaming commands read)."""
    from tiny_models import tiny_model

    model = tiny_model("llama", seed=0)
    model.to(torch.bfloat16).save_pretrained(folder / "given-llama", max_shard_size="20KB")
    env["LLAMA"] = str(folder / "given-llama")


GIVEN_BASH = {"CKPT": _given_checkpoint, "data.txt": _given_text, "LLAMA": _given_llama}


def _names(clause: str) -> list[str]:
    return [name.strip() for name in clause.split(",") if name.strip()]


# ----------------------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------------------

EXAMPLES = [
    example
    for page in PAGES
    for example in readme_examples(page.read_text(encoding="utf-8"), page.relative_to(PROJECT_ROOT).as_posix())
]


def test_the_readme_has_examples_and_every_marker_names_known_things():
    readme = [e for e in EXAMPLES if e.source == "README.md"]
    assert sum(e.language == "python" for e in readme) >= 3 and sum(e.language == "bash" for e in readme) >= 2
    assert {e.source for e in EXAMPLES} > {"README.md"}, "the documentation pages' examples are collected too"
    for example in EXAMPLES:
        table = GIVEN_PYTHON if example.language == "python" else GIVEN_BASH
        unknown = [n for n in _names(example.marker.get("given", "")) if n not in table]
        assert not unknown, f"{example.id}: no provider for given {unknown}"
        if "skip" in example.marker:
            assert example.marker["skip"], f"{example.id}: a skip needs its reason"


def test_markers_are_parsed_and_unknown_clauses_refused():
    text = (
        "x\n<!-- readme-test: given: CKPT, data.txt; long: --max-steps 2 -->\n\n```bash\necho hi\n```\n```text\nno\n```"
    )
    (example,) = readme_examples(text)
    assert example.line == 4 and example.code == "echo hi"
    assert example.marker == {"given": "CKPT, data.txt", "long": "--max-steps 2"}
    with pytest.raises(ValueError, match="unknown readme-test clause"):
        parse_marker("run: always")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "training_scripts").symlink_to(PROJECT_ROOT / "training_scripts")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


def _with_flags(line: str, flags: str) -> str:
    """A command line with `flags` appended before its trailing comment."""
    code, hash_, comment = line.partition("  #")
    return f"{code.rstrip()} {flags}" + (f"  #{comment}" if hash_ else "")


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_readme_example_runs_as_written(example: Example, workdir: Path):
    if "skip" in example.marker:
        pytest.skip(f"{example.id}: {example.marker['skip']}")
    given = _names(example.marker.get("given", ""))
    if example.language == "python":
        namespace = {"__name__": "__readme__"}
        namespace.update({name: GIVEN_PYTHON[name]() for name in given})
        exec(compile(example.code, example.id, "exec"), namespace)
        return
    env = _environment()
    for name in given:
        GIVEN_BASH[name](workdir, env)
    for line in example.code.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command = _with_flags(line, example.marker["long"]) if "long" in example.marker else line
        done = subprocess.run(
            ["bash", "-e", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (
            f"{example.id}: `{command}` exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


def test_long_flags_go_before_the_comment():
    assert _with_flags("run a b   # note", "--max-steps 2") == "run a b --max-steps 2  # note"
    assert shlex.split(_with_flags("run a", "--x 1")) == ["run", "a", "--x", "1"]
