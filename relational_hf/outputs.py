"""Safe output directories: what `train` and `finetune` may overwrite, and how a checkpoint is replaced.

Guarantees (see the README section "What is guaranteed on failure"):

- **Ownership.** A directory is this project's output when it holds the marker file `.relational-hf-output` (written
  by `prepare_output_dir` when a run starts and kept in every saved checkpoint). A non-empty directory without the
  marker is refused unless the user passes `--overwrite`; the current directory and its parents are always refused
  (the final swap renames the output directory).
- **One writer.** `OutputLock` holds an exclusive `fcntl` lock on the sibling file `.NAME.lock` for the whole run;
  a second run into the same directory fails at once.
- **Stage and swap.** `stage_and_swap` writes the new checkpoint into the sibling staging folder `.NAME.staging`,
  fsyncs it, hard-links the files it carries over (the trainer checkpoints in `trainer_state/` and every file that is
  not a checkpoint artefact, e.g. the user's notes), then exchanges the two folders with one atomic
  `renameat2(RENAME_EXCHANGE)` (or, where the file system lacks it, renames the old folder to `.NAME.old` and the new
  one in). At every instant either NAME or, during the two-rename fallback, `.NAME.old` holds a complete checkpoint;
  `recover_output_dir` (run at the start of every command) finishes or undoes a swap a crash interrupted.
- **Complete trainer checkpoints.** The Trainer writes `trainer_state.json` last into `checkpoint-N/`;
  `complete_checkpoint` accepts a checkpoint only when that file parses and the weights it needs are present, and
  `set_aside_incomplete_checkpoints` renames the others to `incomplete-checkpoint-N` (and, when a fresh run starts
  in an earlier run's folder, that run's checkpoints to `superseded-checkpoint-N`), so that neither `--resume` nor
  the Trainer's rotation picks them; they are removed only after the new run's model is saved.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import UsageError

logger = logging.getLogger(__name__)

MARKER = ".relational-hf-output"
TRAINER_DIR = "trainer_state"
# Files a save writes (model, adapter, tokenizer, config, code files): replaced by a new save, never carried over.
ARTEFACTS = (
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.*",
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.*",
    "vocab.*",
    "merges.txt",
    "spiece.model",
    "modeling_*.py",
    "configuration_*.py",
    "merged",
    MARKER,
)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


# ---------------------------------------------------------------------------------------------------------------
# what a directory holds
# ---------------------------------------------------------------------------------------------------------------


def is_project_output(path: str | os.PathLike) -> bool:
    """True when `path` is a directory written by this project: it holds the marker file, or (outputs of versions
    before the marker) a config.json beside the `trainer_state/` folder that `train`/`finetune` keep."""
    path = Path(path)
    return (path / MARKER).is_file() or ((path / "config.json").is_file() and (path / TRAINER_DIR).is_dir())


def read_marker(path: str | os.PathLike) -> dict:
    """The marker's content ({"command", "kind"}; {} when absent or unreadable)."""
    try:
        return json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def holds_full_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` holds a full model checkpoint: a config.json with weights (safetensors or .bin) beside it."""
    path = Path(path)
    return (
        (path / "config.json").is_file()
        and any(next(path.glob(pattern), None) is not None for pattern in ("*.safetensors", "pytorch_model*.bin"))
        and not (path / "adapter_config.json").is_file()
    )


def _sibling(out: Path, suffix: str) -> Path:
    return out.with_name(f".{out.name}.{suffix}")


def normalise_output_dir(output_dir: str | os.PathLike, flag: str = "--output-dir") -> Path:
    """The absolute output path; refuses an empty name, the current directory or one of its parents, and a path that
    exists but is not a directory."""
    text = str(output_dir)
    if not text.strip():
        raise UsageError(f"{flag}: empty path")
    out = Path(os.path.realpath(os.path.expanduser(text)))  # a symbolic link: the swap happens at its target
    cwd = Path(os.path.realpath(os.getcwd()))
    if out == cwd or out in cwd.parents or out.parent == out:
        raise UsageError(
            f"{flag} {text}: the output directory cannot be the current directory or one of its parents (a save "
            f"replaces the whole directory); pass a sub-folder, e.g. {flag} ./run"
        )
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {text}: exists and is not a directory")
    return out


def prepare_output_dir(
    output_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    resume: bool = False,
    command: str = "train",
    kind: str = "full",
    flag: str = "--output-dir",
) -> Path:
    """Check and claim an output directory before any work; returns its absolute path.

    Recovers an interrupted swap, then refuses: a non-empty directory without the marker (unless `overwrite`), a
    `kind="lora"` run into a directory holding a full checkpoint (always: adapter files beside full weights make
    the directory unloadable), and `resume` without a complete trainer checkpoint. Creates the directory and writes
    the marker, then sets incomplete trainer checkpoints aside."""
    out = normalise_output_dir(output_dir, flag)
    recover_output_dir(out)
    if kind == "lora" and holds_full_checkpoint(out):
        raise UsageError(
            f"{flag} {output_dir} holds a full model checkpoint; LoRA adapter files written beside it would make it "
            "unloadable: choose another directory for the adapter"
        )
    if out.is_dir() and any(out.iterdir()) and not is_project_output(out) and not overwrite:
        raise UsageError(
            f"{flag} {output_dir} is not empty and was not written by relational-hf; nothing was changed. Choose an "
            "empty or new directory, or pass --overwrite to replace its checkpoint files (other files are kept)"
        )
    marker = read_marker(out)
    if marker.get("kind") not in (None, kind) and not overwrite:
        raise UsageError(
            f"{flag} {output_dir} holds a {marker['kind']} output of `{marker.get('command')}`; a {kind} run would "
            "replace it: choose another directory, or pass --overwrite"
        )
    if resume:
        if not out.is_dir():
            raise UsageError(f"--resume: {flag} {output_dir} does not exist")
        if complete_checkpoint(out / TRAINER_DIR):  # raises when there is none, before anything is renamed
            set_aside_incomplete_checkpoints(out / TRAINER_DIR)
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, command, kind)
    set_aside_incomplete_checkpoints(out / TRAINER_DIR, everything=not resume)
    return out


def remove_if_unused(folder: str | os.PathLike) -> bool:
    """Remove `folder` when it holds nothing but the marker and empty folders (a run that failed before writing
    anything); True when removed. Never removes a file other than the marker."""
    folder = Path(folder)
    if not folder.is_dir() or any(p.is_file() and p.name != MARKER for p in folder.rglob("*")):
        return False
    shutil.rmtree(folder)
    return True


def write_marker(folder: Path, command: str, kind: str) -> None:
    """Write the ownership marker into `folder` (atomically: a temporary file renamed over it)."""
    tmp = folder / f"{MARKER}.tmp"
    tmp.write_text(json.dumps({"command": command, "kind": kind}) + "\n", encoding="utf-8")
    os.replace(tmp, folder / MARKER)


# ---------------------------------------------------------------------------------------------------------------
# lock
# ---------------------------------------------------------------------------------------------------------------


class OutputLock:
    """An exclusive, non-blocking `fcntl.flock` on the sibling file `.NAME.lock` of an output directory, held for a
    whole run (`with OutputLock(out): ...`). A second holder fails at once with `UsageError`. The operating system
    releases the lock if the process dies (the lock file then stays, harmless); a normal exit removes the file while
    still holding the lock, and a taker checks after locking that the file it locked is still the one at the path."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.out = Path(os.path.realpath(output_dir))
        self.path = _sibling(self.out, "lock")
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        try:
            import fcntl
        except ImportError:  # not a POSIX system: no lock, said once
            logger.warning("file locking is not available on this platform: %s is not locked", self.out)
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"{self.out}: cannot create its parent folder ({err.strerror})") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise UsageError(f"{self.out}: cannot create the lock file {self.path} ({err.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise UsageError(
                        f"{self.out} is in use by another relational-hf run (lock {self.path.name} held); wait for it "
                        "to finish or choose another --output-dir"
                    ) from None
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file between our open and our lock: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            import fcntl

            try:
                os.unlink(self.path)  # while still locked: a waiting taker sees the inode change and retries
            except FileNotFoundError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------------------------------------------
# stage and swap
# ---------------------------------------------------------------------------------------------------------------


def _fsync_tree(folder: Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not fsync directories
        pass
    finally:
        os.close(fd)


def _link_tree(source: Path, target: Path) -> None:
    """Copy `source` to `target` with hard links (a copy where links are not possible): no data is duplicated."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    if source.is_dir():
        shutil.copytree(source, target, copy_function=link, symlinks=True)
    else:
        link(str(source), str(target))


def _is_artefact(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in ARTEFACTS)


def exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two existing paths with Linux `renameat2(RENAME_EXCHANGE)`; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(a))


def stage_and_swap(
    output_dir: str | os.PathLike, write: Callable[[Path], None], *, command: str = "train", kind: str = "full"
) -> Path:
    """Replace the checkpoint in `output_dir` by what `write(staging_folder)` writes, so that a crash at any point
    leaves a complete old or new checkpoint (module docstring). Carries over `trainer_state/` and every file of
    the old folder that is not a checkpoint artefact (hard links). Returns the output path."""
    out = Path(os.path.realpath(output_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_output_dir(out)
    staging = _sibling(out, "staging")
    if staging.exists():
        shutil.rmtree(staging)  # a staging folder is never the only complete copy (recover_output_dir saw to that)
    staging.mkdir()
    try:
        write(staging)
        if out.is_dir():
            for entry in out.iterdir():
                if (entry.name == TRAINER_DIR or not _is_artefact(entry.name)) and not (staging / entry.name).exists():
                    _link_tree(entry, staging / entry.name)
        write_marker(staging, command, kind)  # last: a staging folder with the marker is complete
        _fsync_tree(staging)
    except Exception:  # a failed write (disk full, an error in `write`): the old checkpoint was never touched
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not out.exists():
        os.rename(staging, out)
    elif exchange(staging, out):
        _fsync_dir(out.parent)
        shutil.rmtree(staging)  # now the old checkpoint
    else:
        old = _sibling(out, "old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(out, old)  # from here until the next rename, .NAME.old is the complete checkpoint
        os.rename(staging, out)
        _fsync_dir(out.parent)
        shutil.rmtree(old)
    _fsync_dir(out.parent)
    return out


def write_new_output(
    output_dir: str | os.PathLike,
    write: Callable[[Path], None],
    *,
    command: str,
    kind: str,
    flag: str = "OUT",
) -> Path:
    """Write the output folder of a command that never replaces anything (`convert`, `compress`): under the
    `OutputLock`, refuse an `output_dir` that exists and is not an empty folder (`UsageError`, nothing changed),
    then `stage_and_swap` what `write(staging_folder)` writes, with the marker. A crash leaves either no output or
    a complete one. Returns the absolute output path."""
    out = normalise_output_dir(output_dir, flag)
    with OutputLock(out):
        recover_output_dir(out)
        if out.is_dir() and any(out.iterdir()):
            raise UsageError(
                f"{flag} {output_dir} exists and is not an empty folder; refusing to overwrite it (nothing was changed)"
            )
        return stage_and_swap(out, write, command=command, kind=kind)


def recover_output_dir(output_dir: str | os.PathLike) -> None:
    """Finish or undo a swap that a crash interrupted: when NAME is missing, the complete staging folder (marker
    written) or else `.NAME.old` becomes NAME again; leftovers beside a present NAME are removed (they are
    either an unfinished staging folder or a superseded checkpoint)."""
    out = Path(os.path.realpath(output_dir))
    staging, old = _sibling(out, "staging"), _sibling(out, "old")
    if not out.exists():
        if staging.is_dir() and (staging / MARKER).is_file():
            logger.warning("recovering %s from a finished staging folder left by an interrupted save", out)
            os.rename(staging, out)
        elif old.is_dir():
            logger.warning("recovering %s from the previous checkpoint left by an interrupted save", out)
            os.rename(old, out)
    if out.exists():
        for leftover in (staging, old):
            if leftover.is_dir():
                shutil.rmtree(leftover)


# ---------------------------------------------------------------------------------------------------------------
# trainer checkpoints
# ---------------------------------------------------------------------------------------------------------------


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
    "MARKER",
    "OutputLock",
    "checkpoint_is_complete",
    "complete_checkpoint",
    "drop_set_aside_checkpoints",
    "exchange",
    "holds_full_checkpoint",
    "is_project_output",
    "normalise_output_dir",
    "prepare_output_dir",
    "read_marker",
    "remove_if_unused",
    "recover_output_dir",
    "set_aside_incomplete_checkpoints",
    "stage_and_swap",
    "write_new_output",
]
