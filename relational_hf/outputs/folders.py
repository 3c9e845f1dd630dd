"""Output folders owned by manifest, locked, staged and swapped in (the guarantees: `relational_hf.outputs`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import UsageError
from .entries import check_folder_entries, special_kind
from .files import (
    TAG,
    atomic_write_bytes,
    atomic_write_text,
    fingerprint,
    fsync_dir,
    give_default_modes,
    remove_empty_folders,
    reporting_disk_full,
)
from .lock import OutputLock
from .lock import sibling as _sibling
from .paths import check_writable_folder, file_target
from .trainer_state import complete_checkpoint, set_aside_incomplete_checkpoints

logger = logging.getLogger(__name__)

MARKER = ".relational-hf-output"
TRAINER_DIR = "trainer_state"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def read_marker(path: str | os.PathLike) -> dict:
    """The marker's content ({"command", "kind", "files": {relative path: fingerprint}, "token"}; {} when absent or
    unreadable)."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def write_marker(
    folder: str | os.PathLike, command: str, kind: str, files: dict | None = None, token: str = ""
) -> None:
    """Write the ownership marker into `folder` (atomically): the command, the kind of output and the manifest."""
    marker = {"command": command, "kind": kind, "files": dict(sorted((files or {}).items())), "token": token}
    atomic_write_text(Path(folder) / MARKER, json.dumps(marker, indent=1) + "\n")


def owned_files(folder: str | os.PathLike) -> dict[str, dict]:
    """The files of `folder` that its marker lists and that still match their fingerprint: ours to replace."""
    folder = Path(folder)
    owned = {}
    for rel, recorded in (read_marker(folder).get("files") or {}).items():
        path = folder / rel
        if not _inside(path, folder) or not path.is_file() or path.is_symlink():
            continue
        try:
            if fingerprint(path) == recorded:
                owned[rel] = recorded
        except OSError:
            continue
    return owned


def _inside(path: Path, folder: Path) -> bool:
    return os.path.normpath(path).startswith(os.path.normpath(folder) + os.sep)


def is_project_output(path: str | os.PathLike) -> bool:
    """True when `path` is a folder written by this project: it holds the marker file, or (outputs of versions
    before the marker) a config.json beside the `trainer_state/` folder that `train`/`finetune` keep."""
    path = Path(path)
    return (path / MARKER).is_file() or ((path / "config.json").is_file() and (path / TRAINER_DIR).is_dir())


