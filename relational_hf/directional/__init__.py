"""Directional decomposition (DESIGN.md section 3): split every update y a layer writes into the part parallel to a
reference z and the perpendicular rest, measure it, edit it, and use it to diagnose compression.

- `sites`: where updates are read and edited (forward hooks on the adapter's roles; the eager attention kernel);
- `statistics`, `decompose`: what is measured, per layer and site;
- `edits`, `evaluation`: `scale_components` and the perplexity sweeps (all layers at once, or one layer at a time);
- `replay`: `CleanPass`, the unedited pass kept so that an edit of layer l reruns only layers l..L-1;
- `compression`: the layer-local counterfactual error of a compressed model, split along the dense update, and the
  report that ranks compression settings by it (the compressors themselves: `relational_hf.compress.ops`);
- `plots`, `analysis`: figures and the whole analysis `relational-hf analyze` runs (`directional_analysis`).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers; at run time each is imported when first read
    from ..lm.data import lm_blocks as token_blocks
    from .analysis import directional_analysis
    from .compression import (
        CompressionReport,
        CompressionResult,
        LayerCompressionError,
        compression_error,
        compression_report,
    )
    from .decompose import collect_updates, decompose, decompose_dataset
    from .edits import scale_components
    from .evaluation import (
        LayerSweepResult,
        SweepResult,
        perplexity,
        sweep_all,
        sweep_components,
        sweep_layers,
        sweep_per_layer,
    )
    from .plots import plot_compression, plot_parallel_profile, plot_per_layer, plot_sweeps
    from .replay import CleanPass
    from .sites import EDIT_SITES, SITES, VALUE_SITES
    from .statistics import DirectionalReport, LayerStatistics

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "..lm.data": ("lm_blocks as token_blocks",),
        ".analysis": ("directional_analysis",),
        ".compression": (
            "CompressionReport",
            "CompressionResult",
            "LayerCompressionError",
            "compression_error",
            "compression_report",
        ),
        ".decompose": ("collect_updates", "decompose", "decompose_dataset"),
        ".edits": ("scale_components",),
        ".evaluation": (
            "LayerSweepResult",
            "SweepResult",
            "perplexity",
            "sweep_all",
            "sweep_components",
            "sweep_layers",
            "sweep_per_layer",
        ),
        ".plots": ("plot_compression", "plot_parallel_profile", "plot_per_layer", "plot_sweeps"),
        ".replay": ("CleanPass",),
        ".sites": ("EDIT_SITES", "SITES", "VALUE_SITES"),
        ".statistics": ("DirectionalReport", "LayerStatistics"),
    },
)

__all__ = [
    "EDIT_SITES",
    "SITES",
    "VALUE_SITES",
    "CompressionReport",
    "CleanPass",
    "CompressionResult",
    "DirectionalReport",
    "LayerCompressionError",
    "LayerSweepResult",
    "LayerStatistics",
    "SweepResult",
    "collect_updates",
    "compression_error",
    "compression_report",
    "decompose",
    "decompose_dataset",
    "directional_analysis",
    "perplexity",
    "plot_compression",
    "plot_parallel_profile",
    "plot_per_layer",
    "plot_sweeps",
    "scale_components",
    "sweep_all",
    "sweep_components",
    "sweep_layers",
    "sweep_per_layer",
    "token_blocks",
]
