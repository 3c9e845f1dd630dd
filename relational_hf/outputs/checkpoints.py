"""Checkpoints: model + tokenizer saved into an owned folder, and tokenizer configs every Transformers version loads."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .files import atomic_write_text
from .folders import stage_and_swap

logger = logging.getLogger(__name__)

#: tokenizer classes that are Transformers' generic fast tokenizer under another name (v5 saves "TokenizersBackend",
#: which Transformers 4.x does not know); written as the name every version understands
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend",)
_GENERIC_TOKENIZER_NAME = "PreTrainedTokenizerFast"
#: keys Transformers 5 writes into tokenizer_config.json that describe how it was loaded, not the tokenizer
_LOAD_TIME_TOKENIZER_KEYS = ("is_local", "local_files_only")


def save_tokenizer(tokenizer, out: str | os.PathLike) -> list[str]:
    """`tokenizer.save_pretrained(out)`, then make `tokenizer_config.json` name a class every Transformers version
    loads without remote code: Transformers 5's generic fast tokenizer is saved as "TokenizersBackend", which 4.x
    does not know, and written here as "PreTrainedTokenizerFast" (the same class in 5.x); keys that record how the
    tokenizer was loaded (`is_local`, `local_files_only`) are dropped. Returns the files written."""
    files = [str(f) for f in tokenizer.save_pretrained(out)]
    normalize_tokenizer_config(out)
    return files


def normalize_tokenizer_config(folder: str | os.PathLike) -> None:
    """Rewrite `folder/tokenizer_config.json` as `save_tokenizer` describes (atomically; no-op without the file)."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    changed = False
    if config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES:
        config["tokenizer_class"] = _GENERIC_TOKENIZER_NAME
        changed = True
    for key in _LOAD_TIME_TOKENIZER_KEYS:
        if key in config:
            del config[key]
            changed = True
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict) and "AutoTokenizer" not in auto_map:
        del config["auto_map"]  # a model's auto_map copied into the tokenizer config names no tokenizer code
        changed = True
    if changed:
        atomic_write_text(path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def save_checkpoint(
    model,
    tokenizer,
    output_dir: str | os.PathLike,
    *,
    command: str = "train",
    kind: str = "full",
    overwrite: bool = False,
) -> Path:
    """Save model + tokenizer into `output_dir` with `stage_and_swap` (the caller holds the lock): a crash at any
    point leaves a complete old or new checkpoint; the trainer checkpoints and the user's files are kept."""

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        if tokenizer is not None:
            save_tokenizer(tokenizer, folder)  # a tokenizer_config every Transformers version loads

    return stage_and_swap(output_dir, write, command=command, kind=kind, overwrite=overwrite)


__all__ = ["normalize_tokenizer_config", "save_checkpoint", "save_tokenizer"]
