"""Single files written atomically, and the fingerprints the ownership manifests record (`relational_hf.outputs`)."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` through a temporary sibling that is fsynced and renamed over it; creates the parent
    folder. A reader sees the old file or the new one, never half of one; a failure leaves the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{TAG}-tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():
            shutil.copymode(path, tmp)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def fingerprint(path: str | os.PathLike) -> dict:
    """{"size", "sha256"} of a file up to `HASH_LIMIT`, {"size", "mtime_ns"} of a larger one."""
    stat = os.stat(path)
    if stat.st_size > HASH_LIMIT:
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": stat.st_size, "sha256": digest.hexdigest()}


__all__ = ["HASH_LIMIT", "TAG", "atomic_write_bytes", "atomic_write_text", "fingerprint", "fsync_dir"]
