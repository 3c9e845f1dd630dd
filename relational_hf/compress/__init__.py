"""Compression of causal LMs in relational coordinates (DESIGN.md 2.2a): `compress_model` and its methods."""

from .api import METHODS, compress_model
from .baselines import prune_to_target, slicegpt, wanda_feature_norms
from .eval import ModelGrewError, check_not_grown, perplexity_on_windows, stored_parameters, text_windows
from .heal import heal
from .lowrank import LowRankOptions, compress_relational, plan_widths, qk_pair_scores, qk_truncate, vo_truncate

__all__ = [
    "ModelGrewError",
    "check_not_grown",
    "perplexity_on_windows",
    "prune_to_target",
    "slicegpt",
    "stored_parameters",
    "text_windows",
    "wanda_feature_norms",
    "METHODS",
    "LowRankOptions",
    "compress_model",
    "compress_relational",
    "heal",
    "plan_widths",
    "qk_pair_scores",
    "qk_truncate",
    "vo_truncate",
]
