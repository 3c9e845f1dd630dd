"""The Trainer's own checkpoints in an output's `trainer_state/`: the newest complete one found for --resume, the
incomplete and superseded ones set aside (never picked by --resume or by the Trainer's rotation) until the run's
model is safely saved."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from ..errors import UsageError

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_is_complete(folder: str | os.PathLike) -> bool:
    """A Trainer checkpoint is complete when its `trainer_state.json` (written last) parses with a `global_step` and
    the model weights it was written after are present."""
    folder = Path(folder)
    try:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(state, dict) or "global_step" not in state:
        return False
    weights = ("*.safetensors", "pytorch_model*.bin", "adapter_model.*")
    return any(next(folder.glob(pattern), None) is not None for pattern in weights)


def _checkpoints(trainer_dir: Path) -> list[tuple[int, Path]]:
    if not trainer_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in trainer_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return sorted(found)


def set_aside_incomplete_checkpoints(trainer_dir: str | os.PathLike, *, everything: bool = False) -> list[Path]:
    """Rename every incomplete `checkpoint-N` under `trainer_dir` to `incomplete-checkpoint-N`, and with `everything`
    (a fresh run into an earlier run's folder) the complete ones to `superseded-checkpoint-N`. Set-aside folders are
    invisible to `--resume` and to the Trainer's rotation (which keeps the highest step and would otherwise delete
    the new run's checkpoints); `drop_set_aside_checkpoints` removes them once the new run has saved its model.
    Returns the new paths."""
    moved = []
    for _step, folder in _checkpoints(Path(trainer_dir)):
        complete = checkpoint_is_complete(folder)
        if everything or not complete:
            target = folder.with_name(f"{'superseded' if complete else 'incomplete'}-{folder.name}")
            if target.exists():
                shutil.rmtree(target)
            os.rename(folder, target)
            logger.warning("set aside the trainer checkpoint %s as %s", folder, target.name)
            moved.append(target)
    return moved


def drop_set_aside_checkpoints(trainer_dir: str | os.PathLike) -> None:
    """Remove the `incomplete-checkpoint-N` / `superseded-checkpoint-N` folders under `trainer_dir`: called after a
    run's final model is safely in place, when no resume can need them."""
    trainer_dir = Path(trainer_dir)
    if trainer_dir.is_dir():
        for folder in trainer_dir.iterdir():
            if folder.is_dir() and re.match(r"^(incomplete|superseded)-checkpoint-\d+$", folder.name):
                shutil.rmtree(folder)


def complete_checkpoint(trainer_dir: str | os.PathLike) -> str:
    """The newest complete trainer checkpoint under `trainer_dir` (for --resume); `UsageError` when there is none."""
    trainer_dir = Path(trainer_dir)
    for _step, folder in reversed(_checkpoints(trainer_dir)):
        if checkpoint_is_complete(folder):
            return str(folder)
    raise UsageError(f"--resume: no complete trainer checkpoint under {trainer_dir}")


__all__ = [
    "checkpoint_is_complete",
    "complete_checkpoint",
    "drop_set_aside_checkpoints",
    "set_aside_incomplete_checkpoints",
]
