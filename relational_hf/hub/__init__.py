"""Model cards and publishing to the Hugging Face Hub."""

from .card import build_model_card
from .publish import push_checkpoint, validate_checkpoint_dir

__all__ = ["build_model_card", "push_checkpoint", "validate_checkpoint_dir"]
