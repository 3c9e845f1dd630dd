"""Checks the commands run first, before any model is loaded or trained: each raises `UsageError` naming the flag
or file and what is wrong (value ranges are checked earlier, when the option dataclass is built)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import UsageError
from ..lm.data import check_text_file
from ..loading import check_model_argument, looks_like_local_path
from ..outputs.paths import check_output_file, check_writable_folder


def require(condition: bool, message: str) -> None:
    """Raise `UsageError(message)` unless `condition`."""
    if not condition:
        raise UsageError(message)


def output_folder(path: str | os.PathLike | None, flag: str) -> None:
    """An output folder option: it may not exist yet, but must not be a file, and it (or the folder it will be
    created in) must be writable: checked before any work."""
    if path is None:
        return
    if Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    check_writable_folder(os.path.realpath(os.path.expanduser(str(path))), f"{flag} {path}")


def output_file(path: str | os.PathLike | None, flag: str) -> None:
    """An output file option (`relational_hf.outputs.paths`): a regular file or a new path in a writable folder
    (written atomically, a symbolic link's target), `-`, a character device or a FIFO (written as a stream); a
    directory, a socket or a symbolic-link loop is refused, before any work."""
    check_output_file(path, flag)


def existing_folder(path: str | os.PathLike, flag: str) -> Path:
    """An input folder that must exist."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise UsageError(f"{flag} {path}: no such file or directory")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: not a directory")
    return folder


def dataset_source(name: str | None, flag: str = "--dataset") -> None:
    """A `datasets.load_dataset` name that can only be a local path must exist (else "no such file or directory",
    not a failed download)."""
    if name and looks_like_local_path(name) and not os.path.exists(os.path.expanduser(name)):
        raise UsageError(f"{flag} {name}: no such file or directory (and not a dataset name on the Hub)")


def text_or_ids(path: str | os.PathLike, flag: str) -> Path:
    """A `.pt` tensor of token ids or a `.safetensors` file of sampled text (either must exist) or a UTF-8 text file
    (`check_text_file`)."""
    path = Path(path).expanduser()
    if path.suffix in (".pt", ".safetensors"):
        if not path.is_file():
            raise UsageError(f"{flag} {path}: no such file")
        return path
    return check_text_file(path, flag)


#: the dtypes a tensor of token ids may have (bool, floating, complex and quantized tensors are refused)
TOKEN_ID_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
)


def token_id_tensor(ids: object, what: str) -> torch.Tensor:
    """The one check of a tensor given as token ids (`what` names the flag and file): a dense (strided) tensor of an
    integer dtype, returned flat as int64; else a `UsageError` that names the dtype or layout and what to save."""
    if not isinstance(ids, torch.Tensor):
        raise UsageError(f"{what}: expected a tensor of token ids, got {type(ids).__name__}")
    if ids.layout != torch.strided or ids.is_nested:
        raise UsageError(
            f"{what}: a {str(ids.layout).replace('torch.', '')} tensor; token ids must be a dense tensor: save "
            "ids.to_dense() instead"
        )
    if ids.dtype not in TOKEN_ID_DTYPES:
        raise UsageError(
            f"{what}: expected an integer tensor of token ids (int64, int32, ...), got {str(ids.dtype).replace('torch.', '')}"
            f"{' (booleans are not token ids)' if ids.dtype == torch.bool else ''}"
        )
    if ids.is_meta:
        raise UsageError(f"{what}: a tensor on the meta device holds no token ids")
    return ids.long().reshape(-1)


def read_token_ids(path: Path, tokenizer_of, flag: str) -> torch.Tensor:
    """The token ids of `path`: a `.pt` integer tensor as stored, or the text tokenised with `tokenizer_of()` (called
    only for text; an OSError / ValueError from it becomes a `UsageError` that suggests the .pt form)."""
    if path.suffix == ".pt":
        try:
            ids = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for a file that is not a tensor
            raise UsageError(f"{flag} {path}: not a tensor of token ids ({err})") from None
        return token_id_tensor(ids, f"{flag} {path}")
    try:
        tokenizer = tokenizer_of()
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(
            f"{flag} {path}: no tokenizer loads for the model ({err}); pass a .pt tensor of token ids"
        ) from None
    return torch.tensor(tokenizer(path.read_text(encoding="utf-8"))["input_ids"], dtype=torch.long)


def check_token_ids(ids: torch.Tensor, vocab: int, flag: str) -> torch.Tensor:
    """`ids` when every one is a row of the model's embedding, [0, vocab); else a UsageError naming `flag` (not an
    index error from inside torch)."""
    if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise UsageError(
            f"{flag}: token ids must lie in [0, {vocab}) for this model, got {int(ids.min())} to {int(ids.max())}"
        )
    return ids


__all__ = [
    "check_model_argument",
    "check_text_file",
    "check_token_ids",
    "dataset_source",
    "existing_folder",
    "output_file",
    "output_folder",
    "read_token_ids",
    "require",
    "text_or_ids",
    "token_id_tensor",
]
