"""Standard checkpoints -> relational models (DESIGN.md 2.2 and 4).

- `relational`  `to_relational`: exact conversion of Llama / Mistral / Qwen2 into the pivot gauge, self-verified;
- `slicing`     principal gauge of the residual stream from calibration activations and SliceGPT-style slicing;
- `streaming`   `stream_to_relational`: the same conversion one decoder layer at a time from safetensors shards;
- `export`      relational models -> plain `LlamaForCausalLM` checkpoints (`relational-hf export`).
"""

from .export import ExportError, ExportReport, export_checkpoint, to_llama
from .relational import ConversionError, ConversionReport, max_logit_difference, relational_config_for, to_relational
from .slicing import SliceReport, principal_basis, residual_covariance, slice_relational
from .streaming import stream_to_relational

__all__ = [
    "ConversionError",
    "ConversionReport",
    "ExportError",
    "ExportReport",
    "SliceReport",
    "export_checkpoint",
    "max_logit_difference",
    "principal_basis",
    "relational_config_for",
    "residual_covariance",
    "slice_relational",
    "stream_to_relational",
    "to_llama",
    "to_relational",
]
