"""Publishing a checkpoint directory to the Hugging Face Hub (`relational-hf push` runs `push_checkpoint`).

`push_checkpoint` checks the directory, stages it (symbolic links, so the user's directory is never
modified) with the model card as README.md, creates the repository if needed and uploads everything
in one commit with `HfApi.upload_folder` (with `hf_xet` installed, huggingface_hub splits only folders
of hundreds of files or over 100 MB of small files into several commits). Any failure on the way is raised as
`RuntimeError("upload to <repo> failed: ...")`; the access token never appears in logs, errors or card.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, get_token

from .card import build_model_card, read_config

logger = logging.getLogger(__name__)

DEFAULT_COMMIT_MESSAGE = "Upload checkpoint with relational-hf"
# Not published, at any depth: version-control and cache folders, Trainer state that only resuming needs (the
# trainer_state/ folder `relational-hf train` keeps, checkpoint-* folders, their set-aside incomplete-checkpoint-*),
# pickled files (optimizer, scheduler, RNG state, training arguments: loading a pickle runs code), and the ownership
# marker and lock files of `relational_hf.outputs`.
EXCLUDED_DIRS = (
    ".git",
    ".cache",
    ".huggingface",
    "__pycache__",
    "trainer_state",
    "checkpoint-*",
    "incomplete-checkpoint-*",
)
EXCLUDED_FILES = (
    "*.pt",
    "*.pth",
    "*.pkl",
    "*.pickle",
    "*.ckpt",
    "*.bin",
    ".relational-hf-output*",
    ".*.lock",
    ".DS_Store",
)


def is_excluded(relative: str) -> bool:
    """True when the file at `relative` (a POSIX path inside the checkpoint folder) is not published: some folder on
    its path matches `EXCLUDED_DIRS`, or its name matches `EXCLUDED_FILES` (module comment)."""
    *folders, name = relative.split("/")
    if any(fnmatch.fnmatch(part, pattern) for part in folders for pattern in EXCLUDED_DIRS):
        return True
    return any(fnmatch.fnmatch(name, pattern) for pattern in EXCLUDED_FILES)


def validate_checkpoint_dir(checkpoint_dir: str | Path) -> Path:
    """Check that `checkpoint_dir` holds a loadable checkpoint: a valid config.json and safetensors weights.

    Raises ValueError naming what is missing. With a sharded checkpoint, every shard named in
    `model.safetensors.index.json` must be present.
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {path} does not exist or is not a directory")
    read_config(path)
    if not any(path.glob("*.safetensors")):
        found = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(found)}: re-save with save_pretrained(), which writes safetensors)" if found else ""
        raise ValueError(f"{path} has no *.safetensors weights{hint}")
    from ..shards import SAFE_INDEX_NAME, checkpoint_files

    try:
        files, _ = checkpoint_files(path)
    except FileNotFoundError:
        return path  # safetensors weights under other names: Transformers decides whether it loads them
    missing = sorted(shard for shard in files if not (path / shard).is_file())
    if missing:
        raise ValueError(f"{path} is missing weight shards listed in {SAFE_INDEX_NAME}: {', '.join(missing)}")
    return path


def _stage(checkpoint_dir: Path, staging: Path, readme: str | None) -> None:
    """Mirror the publishable files of `checkpoint_dir` into `staging` and write the card as README.md."""
    for source in sorted(checkpoint_dir.rglob("*")):
        relative = source.relative_to(checkpoint_dir).as_posix()
        if not source.is_file() or is_excluded(relative):
            continue
        target = staging / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            target.symlink_to(source.resolve())
        except OSError:  # no symbolic links on this file system
            shutil.copy2(source, target)
    if readme is not None:
        (staging / "README.md").unlink(missing_ok=True)
        (staging / "README.md").write_text(readme, encoding="utf-8")


@contextmanager
def _upload_errors(repo_id: str, token: str) -> Iterator[None]:
    """Turn any failure of a Hub call into `RuntimeError("upload to <repo_id> failed: ...")`, token removed."""
    try:
        yield
    except Exception as err:
        # huggingface_hub wraps some HTTP errors (a failed LFS upload) in a RuntimeError: name new causes too.
        reason, cause = f"{type(err).__name__}: {err}", err.__cause__
        for _ in range(4):
            if cause is None:
                break
            if str(cause) not in reason:
                reason += f" (caused by {type(cause).__name__}: {cause})"
            cause = cause.__cause__
        raise RuntimeError(f"upload to {repo_id} failed: {reason.replace(token, '<token>')}") from err


def push_checkpoint(
    checkpoint_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    endpoint: str | None = None,
    token: str | None = None,
    card: ModelCard | str | None = None,
    commit_message: str | None = None,
) -> str:
    """Publish the checkpoint in `checkpoint_dir` as the model repository `repo_id`; return the commit URL.

    `repo_id` is `namespace/name`; a bare name goes under the account the token belongs to. The README is
    `card` when given, else the checkpoint's own README.md, else `build_model_card(checkpoint_dir, repo_id)`.
    The token is `token`, else HF_TOKEN, else the stored `hf auth login`; the endpoint is `endpoint`, else
    HF_ENDPOINT, else the public Hub. With `private=True` an existing public repository is refused rather
    than written to. Unchanged files are not re-sent; if nothing changed, the URL of the current head is
    returned. Raises ValueError for an unusable directory and RuntimeError for a failed upload.
    """
    checkpoint_dir = validate_checkpoint_dir(checkpoint_dir)
    token = token or get_token()
    if token is None:
        raise RuntimeError(
            f"upload to {repo_id} failed: no Hugging Face token found "
            "(pass --token, set HF_TOKEN, or run `hf auth login`)"
        )
    api = HfApi(endpoint=endpoint, token=token)
    if "/" not in repo_id:
        with _upload_errors(repo_id, token):
            repo_id = f"{api.whoami()['name']}/{repo_id}"
    if card is None and not (checkpoint_dir / "README.md").is_file():
        card = build_model_card(checkpoint_dir, repo_id)
    logger.info("Uploading %s to %s on %s", checkpoint_dir, repo_id, api.endpoint)
    with tempfile.TemporaryDirectory(prefix="relational-hf-push-") as staging:
        _stage(checkpoint_dir, Path(staging), None if card is None else str(card))
        with _upload_errors(repo_id, token):
            api.create_repo(repo_id, private=private, exist_ok=True)
            if private and not api.repo_info(repo_id).private:
                raise PermissionError(f"{repo_id} already exists and is public, but a private upload was asked for")
            commit = api.upload_folder(
                repo_id=repo_id, folder_path=staging, commit_message=commit_message or DEFAULT_COMMIT_MESSAGE
            )
    logger.info("Uploaded %s: %s", repo_id, commit.commit_url)
    return str(commit.commit_url)


__all__ = ["DEFAULT_COMMIT_MESSAGE", "is_excluded", "push_checkpoint", "validate_checkpoint_dir"]
