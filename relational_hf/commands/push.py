"""Publish a checkpoint with a generated model card to the Hugging Face Hub.

    relational-hf push CHECKPOINT_DIR REPO_ID [--private] [--endpoint URL] [--token T] [--message M]

`relational_hf.hub.push_checkpoint` checks the folder (config.json + safetensors weights), stages the publishable
files beside a generated model card and uploads them in one commit. Tokens come from --token, HF_TOKEN or
`hf auth login` and never appear in logs, errors or the card.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError
from .checks import existing_folder
from .options import CommandArguments, NonEmptyStr, option, positional

HELP = "publish a checkpoint with a generated model card to the Hub"


@dataclass
class PushPaths:
    checkpoint_dir: str = positional(
        "directory written by save_pretrained() (config.json + *.safetensors)", "checkpoint_dir"
    )
    repo_id: str = positional("namespace/name on the Hub; a bare name goes under your account", "repo_id")


@dataclass
class PushOptions:
    _argument_group_name = "hub"

    private: bool = option(False, "create the repository as private")
    endpoint: str | None = option(None, "Hub URL (default: HF_ENDPOINT, else the public Hub)", metavar="URL")
    token: str | None = option(
        None,
        "access token (default: HF_TOKEN, else the stored `hf auth login`); prefer those, a token on the command line "
        "is visible to other users of the machine",
    )
    message: NonEmptyStr | None = option(None, "commit message (default: 'Upload checkpoint with relational-hf')")


@dataclass
class PushArguments(CommandArguments, PushOptions, PushPaths):
    POSITIONALS = PushPaths
    PARSER_GROUPS = (PushOptions,)


Arguments = PushArguments
LOG_LEVEL = "INFO"


def check(args: PushArguments) -> None:
    """The folder exists; the repository id and the endpoint are well formed."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    existing_folder(args.checkpoint_dir, "checkpoint_dir")
    try:
        validate_repo_id(args.repo_id)
    except HFValidationError as err:
        raise UsageError(f"repo_id: not a valid Hub repository id {args.repo_id!r}: {err}") from None
    if args.endpoint is not None:
        if not re.match(r"^https?://[^\s/]+", args.endpoint):
            raise UsageError(f"--endpoint: must be an http:// or https:// URL, got {args.endpoint!r}")
        args.endpoint = args.endpoint.rstrip("/")


def run(args: PushArguments) -> int:
    from ..hub import push_checkpoint

    check(args)
    push_checkpoint(
        args.checkpoint_dir,
        args.repo_id,
        private=args.private,
        endpoint=args.endpoint,
        token=args.token,
        commit_message=args.message,
    )
    return 0
