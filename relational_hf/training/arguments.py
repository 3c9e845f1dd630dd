"""`RelationalTrainingArguments`: Transformers' `TrainingArguments` plus the quotient-optimisation and
parallel-suppression settings of DESIGN.md sections 2.3 and 3."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from transformers import TrainingArguments

Projection = Literal["none", "update"]
SuppressionSite = Literal["residual", "value"]
PROJECTIONS: tuple[str, ...] = get_args(Projection)
SUPPRESSION_SITES: tuple[str, ...] = get_args(SuppressionSite)


@dataclass
class RelationalTrainingArguments(TrainingArguments):
    """`TrainingArguments` with three more fields (all default to plain `Trainer` behaviour):

    - `symmetry_projection`: "none", or "update" to wrap the optimiser in `relational_hf.symmetry.ProjectedOptimizer`
      so that every step delta is replaced by its horizontal part delta - P_V(delta);
    - `parallel_suppression_coef`: lambda of the soft suppression term lambda * mean cos^2(y, z) added to the task
      loss (0 turns it off and installs no hook);
    - `parallel_suppression_site`: "residual" (y = attention output and MLP output, z = the hidden state entering
      that sublayer) or "value" (per head before W_O, y = o_t = sum_s A_ts v_s, z = v_t).
    """

    symmetry_projection: str = field(
        default="none",
        metadata={
            "help": "'update': project every optimizer update onto the horizontal space (no motion along symmetry "
            "orbits); 'none': plain optimizer.",
            "choices": list(PROJECTIONS),
        },
    )
    parallel_suppression_coef: float = field(
        default=0.0,
        metadata={"help": "lambda of the soft parallel-suppression term lambda * mean cos^2(y, z); 0 = off."},
    )
    parallel_suppression_site: str = field(
        default="residual",
        metadata={
            "help": "where cos^2(y, z) is taken: 'residual' (attention and MLP outputs vs the hidden state entering "
            "the sublayer) or 'value' (per-head attention output o_t vs the token's own value v_t).",
            "choices": list(SUPPRESSION_SITES),
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.symmetry_projection not in PROJECTIONS:
            raise ValueError(f"symmetry_projection must be one of {PROJECTIONS}, got {self.symmetry_projection!r}")
        if self.parallel_suppression_site not in SUPPRESSION_SITES:
            raise ValueError(
                f"parallel_suppression_site must be one of {SUPPRESSION_SITES}, got {self.parallel_suppression_site!r}"
            )
        if not 0.0 <= self.parallel_suppression_coef < math.inf:
            raise ValueError(
                f"parallel_suppression_coef must be a finite number >= 0, got {self.parallel_suppression_coef}"
            )


__all__ = ["PROJECTIONS", "SUPPRESSION_SITES", "Projection", "RelationalTrainingArguments", "SuppressionSite"]
