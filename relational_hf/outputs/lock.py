"""One writer per output folder: an exclusive lock on a sibling file for a whole run (`OutputLock`)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from ..errors import UsageError
from .files import TAG

logger = logging.getLogger(__name__)


def sibling(out: Path, purpose: str) -> Path:
    """The project's own sibling of the output folder `out`: `.NAME.relational-hf-PURPOSE`."""
    return out.with_name(f".{out.name}.{TAG}-{purpose}")


class OutputLock:
    """An exclusive, non-blocking `fcntl.flock` on the sibling file `.NAME.relational-hf-lock` of an output folder,
    held for a whole run (`with OutputLock(out): ...`). A second holder fails at once with `UsageError`. The
    operating system releases the lock if the process dies (the lock file then stays, harmless); a normal exit
    removes the file while still holding the lock, and a taker checks after locking that the file it locked is still
    the one at the path. A command that holds the lock for its whole run passes it to `write_output(lock=...)`."""

    def __init__(self, output_dir: str | os.PathLike, *, wait: bool = False) -> None:
        self.out = Path(os.path.realpath(output_dir))
        self.path = sibling(self.out, "lock")
        self.wait = wait  # block until the other holder is done instead of failing (shared caches)
        self._fd: int | None = None
        self.held = False

    def __enter__(self) -> OutputLock:
        try:
            import fcntl
        except ImportError:  # not a POSIX system: no lock, said once
            logger.warning("file locking is not available on this platform: %s is not locked", self.out)
            self.held = True
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
                fcntl.flock(fd, fcntl.LOCK_EX if self.wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise UsageError(
                        f"{self.out} is in use by another relational-hf run (lock {self.path.name} held); wait for it "
                        "to finish or choose another output folder"
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
        self.held = True
        return self

    def __exit__(self, *exc) -> None:
        self.held = False
        if self._fd is not None:
            import fcntl

            try:
                os.unlink(self.path)  # while still locked: a waiting taker sees the inode change and retries
            except FileNotFoundError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


__all__ = ["OutputLock", "sibling"]