def holds_full_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` holds a full model checkpoint: a config.json with weights (safetensors or .bin) beside it."""
    path = Path(path)
    return (
        (path / "config.json").is_file()
        and any(next(path.glob(pattern), None) is not None for pattern in ("*.safetensors", "pytorch_model*.bin"))
        and not (path / "adapter_config.json").is_file()
    )


def _files(folder: Path) -> Iterator[str]:
    """Relative POSIX paths of the files (and symbolic links) below `folder`."""
    for root, dirs, names in os.walk(folder):
        base = Path(root)
        for name in names + [d for d in dirs if (base / d).is_symlink()]:
            yield (base / name).relative_to(folder).as_posix()


# ---------------------------------------------------------------------------------------------------------------
# output paths
# ---------------------------------------------------------------------------------------------------------------


def normalise_output_dir(output_dir: str | os.PathLike, flag: str = "--output-dir", *, swaps: bool = True) -> Path:
    """The absolute output path with symbolic links resolved; refuses an empty name, the current directory or one of
    its parents, a path that exists but is not a directory, a folder that cannot be written (or created) and one
    whose entries a save could not keep (`check_folder_entries`)."""
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
    check_writable_folder(out.parent / f".{out.name}.{TAG}-lock", f"{flag} {text}")  # the lock and staging beside
    check_folder_entries(out, f"{flag} {text}", swaps=swaps)
    return out


def check_new_output(
    output_dir: str | os.PathLike,
    flag: str = "OUT",
    *,
    source: str | os.PathLike | None = None,
    overwrite: bool = False,
    overwrite_flag: str | None = None,
) -> Path:
    """The one rule for a command's output folder, checked before any work: not a file, not the current directory
    or a parent of it, not the model source itself (nor a folder holding it), and new or empty unless `overwrite`
    (then `write_output` replaces only what relational-hf wrote there; `overwrite_flag` names the option that allows
    it in the refusal). Returns the resolved path."""
    out = normalise_output_dir(output_dir, flag)
    if source is not None and os.path.exists(os.path.expanduser(str(source))):
        src = Path(os.path.realpath(os.path.expanduser(str(source))))
        if src == out:
            raise UsageError(f"{flag} {output_dir} is SRC's own folder; choose another folder (nothing was changed)")
        if out in src.parents:
            raise UsageError(f"{flag} {output_dir} holds SRC; choose another folder (nothing was changed)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        hint = (
            f", or pass {overwrite_flag} (only files relational-hf wrote there are replaced)" if overwrite_flag else ""
        )
        raise UsageError(f"{flag} {output_dir} is not empty; choose a new or empty folder{hint} (nothing was changed)")
    return out


def prepare_output_dir(
    output_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    resume: bool = False,
    command: str = "train",
    kind: str = "full",
    flag: str = "--output-dir",
    swaps: bool = True,
) -> Path:
    """Check and claim an output folder that a run writes into over time (train, finetune, analyze); returns it.
    `swaps`: the run ends with a save that replaces the folder (`stage_and_swap`; train, finetune), so what such a
    save could not keep is refused now (`check_folder_entries`).

    Recovers an interrupted swap, then refuses: a non-empty folder without the marker (unless `overwrite`), a
    `kind="lora"` run into a folder holding a full checkpoint (always: adapter files beside full weights make the
    folder unloadable), an output of another kind (unless `overwrite`), and `resume` without a complete trainer
    checkpoint. Creates the folder and writes the marker (keeping an existing manifest), then sets incomplete
    trainer checkpoints aside."""
    out = normalise_output_dir(output_dir, flag, swaps=swaps)
    recover_output_dir(out)
    if kind == "lora" and holds_full_checkpoint(out):
        raise UsageError(
            f"{flag} {output_dir} holds a full model checkpoint; LoRA adapter files written beside it would make it "
            "unloadable: choose another directory for the adapter"
        )
    if out.is_dir() and any(out.iterdir()) and not is_project_output(out) and not overwrite:
        raise UsageError(
            f"{flag} {output_dir} is not empty and was not written by relational-hf; nothing was changed. Choose an "
            "empty or new directory, or pass --overwrite to write there (files of the same names as the output's are "
            "replaced, all others kept)"
        )
    manifest = "files" in read_marker(out)  # an output of a version before manifests owns its files by name
    if swaps and manifest and not overwrite:  # refused now, not by the save after the training
        foreign = sorted(set(_checkpoint_names(out)) - set(owned_files(out)))
        if foreign:
            raise UsageError(
                f"{flag} {output_dir}: the model saved at the end would replace {', '.join(foreign[:4])}, which "
                "relational-hf did not write (or which was edited since); nothing was changed: choose another "
                "directory, or pass --overwrite to replace them"
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
    write_marker(out, command, kind, marker.get("files") or {}, marker.get("token", ""))
    set_aside_incomplete_checkpoints(out / TRAINER_DIR, everything=not resume)
    return out


#: the files a saved checkpoint (model, tokenizer, adapter, `merged/` copy) may hold, relative to its folder
_CHECKPOINT_FILE = re.compile(
    r"^(?:merged/)?(?:(?:model|pytorch_model|adapter_model)(?:-\d+-of-\d+)?\.(?:safetensors|bin)"
    r"|.*\.(?:safetensors|bin)\.index\.json|(?:generation_)?config\.json|adapter_config\.json|README\.md"
    r"|(?:configuration|modeling)_\w+\.py|tokenizer(?:_config)?\.json|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.json|merges\.txt|chat_template\.jinja)$"
)


def _checkpoint_names(folder: Path) -> list[str]:
    """The files of `folder` (outside `trainer_state/`) at names a checkpoint save writes."""
    return [rel for rel in _files(folder) if _CHECKPOINT_FILE.match(rel) and rel.split("/", 1)[0] != TRAINER_DIR]


def remove_if_unused(folder: str | os.PathLike) -> bool:
    """Remove `folder` when it holds nothing but the marker and empty folders (a run that failed before writing
    anything); True when removed. Never removes anything else (a file, a link, a FIFO, a socket, a device node):
    the marker is unlinked and the empty folders removed one by one, never recursively."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return False
    for root, _dirs, names in os.walk(folder):
        if any(name != MARKER or Path(root) != folder for name in names):
            return False
        if any(Path(root, d).is_symlink() for d in _dirs):
            return False
    (folder / MARKER).unlink(missing_ok=True)
    for root, dirs, _names in os.walk(folder, topdown=False):
        for name in dirs:
            os.rmdir(os.path.join(root, name))
    folder.rmdir()
    return True


@contextlib.contextmanager
def unclaimed_on_failure(folder: str | os.PathLike) -> Iterator[None]:
    """Around a run that claims `folder` (`prepare_output_dir`): when the run fails, what the claim added and the run
    left unused goes: a folder that did not exist is removed if it holds nothing but the marker
    (`remove_if_unused`); in a folder that existed, a marker that was not there before (and lists no file) and an
    empty `trainer_state/` that was not there before are removed. Nothing else is touched."""
    folder = Path(folder)
    existed, had_marker = folder.exists(), (folder / MARKER).exists()
    had_trainer_dir = (folder / TRAINER_DIR).exists()
    try:
        yield
    except BaseException:
        if not existed:
            remove_if_unused(folder)
        else:
            trainer_dir = folder / TRAINER_DIR
            if not had_trainer_dir and trainer_dir.is_dir() and not trainer_dir.is_symlink():
                _remove_empty_folders(trainer_dir)
            if not had_marker and not read_marker(folder).get("files") and not trainer_dir.exists():
                (folder / MARKER).unlink(missing_ok=True)
        raise


def _remove_empty_folders(folder: Path) -> None:
    """Remove `folder` and the folders below it that hold nothing (bottom up; never a file)."""
    for root, dirs, _names in os.walk(folder, topdown=False):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, name))
    with contextlib.suppress(OSError):
        folder.rmdir()


def record_files(folder: str | os.PathLike, names: list[str]) -> None:
    """Add the files `names` (relative paths, just written by this run) to the manifest of a claimed folder."""
    folder = Path(folder)
    marker = read_marker(folder)
    files = dict(marker.get("files") or {})
    files.update({name: fingerprint(folder / name) for name in names})
    write_marker(folder, marker.get("command", ""), marker.get("kind", ""), files, marker.get("token", ""))


def check_owned_names(
    folder: str | os.PathLike, names: list[str], *, overwrite: bool = False, flag: str = "--out"
) -> None:
    """Before a run writes the files `names` into the claimed `folder`: refuse (`UsageError`, nothing changed) when one
    of them exists and relational-hf did not write it (or it was edited since), unless `overwrite`."""
    folder = Path(folder)
    for name in names:  # a directory, FIFO, socket or device at one of the names: refused even with --overwrite
        file_target(folder / name, flag, files_only=True)
    owned = owned_files(folder)
    foreign = sorted(name for name in names if (folder / name).exists() and name not in owned)
    if foreign and not overwrite:
        raise UsageError(
            f"{flag} {folder}: {', '.join(foreign)} would be replaced, and relational-hf did not write "
            f"{'it' if len(foreign) == 1 else 'them'} (or {'it was' if len(foreign) == 1 else 'they were'} edited "
            "since); nothing was changed: choose another folder, or pass --overwrite"
        )


def write_owned_file(folder: str | os.PathLike, name: str, data: str | bytes, *, overwrite: bool = False) -> Path:
    """Write one file into a claimed output folder (atomically) and list it in the manifest. A file of that name
    that relational-hf did not write (or that was edited since) is refused unless `overwrite`."""
    folder = Path(folder)
    path = folder / name
    if path.exists() and name not in owned_files(folder) and not overwrite:
        raise UsageError(
            f"{path} exists and was not written by relational-hf (or was edited since); nothing was changed: choose "
            "another folder, or pass --overwrite to replace it"
        )
    atomic_write_bytes(path, data.encode("utf-8") if isinstance(data, str) else data)
    record_files(folder, [name])
    return path


# ---------------------------------------------------------------------------------------------------------------
# stage and swap
# ---------------------------------------------------------------------------------------------------------------


def _fsync_tree(folder: Path) -> None:
    """fsync every regular file and folder below `folder` (a link, a FIFO, a socket or a device is never opened)."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def _link(source: Path, target: Path) -> None:
    """`target` as a hard link to `source` (a copy where links are not possible, a symbolic link copied as such)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
        target.symlink_to(os.readlink(source))
        return
    try:
        os.link(source, target)
    except OSError as err:
        kind = special_kind(source.lstat().st_mode)
        if kind is not None:  # a FIFO, socket or device is never opened (a copy would read it): kept only by a link
            raise UsageError(
                f"{source} is {kind} of the user's that this save cannot keep in place ({err.strerror}); move it "
                "out of the output folder and rerun (nothing was changed)"
            ) from None
        shutil.copy2(source, target)


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


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _retire(old: Path, out: Path) -> None:
    """Empty the folder `old` that a swap replaced by `out`, losing nothing: a file that is also in `out` (a carried
    link) or that `old`'s marker lists with its fingerprint (ours, superseded) is removed; any other file (e.g. one
    created in the folder during the save) is moved into `out` (as NAME.late-TOKEN where `out` has that name).
    Then the empty folders are removed; a folder that still holds something is left in place, and said so."""
    owned = owned_files(old)
    for rel in sorted(_files(old)):
        path, target = old / rel, out / rel
        if rel == MARKER or rel in owned or (target.exists() and _same_file(path, target)):
            path.unlink()
            continue
        if target.exists() or target.is_symlink():
            target = target.with_name(f"{target.name}.late-{secrets.token_hex(3)}")
            logger.warning("%s was written during the save; kept as %s", rel, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, target)
    remove_empty_folders(old)
    try:
        old.rmdir()
    except OSError:
        logger.warning("%s is not empty after the swap and was left in place", old)


def _carry_over(out: Path, staging: Path, written: set[str], overwrite: bool, legacy: bool) -> None:
    """Link every file of the old output `out` that is not ours into `staging` (and the trainer checkpoints); our
    superseded files are left behind. A written file that would replace a file that is not ours is refused unless
    `overwrite` (or the folder's marker predates manifests: it names the files it owns by the names written now)."""
    owned = owned_files(out)
    clash = sorted(
        rel for rel in written if (out / rel).exists() and rel not in owned and rel.split("/", 1)[0] != TRAINER_DIR
    )
    special = [rel for rel in clash if special_kind((out / rel).lstat().st_mode)]
    if special:  # never replaced, even with --overwrite: the user's FIFO, socket or device keeps its name
        raise UsageError(
            f"{out}: the output would replace {special[0]}, which is "
            f"{special_kind((out / special[0]).lstat().st_mode)} of the user's; nothing was changed: move it away "
            "or choose another folder"
        )
    if clash and not overwrite and not legacy:
        shown = ", ".join(clash[:6]) + (f" and {len(clash) - 6} more" if len(clash) > 6 else "")
        raise UsageError(
            f"{out}: the output would replace {shown}, which relational-hf did not write (or which was edited since); "
            "nothing was changed: choose another folder, or pass --overwrite to replace them"
        )
    for rel in _files(out):
        if rel == MARKER or rel in written or (rel in owned and rel.split("/", 1)[0] != TRAINER_DIR):
            continue
        _link(out / rel, staging / rel)


def _write_staging(
    out: Path, staging: Path, write: Callable[[Path], None], command: str, kind: str, overwrite: bool, token: str
) -> None:
    """Fill `staging`: the new output (`write`), the carried files of `out`, then the marker (last: a staging folder
    with the marker is complete), all fsynced."""
    write(staging)
    give_default_modes(staging)  # before the user's files are linked in: theirs keep their modes
    written = set(_files(staging))
    manifest = {rel: fingerprint(staging / rel) for rel in written if not (staging / rel).is_symlink()}
    if out.is_dir():
        legacy = (out / MARKER).is_file() and "files" not in read_marker(out)
        _carry_over(out, staging, written, overwrite, legacy)
    write_marker(staging, command, kind, manifest, token)
    _fsync_tree(staging)


def stage_and_swap(
    output_dir: str | os.PathLike,
    write: Callable[[Path], None],
    *,
    command: str = "train",
    kind: str = "full",
    overwrite: bool = False,
) -> Path:
    """Replace the output in `output_dir` by what `write(staging_folder)` writes, so that a crash at any point leaves
    a complete old or new output and nothing of the user's is lost (module docstring). The caller holds the
    `OutputLock`. Returns the output path."""
    out = Path(os.path.realpath(output_dir))
    check_folder_entries(out, str(out))  # a mount point, a loop, a read-only sub-folder: refused, nothing moved
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_output_dir(out)
    token = secrets.token_hex(6)
    staging = _sibling(out, f"staging-{token}")
    kept = f"{out.name} was not changed" if out.exists() else f"{out.name} was not created"
    try:
        with reporting_disk_full(out, kept):  # a full disk: one line that says so, whatever the writer raised
            staging.mkdir()
            _write_staging(out, staging, write, command, kind, overwrite, token)
    except BaseException:  # a failed or interrupted write (disk full, an error in `write`, a refusal, Ctrl-C): the
        shutil.rmtree(staging, ignore_errors=True)  # old output was never touched and the partial copy goes
        raise
    if not out.exists():
        os.rename(staging, out)
        fsync_dir(out.parent)
        return out
    if exchange(staging, out):
        old = staging  # the old folder now sits at the staging name; out's marker carries the token
    else:
        old = _sibling(out, f"old-{token}")
        os.rename(out, old)  # from here until the next rename, the old folder is the complete output
        os.rename(staging, out)
    fsync_dir(out.parent)
    _retire(old, out)
    fsync_dir(out.parent)
    return out


def write_output(
    output_dir: str | os.PathLike,
    write: Callable[[Path], None],
    *,
    command: str,
    kind: str,
    overwrite: bool = False,
    flag: str = "OUT",
    lock: OutputLock | None = None,
) -> Path:
    """Write a command's output folder under the `OutputLock` (`lock`: one the caller already holds for this folder,
    e.g. for its whole run): a new or empty folder receives the output; a non-empty one is refused (`UsageError`,
    nothing changed) unless `overwrite`, and then only files relational-hf wrote there (or files of the output's own
    names) are replaced, all others kept (`stage_and_swap`). A crash leaves either the old folder or the complete
    new one. Returns the absolute output path."""
    out = normalise_output_dir(output_dir, flag)
    if lock is not None and not (lock.held and lock.out == out):
        raise ValueError(f"the lock passed to write_output is not held for {out}")
    with contextlib.nullcontext() if lock is not None else OutputLock(out):
        recover_output_dir(out)
        if out.is_dir() and any(out.iterdir()) and not overwrite:
            raise UsageError(f"{flag} {output_dir} is not empty; choose a new or empty folder (nothing was changed)")
        return stage_and_swap(out, write, command=command, kind=kind, overwrite=overwrite)


def write_new_output(
    output_dir: str | os.PathLike,
    write: Callable[[Path], None],
    *,
    command: str,
    kind: str,
    flag: str = "OUT",
    lock: OutputLock | None = None,
) -> Path:
    """`write_output` for commands that never replace anything (convert, compress, export)."""
    return write_output(output_dir, write, command=command, kind=kind, flag=flag, lock=lock)


def recover_output_dir(output_dir: str | os.PathLike) -> None:
    """Finish or undo a swap that a crash interrupted, losing nothing. Siblings `.NAME.relational-hf-staging-TOKEN` and
    `.NAME.relational-hf-old-TOKEN` are this project's own (the token makes them unique): when NAME is missing, the
    complete staging folder (marker written) or else the old folder becomes NAME again; a staging folder whose token
    NAME's marker carries holds the old output after an exchange and is retired like an old folder (`_retire`); any
    other staging folder is an unfinished or superseded copy and is removed."""
    out = Path(os.path.realpath(output_dir))
    if not out.parent.is_dir():
        return
    prefix = f".{out.name}.{TAG}-"
    siblings = sorted(
        p for p in out.parent.iterdir() if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink()
    )
    stagings = [p for p in siblings if p.name[len(prefix) :].startswith("staging-")]
    olds = [p for p in siblings if p.name[len(prefix) :].startswith("old-")]
    if not out.exists():
        complete = [p for p in stagings if (p / MARKER).is_file() and read_marker(p).get("token") in p.name]
        if complete:
            logger.warning("recovering %s from a finished staging folder left by an interrupted save", out)
            os.rename(complete[0], out)
            stagings.remove(complete[0])
        elif olds:
            logger.warning("recovering %s from the previous output left by an interrupted save", out)
            os.rename(olds[0], out)
            olds.remove(olds[0])
    if not out.exists():  # no output was ever complete: the stagings are unfinished copies of a first write
        for folder in stagings:
            shutil.rmtree(folder, ignore_errors=True)
        return
    token = read_marker(out).get("token")
    for folder in stagings:
        if token and folder.name.endswith(f"staging-{token}"):
            _retire(folder, out)  # the old output, exchanged out of place before the crash
        else:
            shutil.rmtree(folder, ignore_errors=True)  # our own unfinished copy: new files and links only
    for folder in olds:
        _retire(folder, out)


__all__ = [
    "MARKER",
    "TRAINER_DIR",
    "OutputLock",
    "check_folder_entries",
    "check_new_output",
    "check_owned_names",
    "exchange",
    "holds_full_checkpoint",
    "is_project_output",
    "normalise_output_dir",
    "owned_files",
    "prepare_output_dir",
    "read_marker",
    "record_files",
    "recover_output_dir",
    "remove_if_unused",
    "stage_and_swap",
    "write_marker",
    "write_new_output",
    "write_output",
    "write_owned_file",
]
