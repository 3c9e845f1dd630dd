"""Symmetry toolkit (DESIGN.md section 2): groups per architecture, redundancy report, invariants, canonical
gauges (dressing) and projected updates (optimisation on the quotient).

Where things are:
- `algebra`    Lie subalgebras (GL, RoPE commutant, CO), Sylvester/Lyapunov solves, balanced SVD, principal gauge;
- `groups`     one class per symmetry group, one file per family (heads, scaling, translations, residual), and
               `symmetry_groups(model)` (groups/builder.py), built through the architecture adapter;
- `report`     `redundancy_report(model)` and its plots; `invariants` the G_QK / G_VO descriptors;
- `canonical`  `canonicalize(model)` and `apply_random_symmetry(model)`; `canonical_stream` its streaming form
               `stream_canonicalize(src, out)` (one layer at a time from safetensors shards);
- `projection` `ProjectedOptimizer`, `UpdateProjector`, `vertical_horizontal_split`, `orbit_balance`, `orbit_drift`.
"""

from .canonical import CanonicalizationReport, apply_random_symmetry, canonicalize
from .canonical_stream import stream_canonicalize
from .groups import SymmetryGroup, symmetry_groups
from .invariants import HeadDescriptors, head_descriptors
from .projection import (
    ProjectedOptimizer,
    ProjectionStats,
    UpdateProjector,
    orbit_balance,
    orbit_drift,
    vertical_horizontal_split,
)
from .report import (
    RedundancyReport,
    plot_head_similarity,
    plot_redundancy_by_layer,
    redundancy_report,
    redundancy_report_from_config,
)

__all__ = [
    "CanonicalizationReport",
    "HeadDescriptors",
    "ProjectedOptimizer",
    "ProjectionStats",
    "RedundancyReport",
    "SymmetryGroup",
    "UpdateProjector",
    "apply_random_symmetry",
    "canonicalize",
    "head_descriptors",
    "orbit_balance",
    "orbit_drift",
    "plot_head_similarity",
    "plot_redundancy_by_layer",
    "redundancy_report",
    "redundancy_report_from_config",
    "stream_canonicalize",
    "symmetry_groups",
    "vertical_horizontal_split",
]
