"""Standard checkpoints -> relational models (DESIGN.md 2.2 and 4).

- `relational`  `to_relational`: exact conversion of Llama / Mistral / Qwen2 into the pivot gauge, self-verified;
- `slicing`     principal gauge of the residual stream from calibration activations and SliceGPT-style slicing;
- `cli`         the `relational-hf convert` command's hooks.
"""

from .cli import add_convert_arguments, run_convert
from .relational import ConversionError, ConversionReport, max_logit_difference, relational_config_for, to_relational
from .slicing import SliceReport, principal_basis, residual_covariance, slice_relational

__all__ = [
    "ConversionError",
    "ConversionReport",
    "SliceReport",
    "add_convert_arguments",
    "max_logit_difference",
    "principal_basis",
    "relational_config_for",
    "residual_covariance",
    "run_convert",
    "slice_relational",
    "to_relational",
]
