"""The one error type of the `relational-hf` commands.

`UsageError` is raised for a mistake the user can fix (a flag out of range, a missing or unreadable file, an output
directory that would be overwritten): `relational_hf.cli.main` prints it as ``relational-hf <cmd>: error: <message>``
and exits with status 2, without a traceback. It subclasses `ValueError`, so library callers that catch
`ValueError` keep working.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A user error with a message that names the flag or file and what is allowed."""


def invalid_config_error(err: BaseException, where: object = None) -> ValueError | None:
    """A one-line `ValueError` for a config that Transformers' strict validation refused (huggingface_hub's
    `StrictDataclassError`, e.g. `num_hidden_layers: "two"`), naming `where` (a checkpoint folder or file) and the
    field; None for any other error."""
    if not any(cls.__name__.startswith("StrictDataclass") for cls in type(err).__mro__):
        return None
    detail = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    place = f"{where}: the config.json there" if where is not None else "a model's config.json"
    return ValueError(f"{place} holds an invalid value ({detail}); correct that field of config.json")


__all__ = ["UsageError", "invalid_config_error"]
