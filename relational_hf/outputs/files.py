"""Single files written atomically, and the fingerprints the ownership manifests record (`relational_hf.outputs`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from stat import S_ISREG

#: files up to this size are fingerprinted by their SHA-256, larger ones by size and modification time
HASH_LIMIT = 64 * 2**20
TAG = "relational-hf"


def fsync_dir(folder: Path) -> None:
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


#: how the writers we use say "disk full" when they drop the errno: Python and Rust (safetensors, tokenizers) texts
_FULL_DISK_TEXTS = ("no space left on device", "os error 28", "storagefull", "disk quota exceeded", "os error 122")
#: torch's zip writer reports a failed write without the errno; with this little space left, the disk was full
_TORCH_WRITE_FAILURES = ("inline_container", "pytorchstreamwriter", "file write failed")
_LOW_SPACE = 4 * 2**20


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes free to this user on the file system holding `path` (its nearest existing ancestor); None if unknown."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return stat.f_bavail * stat.f_frsize


def is_disk_full(err: BaseException, folder: str | os.PathLike | None = None) -> bool:
    """True when `err` (or an exception it was raised from) says the device is full (ENOSPC, EDQUOT, or the text
    safetensors, tokenizers or Python give for it), or is torch's errno-less write failure while the file system of
    `folder` has almost no space left."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(current).lower()
        if any(words in text for words in _FULL_DISK_TEXTS):
            return True
        if folder is not None and any(words in text for words in _TORCH_WRITE_FAILURES):
            free = free_bytes(folder)
            if free is not None and free < _LOW_SPACE:
                return True
        current = current.__cause__ or current.__context__
    return False


class DiskFullError(OSError):
    """A save that ran out of space (errno ENOSPC), reported in one line that says so and what was kept."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC


def disk_full_error(folder: str | os.PathLike, kept: str) -> DiskFullError:
    """The one message of a full disk: where the save was going, how much space is free, what was kept."""
    free = free_bytes(folder)
    room = f"; {free / 2**20:.1f} MiB free there" if free is not None else ""
    return DiskFullError(f"no space left on device while writing {folder}{room}. {kept}; free some space and rerun")


@contextlib.contextmanager
def reporting_disk_full(folder: str | os.PathLike, kept: str) -> Iterator[None]:
    """Turn any error of the block that means a full disk (`is_disk_full`) into `disk_full_error(folder, kept)` (one
    line, "no space left on device"); other errors pass unchanged."""
    try:
        yield
    except Exception as err:
        if isinstance(err, DiskFullError) or not is_disk_full(err, folder):
            raise
        raise disk_full_error(folder, kept) from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to the file `path` through a temporary sibling that is fsynced and renamed over it; creates the
    parent folder. A reader sees the old file or the new one, never half of one; a failure leaves the old file.
    The path follows `relational_hf.outputs.paths` (`files_only`): a symbolic link is resolved and its target
    written; a directory, FIFO, socket or device node there is refused (`UsageError`), never renamed over. Returns
    the path written (the link's target for a link)."""
    from .paths import file_target

    path = file_target(path, files_only=True).path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{TAG}-tmp-{secrets.token_hex(4)}")
    kept = f"{path.name} was not changed" if path.exists() else f"{path.name} was not written"
    try:
        with reporting_disk_full(path, kept):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with open(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        publish_file(tmp, path)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()
    fsync_dir(path.parent)
    return path


def default_file_mode() -> int:
    """The mode a new file gets from the process's umask (0o644 under the usual 0o022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def publish_file(tmp: Path, path: Path) -> None:
    """Rename the finished temporary file `tmp` over `path`, with the mode `path` had (a new file: the umask's
    default, not the temporary file's 0o600)."""
    if path.exists():
        shutil.copymode(path, tmp)
    else:
        os.chmod(tmp, default_file_mode())
    os.replace(tmp, path)


def give_default_modes(folder: Path) -> None:
    """Give every regular file below `folder` the umask's default mode: writers that stage through a private
    temporary file (safetensors' `save_file`, hence `save_pretrained`) leave 0o600, which would keep the rest of
    the user's group from reading a checkpoint whose other files they can read. Links are not followed, and a file
    with another hard link (which could be a file of the user's elsewhere) is left as it is."""
    mode = default_file_mode()
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            info = os.lstat(path)
            if S_ISREG(info.st_mode) and info.st_nlink == 1 and info.st_mode & 0o7777 != mode:
                os.chmod(path, mode)


def remove_empty_folders(folder: Path) -> None:
    """Remove every empty folder below `folder` (deepest first), never a file: a folder holding anything stays."""
    for root, dirs, _names in os.walk(folder, topdown=False):
        for name in dirs:
            try:
                os.rmdir(os.path.join(root, name))
            except OSError:
                pass


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def fingerprint(path: str | os.PathLike) -> dict:
    """{"size", "sha256"} of a file up to `HASH_LIMIT`, {"size", "mtime_ns"} of a larger one."""
    stat = os.stat(path)
    if not S_ISREG(stat.st_mode):  # a FIFO or a device is never opened (it could block, or read for ever)
        return {"size": stat.st_size, "mode": stat.st_mode}
    if stat.st_size > HASH_LIMIT:
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": stat.st_size, "sha256": digest.hexdigest()}


__all__ = [
    "HASH_LIMIT",
    "TAG",
    "DiskFullError",
    "atomic_write_bytes",
    "atomic_write_text",
    "disk_full_error",
    "fingerprint",
    "free_bytes",
    "fsync_dir",
    "is_disk_full",
    "reporting_disk_full",
]
