"""Compression of causal LMs in relational coordinates (DESIGN.md 2.2a): `compress_model` and its methods."""

from .api import METHODS, compress_model
from .heal import heal
from .lowrank import LowRankOptions, compress_relational, plan_widths, qk_pair_scores, qk_truncate, vo_truncate

__all__ = [
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
