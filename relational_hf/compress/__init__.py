"""Compression of causal LMs (DESIGN.md 2.2a): the mathematics, with no conversion and no training in it.

- `ops`: quantisation and pruning of the decoder layers' weights (`quantize_weights`, `prune_weights`,
  `compress_weights` by setting name, as a copy; `compressed_view`: the model itself computing compressed, layer by
  layer when a device map offloads it; magnitude and Wanda scores, unstructured and N:M masks);
- `slicing`: the principal gauge of the residual stream and slicing of a relational model (`slice_relational`);
- `lowrank`, `truncation`, `sensitivity`: the relational method, activation-aware truncation of the invariants with a
  budget planned by measured sensitivity (`compress_relational`);
- `baselines`: magnitude and Wanda pruning to a target share, a reimplementation of SliceGPT;
- `eval`: stored parameters, evaluation windows of a text, perplexity on them;
- `distill`: the text a source model samples itself, the data of repair by distillation.

The package sits below `directional` (whose compression diagnostics measure what these operations do), `convert`
and `training`, and imports none of them. The job that converts, compresses and heals is
`relational_hf.jobs.compress_model`; healing itself is `relational_hf.training.heal`.
"""

from .baselines import prune_to_target, slicegpt, wanda_feature_norms
from .eval import ModelGrewError, check_not_grown, perplexity_on_windows, stored_parameters, text_windows
from .lowrank import compress_relational, plan_widths, qk_pair_scores, qk_truncate, vo_truncate
from .ops import (
    COMPRESSION_SETTINGS,
    compress_weights,
    compressed_view,
    fake_quantize,
    prune_weights,
    pruning_mask,
    quantize_weights,
)
from .options import LowRankOptions
from .slicing import SliceReport, principal_basis, residual_covariance, slice_relational

__all__ = [
    "COMPRESSION_SETTINGS",
    "LowRankOptions",
    "ModelGrewError",
    "SliceReport",
    "check_not_grown",
    "compress_relational",
    "compress_weights",
    "compressed_view",
    "fake_quantize",
    "perplexity_on_windows",
    "plan_widths",
    "principal_basis",
    "prune_to_target",
    "prune_weights",
    "pruning_mask",
    "qk_pair_scores",
    "qk_truncate",
    "quantize_weights",
    "residual_covariance",
    "slice_relational",
    "slicegpt",
    "stored_parameters",
    "text_windows",
    "vo_truncate",
    "wanda_feature_norms",
]
