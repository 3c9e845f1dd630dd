"""The one error type of the `relational-hf` commands.

`UsageError` is raised for a mistake the user can fix (a flag out of range, a missing or unreadable file, an output
directory that would be overwritten): `relational_hf.cli.main` prints it as ``relational-hf <cmd>: error: <message>``
and exits with status 2, without a traceback. It subclasses `ValueError`, so library callers that catch
`ValueError` keep working.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A user error with a message that names the flag or file and what is allowed."""


__all__ = ["UsageError"]
