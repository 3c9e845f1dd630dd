"""Training dynamics on the quotient (DESIGN.md 2.3): record where a run moves, in raw and in invariant coordinates,
and how much of its motion is pure gauge.

- `recorder`   `QuotientTrajectoryCallback` (a Transformers `TrainerCallback`) and the loop-agnostic
               `QuotientRecorder` behind it; `ParameterSketch`, the fixed random sketch of parameters;
- `trajectory` the file of one run (`load_trajectory` needs no model) and the quantities computed from it:
               path lengths, gauge share, distances between runs;
- `plots`      the figures (`relational-hf dynamics` draws them).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers; at run time each is imported when first read
    from .plots import plot_all, plot_distance_travelled, plot_seed_distances, plot_trajectories, plot_vertical_share
    from .recorder import DEFAULT_EVERY, ParameterSketch, QuotientRecorder, QuotientTrajectoryCallback, uses_projection
    from .trajectory import (
        TRAJECTORY_NAME,
        Trajectory,
        coordinate_distances,
        descriptor_vector,
        final_distances,
        find_trajectories,
        load_trajectory,
        relative_distance,
        save_trajectory,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".plots": (
            "plot_all",
            "plot_distance_travelled",
            "plot_seed_distances",
            "plot_trajectories",
            "plot_vertical_share",
        ),
        ".recorder": (
            "DEFAULT_EVERY",
            "ParameterSketch",
            "QuotientRecorder",
            "QuotientTrajectoryCallback",
            "uses_projection",
        ),
        ".trajectory": (
            "TRAJECTORY_NAME",
            "Trajectory",
            "coordinate_distances",
            "descriptor_vector",
            "final_distances",
            "find_trajectories",
            "load_trajectory",
            "relative_distance",
            "save_trajectory",
        ),
    },
)

__all__ = [
    "DEFAULT_EVERY",
    "TRAJECTORY_NAME",
    "ParameterSketch",
    "QuotientRecorder",
    "QuotientTrajectoryCallback",
    "Trajectory",
    "coordinate_distances",
    "descriptor_vector",
    "final_distances",
    "find_trajectories",
    "load_trajectory",
    "plot_all",
    "plot_distance_travelled",
    "plot_seed_distances",
    "plot_trajectories",
    "plot_vertical_share",
    "relative_distance",
    "save_trajectory",
    "uses_projection",
]
