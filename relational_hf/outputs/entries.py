"""What an existing output folder holds that a save could not keep where it is, found before any work: mount points,
symbolic-link loops, read-only sub-folders (`check_folder_entries`); FIFOs, sockets and device nodes, which the save
keeps by a hard link and never opens (`special_kind`)."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from ..errors import UsageError


def _inside(path: Path, folder: Path) -> bool:
    return os.path.normpath(path).startswith(os.path.normpath(folder) + os.sep)


def mount_points() -> list[Path]:
    """The mount points of this process's mount namespace (`/proc/self/mountinfo`; [] where it cannot be read)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    points = []
    for line in lines:
        fields = line.split()
        if len(fields) > 4:  # octal escapes: \040 a space, \011 a tab, \012 a newline, \134 a backslash
            points.append(Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])))
    return points


def special_kind(mode: int) -> str | None:
    """ "a FIFO", "a socket", "a device node" for such a file mode; None for any other."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device node"),
                       (stat.S_ISBLK, "a device node")):  # fmt: skip
        if test(mode):
            return name
    return None


def check_folder_entries(out: Path, label: str, *, swaps: bool = True) -> None:
    """Before any work, the entries of an existing output folder `out` that a save could not keep where they are,
    refused in one line naming the first (`UsageError`, nothing changed). For a save that swaps the folder
    (`swaps`): a mount point (`out` itself or one inside it: the exchange of the folder would move it), a symbolic
    link that loops, a sub-folder this process cannot write or read (the old entries could not be retired from it).
    FIFOs, sockets and device nodes are the user's and are kept (linked, never opened, never moved); one at a name
    the output writes is refused when the names are known (`check_owned_names`, `_carry_over`). A folder that is
    only written into (`swaps` False) must be writable itself."""
    if not out.is_dir():
        return
    if not os.access(out, os.W_OK | os.X_OK | os.R_OK):
        raise UsageError(f"{label}: the folder is not writable (permission denied); choose another folder")
    if not swaps:
        return
    inside = [m for m in mount_points() if m == out or _inside(m, out)]
    if inside:
        where = "is a mount point" if inside[0] == out else f"holds the mount point {inside[0]}"
        raise UsageError(
            f"{label} {where}; a save replaces the folder in one atomic exchange, which would move the mount: "
            f"choose {'a sub-folder of it' if inside[0] == out else 'another folder'} (nothing was changed)"
        )
    device = out.stat().st_dev
    for root, dirs, names in os.walk(out, onerror=_raise):
        base = Path(root)
        for name in [*dirs, *names]:
            path = base / name
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                try:
                    os.stat(path)
                except OSError as err:
                    if err.errno == errno.ELOOP:
                        raise UsageError(
                            f"{label}: {path} is a symbolic link that loops; remove or fix it, or choose another "
                            "folder (nothing was changed)"
                        ) from None
            elif stat.S_ISDIR(st.st_mode):
                if st.st_dev != device:
                    raise UsageError(
                        f"{label} holds the mount point {path}; a save replaces the folder in one atomic exchange, "
                        "which would move the mount: choose another folder (nothing was changed)"
                    )
                if not os.access(path, os.W_OK | os.X_OK | os.R_OK):
                    raise UsageError(
                        f"{label}: the sub-folder {path} is read-only (or unreadable) for this user; a save must "
                        "relink the files in it: make it writable or choose another folder (nothing was changed)"
                    )


def _raise(err: OSError) -> None:
    raise UsageError(f"cannot read the output folder entry {err.filename} ({err.strerror}); nothing was changed")


__all__ = ["check_folder_entries", "mount_points", "special_kind"]
