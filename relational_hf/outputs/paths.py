"""The one rule for a file path a command writes (`--json`, `--png`, a report, every file of an output folder).

What the path names decides how it is written, and the same classification (`file_target`) runs twice: before any
work (`check_output_file`, which also checks that the file can be written) and again at the write (`write_file`):

- **a regular file, or nothing yet**: written atomically (a temporary sibling, fsynced, renamed over it; the parent
  folder is created). A reader sees the old file or the new one, never half of one.
- **a symbolic link**: resolved, and its target written by this same rule (a link to a regular file: the file is
  replaced and the link kept; a dangling link: its target is created; a link to `/dev/stdout`: a stream). A link
  loop is refused.
- **`-`, a character device or a FIFO** (`/dev/stdout`, `/dev/null`, a named pipe a reader waits on): written
  through as a stream, never renamed over; a path that is this process's own stdout or stderr (also a `/dev/stdout`
  redirected into a file) is written through that stream.
- **anything else** (a directory where a file is expected, a socket, a block device): refused, before any work.

Nothing that is not a regular file is ever renamed over, moved or removed. Inside an output folder (`files_only`),
where the user did not name the file, a stream is refused too: a FIFO or a device node there is the user's, never
opened (`relational_hf.outputs.folders`).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

#: the path that means "standard output"
STDOUT = "-"


@dataclass(frozen=True)
class FileTarget:
    """Where a write of `given` goes: `path`, atomically (`stream` None), or a stream: "stdout" / "stderr" (this
    process's own) or "path" (a character device or FIFO opened for writing at `path`)."""

    given: str
    path: Path | None
    stream: str | None = None

    @property
    def is_stream(self) -> bool:
        return self.stream is not None

    def describe(self) -> str:
        return {"stdout": "standard output", "stderr": "standard error"}.get(self.stream or "", str(self.path))


def _label(given: str, flag: str | None) -> str:
    return f"{flag} {given}" if flag else given


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def _same_as_fd(st: os.stat_result, fd: int) -> bool:
    """True when `st` is the file (pipe, terminal, regular file) that this process's descriptor `fd` writes to."""
    try:
        other = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _writable_parent(path: Path, label: str) -> None:
    """`UsageError` unless the nearest existing ancestor of `path` is a folder this process may create files in."""
    parent = path.parent
    while True:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            if parent.parent == parent:
                break
            parent = parent.parent
            continue
        except OSError as err:
            raise UsageError(f"{label}: cannot reach {parent} ({err.strerror})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{label}: {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(
                f"{label}: the folder {parent} is not writable (permission denied or a read-only file system); "
                "choose another path (nothing was written)"
            )
        return


def file_target(path: str | os.PathLike, flag: str | None = None, *, files_only: bool = False) -> FileTarget:
    """Classify the output file `path` by the module's rule; `UsageError` (naming `flag` and the path) for what may
    not be written there: a directory, a socket, a block device, a symbolic-link loop, a path through a file, a
    folder that is not writable; and with `files_only` also `-`, a FIFO and a device (inside an output folder)."""
    given = os.fspath(path)
    label = _label(given, flag)
    if not given.strip():
        raise UsageError(f"{flag or 'output file'}: empty path")
    if given == STDOUT:
        if files_only:
            raise UsageError(f"{label}: standard output is not a file of an output folder")
        return FileTarget(given, None, "stdout")
    expanded = os.path.expanduser(given)
    try:
        st = os.stat(expanded)  # follows links, also /proc's magic links (/dev/stdout -> pipe:[...])
    except FileNotFoundError:
        st = None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UsageError(f"{label}: a symbolic link loop; give a file name (nothing was written)") from None
        if err.errno == errno.ENOTDIR:
            raise UsageError(f"{label}: a part of the path is not a directory") from None
        raise UsageError(f"{label}: cannot reach the path ({err.strerror})") from None
    if st is not None and not files_only:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            if _same_as_fd(st, fd):  # /dev/stdout, also redirected into a file: write through the stream, in order
                return FileTarget(given, Path(expanded), name)
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            if files_only:
                raise UsageError(
                    f"{label}: a {'FIFO' if stat.S_ISFIFO(st.st_mode) else 'device node'} of the user's where the "
                    "output writes a file; it is never opened or replaced: move it away or choose another folder "
                    "(nothing was changed)"
                )
            if not os.access(expanded, os.W_OK):
                raise UsageError(f"{label}: not writable (permission denied)")
            return FileTarget(given, Path(expanded), "path")
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{label}: is a directory; give a file name (nothing was written)")
        raise UsageError(
            f"{label}: is {_kind(st.st_mode)}; give a regular file, a new path, a FIFO, a character device such as "
            "/dev/stdout, or - for standard output (nothing was written)"
        )
    resolved = Path(os.path.realpath(expanded))  # a symbolic link: its target is written, the link kept
    _writable_parent(resolved, label)
    return FileTarget(given, resolved)


def check_writable_folder(folder: str | os.PathLike, label: str) -> None:
    """Before any work: an output folder `folder` (and the lock and staging folders beside it) can be written: its
    nearest existing ancestor is a writable folder, and so is `folder` itself where it exists."""
    folder = Path(folder)
    _writable_parent(folder, label)
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(
            f"{label}: the folder is not writable (permission denied or a read-only file system); choose another "
            "folder (nothing was written)"
        )


def check_output_file(path: str | os.PathLike | None, flag: str) -> FileTarget | None:
    """Before any work: `file_target(path, flag)` (None for no path)."""
    return None if path is None else file_target(path, flag)


def _write_stream(target: FileTarget, data: bytes) -> None:
    if target.stream in ("stdout", "stderr"):
        stream = sys.stdout if target.stream == "stdout" else sys.stderr
        stream.flush()
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            buffer.write(data)
            buffer.flush()
        else:  # a text-only stream (e.g. captured in tests)
            stream.write(data.decode("utf-8", errors="replace"))
            stream.flush()
        return
    sys.stdout.flush()  # what the command printed before comes first where the device is the terminal
    fd = os.open(target.path, os.O_WRONLY | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def write_file(
    path: str | os.PathLike, data: str | bytes, flag: str | None = None, *, files_only: bool = False
) -> FileTarget:
    """Write `data` (text as UTF-8) to `path` by the module's rule (classified again now: the path may have changed
    since the check); returns where it went. A full device (`/dev/full`) raises the project's "no space left on
    device" error."""
    from .files import atomic_write_bytes, reporting_disk_full

    payload = data.encode("utf-8") if isinstance(data, str) else data
    target = file_target(path, flag, files_only=files_only)
    if not target.is_stream:
        atomic_write_bytes(target.path, payload)
        return target
    with reporting_disk_full(target.path or ".", f"{target.describe()} received only part of the output"):
        _write_stream(target, payload)
    return target


def save_figure(fig, path: str | os.PathLike, flag: str | None = None, *, files_only: bool = True, **kwargs) -> Path:
    """`fig.savefig` by the module's rule: the image is rendered in memory (its format from the suffix, PNG by
    default) and written with `write_file` (`files_only`: a file of an output folder, no stream). Returns `path`."""
    import io

    suffix = Path(os.fspath(path)).suffix.lstrip(".").lower()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=kwargs.pop("format", None) or suffix or "png", **kwargs)
    write_file(path, buffer.getvalue(), flag, files_only=files_only)
    return Path(path)


def wrote_line(target: FileTarget) -> str:
    """The line a command prints after `write_file`: "wrote PATH" (on standard error when the output went to
    standard output, so that the stream holds the file's content alone)."""
    return f"wrote {target.describe()}\n"


def say_wrote(target: FileTarget) -> None:
    """Print `wrote_line(target)` on stdout, or on stderr when the file itself was written to a stream."""
    (sys.stderr if target.is_stream else sys.stdout).write(wrote_line(target))


__all__ = [
    "STDOUT",
    "FileTarget",
    "check_output_file",
    "check_writable_folder",
    "file_target",
    "save_figure",
    "say_wrote",
    "write_file",
    "wrote_line",
]
