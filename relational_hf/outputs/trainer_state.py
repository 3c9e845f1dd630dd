"""The Trainer's own checkpoints in an output's `trainer_state/`: the newest complete one found for --resume, the
incomplete and superseded ones set aside (never picked by --resume or by the Trainer's rotation) until the run's
model is safely saved. A checkpoint folder is never removed whole: `remove_checkpoint` removes the files the
Trainer wrote (listed in the folder's manifest `record_checkpoint` writes after each save; by the Trainer's file
names for a folder without one) and keeps anything else, e.g. a file the user put there."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from pathlib import Path

from ..errors import UsageError
from .files import atomic_write_text, fingerprint, remove_empty_folders

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


#: the manifest of a trainer checkpoint: the files the Trainer wrote into it, with their fingerprints
CHECKPOINT_MANIFEST = ".relational-hf-checkpoint"
#: the files a Trainer checkpoint holds (without a manifest: a save killed before it, or an older version's)
_TRAINER_FILES = re.compile(
    r"^(?:(?:model|pytorch_model|adapter_model|diffusion_pytorch_model)(?:-\d+-of-\d+)?\.(?:safetensors|bin)"
    r"|.*\.(?:safetensors|bin)\.index\.json|(?:generation_)?config\.json|adapter_config\.json|README\.md"
    r"|optimizer\.(?:pt|bin)|scheduler\.pt|scaler\.pt|rng_state(?:_\d+)?\.pth|trainer_state\.json"
    r"|training_args\.bin|relational_trainer_state\.pt|(?:configuration|modeling)_\w+\.py"
    r"|tokenizer(?:_config)?\.json|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt"
    r"|chat_template\.jinja|(?:pytorch_model|optimizer)_fsdp_\d+/.+|(?:pytorch_model|optimizer)_\d+/.+"
    r"|\..+\.relational-hf-tmp-[0-9a-f]+)$"
)
_SET_ASIDE = re.compile(r"^(incomplete|superseded)-(checkpoint-\d+)(?:\.[0-9a-f]{6})?$")


def _files_below(folder: Path) -> list[str]:
    return sorted(
        (Path(root) / name).relative_to(folder).as_posix() for root, _dirs, names in os.walk(folder) for name in names
    )


def record_checkpoint(folder: str | os.PathLike) -> None:
    """Write the manifest of the trainer checkpoint `folder` that the Trainer has just saved: every file in it, with
    its fingerprint (so that `remove_checkpoint` removes these and nothing else)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    files = {rel: fingerprint(folder / rel) for rel in _files_below(folder) if rel != CHECKPOINT_MANIFEST}
    atomic_write_text(folder / CHECKPOINT_MANIFEST, json.dumps({"files": files}, indent=1) + "\n")


def _ours(folder: Path) -> set[str]:
    """The files of the checkpoint `folder` the Trainer wrote: those its manifest lists that still match their
    fingerprint, or (no readable manifest) those named as the Trainer names its files."""
    try:
        listed = json.loads((folder / CHECKPOINT_MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {rel for rel in _files_below(folder) if _TRAINER_FILES.match(rel) and (folder / rel).is_file()}
    ours = set()
    for rel, recorded in listed.items() if isinstance(listed, dict) else ():
        path = folder / rel
        try:
            if path.is_file() and not path.is_symlink() and fingerprint(path) == recorded:
                ours.add(rel)
        except OSError:
            continue
    return ours


def remove_checkpoint(folder: str | os.PathLike) -> bool:
    """Remove the trainer checkpoint `folder`'s own files (`_ours`, and its manifest), then its empty sub-folders and
    itself when empty; anything else (a file the user put there, a link, a FIFO) is kept, with the folder holding
    it. True when the folder is gone."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return False
    for rel in _ours(folder):
        (folder / rel).unlink(missing_ok=True)
    (folder / CHECKPOINT_MANIFEST).unlink(missing_ok=True)
    remove_empty_folders(folder)
    try:
        folder.rmdir()
    except OSError:
        logger.warning(
            "kept %s: it holds files the Trainer did not write (%s)", folder, ", ".join(_files_below(folder)[:3])
        )
        return False
    return True


def rotate_checkpoints(trainer_dir: str | os.PathLike, keep: int = 1) -> None:
    """After a save: record the newest `checkpoint-N` (`record_checkpoint`) and remove all but the `keep` newest with
    `remove_checkpoint` (the Trainer's own rotation would delete them whole, with the user's files). The new
    checkpoint's files get the umask's mode, as every output's (`files.give_default_modes`)."""
    from .files import give_default_modes

    found = _checkpoints(Path(trainer_dir))
    if found:
        give_default_modes(found[-1][1])
        record_checkpoint(found[-1][1])
    for _step, folder in found[: max(len(found) - keep, 0)]:
        remove_checkpoint(folder)


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
            if target.exists() and not remove_checkpoint(target):  # kept for the user's files: take another name
                target = target.with_name(f"{target.name}.{secrets.token_hex(3)}")
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
            if folder.is_dir() and _SET_ASIDE.match(folder.name):
                remove_checkpoint(folder)


def discard_run_checkpoints(trainer_dir: str | os.PathLike, after_step: int) -> list[str]:
    """A run that failed (diverged) leaves no checkpoint of its own: remove the `checkpoint-N` folders with N >
    `after_step` (the step it started or resumed from), then give the checkpoints that its start set aside as
    superseded their names back, so that `--resume` finds the previous run again. Returns the removed names."""
    trainer_dir = Path(trainer_dir)
    removed = []
    for step, folder in _checkpoints(trainer_dir):
        if step > after_step:
            remove_checkpoint(folder)  # a folder kept for the user's files is no complete checkpoint any more
            removed.append(folder.name)
    if trainer_dir.is_dir():
        for folder in sorted(trainer_dir.iterdir()):
            match = _SET_ASIDE.match(folder.name)
            if folder.is_dir() and match and match.group(1) == "superseded":
                if not (trainer_dir / match.group(2)).exists():
                    os.rename(folder, trainer_dir / match.group(2))
    return removed


def complete_checkpoint(trainer_dir: str | os.PathLike) -> str:
    """The newest complete trainer checkpoint under `trainer_dir` (for --resume); `UsageError` when there is none."""
    trainer_dir = Path(trainer_dir)
    for _step, folder in reversed(_checkpoints(trainer_dir)):
        if checkpoint_is_complete(folder):
            return str(folder)
    raise UsageError(f"--resume: no complete trainer checkpoint under {trainer_dir}")


__all__ = [
    "CHECKPOINT_MANIFEST",
    "checkpoint_is_complete",
    "complete_checkpoint",
    "discard_run_checkpoints",
    "drop_set_aside_checkpoints",
    "record_checkpoint",
    "remove_checkpoint",
    "rotate_checkpoints",
    "set_aside_incomplete_checkpoints",
]
