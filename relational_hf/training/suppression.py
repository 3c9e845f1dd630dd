"""Old import path of soft parallel suppression: the mathematics lives in `relational_hf.directional.suppression`,
next to the directional sites and statistics it reads. Kept so that `relational_hf.training.suppression.<name>`
keeps working."""

from ..directional.suppression import SITE_GROUPS, ParallelSuppression, SuppressionBatch, parallel_energy
from .trainer import token_positions

__all__ = ["SITE_GROUPS", "ParallelSuppression", "SuppressionBatch", "parallel_energy", "token_positions"]
