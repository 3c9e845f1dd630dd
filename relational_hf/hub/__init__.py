"""Model cards and publishing to the Hugging Face Hub."""

from .card import build_model_card
from .publish import add_push_arguments, push_checkpoint, run_push, validate_checkpoint_dir

__all__ = ["add_push_arguments", "build_model_card", "push_checkpoint", "run_push", "validate_checkpoint_dir"]
