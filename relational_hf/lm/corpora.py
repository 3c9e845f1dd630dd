"""Where the real corpora of the tests and benchmarks live: one setting, `RELATIONAL_HF_DATA`.

The project commits no third-party text. Tests and benchmarks that need real text read it from the folder named by
the environment variable `RELATIONAL_HF_DATA`, by default `../shared/data` relative to the project root (the folder
beside a checkout). `data_dir()` is that folder; `corpus_file(name)` is one corpus inside it, or a
`CorpusNotFound` error (a FileNotFoundError) whose message says where it was looked for and how to get it. Tests
skip with that message; benchmarks stop with it.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the environment variable naming the folder of the corpora
DATA_ENV = "RELATIONAL_HF_DATA"
#: the project root of this source tree (the default data folder is beside it)
PROJECT_ROOT = Path(__file__).resolve().parents[2]

#: corpus name -> (path inside the data folder, what it is and how to get it)
CORPORA: dict[str, tuple[str, str]] = {
    "tinyshakespeare": (
        "tinyshakespeare/input.txt",
        "Tiny Shakespeare (the char-rnn text): datasets.load_dataset('karpathy/tiny_shakespeare'), its train, "
        "validation and test texts joined in that order",
    ),
    "wikitext-2": (
        "wikitext-2/valid.txt",
        "the WikiText-2 validation split, tokenised form: datasets.load_dataset('Salesforce/wikitext', "
        "'wikitext-2-v1', split='validation'), its text lines joined",
    ),
}


class CorpusNotFound(FileNotFoundError):
    """A corpus of the tests and benchmarks that is not in the data folder; the message says how to get it."""


def data_dir() -> Path:
    """The folder of the corpora: `$RELATIONAL_HF_DATA` (a relative path counts from the current directory), else
    `../shared/data` relative to the project root."""
    configured = os.environ.get(DATA_ENV, "").strip()
    if configured:
        return Path(configured).expanduser().resolve()
    return (PROJECT_ROOT.parent / "shared" / "data").resolve()


def missing_message(name: str | None = None) -> str:
    """What to say when the data folder or corpus `name` is absent: where it was looked for and how to get it."""
    folder = data_dir()
    where = f"${DATA_ENV}={os.environ[DATA_ENV]}" if os.environ.get(DATA_ENV, "").strip() else "the default"
    if name is None:
        return (
            f"the data folder {folder} ({where}) does not exist: set {DATA_ENV} to the folder holding the corpora "
            "(see the README, 'Data for tests and benchmarks')"
        )
    relative, how = CORPORA[name]
    return (
        f"{name} not found at {folder / relative} (data folder: {where}); set {DATA_ENV} to the folder holding "
        f"{relative}, or write it there from {how} (README, 'Data for tests and benchmarks')"
    )


#: how files of the data folder are written relative to the project root (e.g. in a reference model's spec)
DEFAULT_PREFIX = "../shared/data/"


def data_path(text: str, project_root: str | os.PathLike = PROJECT_ROOT) -> Path:
    """A path written relative to the project root; one under the default data folder (`DEFAULT_PREFIX`) is looked
    up in `data_dir()` instead, so that `RELATIONAL_HF_DATA` moves it too."""
    if text.startswith(DEFAULT_PREFIX):
        return data_dir() / text[len(DEFAULT_PREFIX) :]
    return Path(project_root) / text


def corpus_file(name: str) -> Path:
    """The file of corpus `name` (a key of CORPORA) in `data_dir()`; `CorpusNotFound` with `missing_message` when
    absent, `KeyError` for an unknown name."""
    if name not in CORPORA:
        raise KeyError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    path = data_dir() / CORPORA[name][0]
    if not path.is_file():
        raise CorpusNotFound(missing_message(name))
    return path


__all__ = [
    "CORPORA",
    "DATA_ENV",
    "DEFAULT_PREFIX",
    "CorpusNotFound",
    "corpus_file",
    "data_dir",
    "data_path",
    "missing_message",
]
