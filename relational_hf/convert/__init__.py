"""Standard checkpoints -> relational models (DESIGN.md 2.2 and 4).

- `relational`  `to_relational`: exact conversion of Llama / Mistral / Qwen2 into the pivot gauge, self-verified
                (optionally followed by principal-gauge slicing, `relational_hf.compress.slicing`);
- `streaming`   `stream_to_relational`: the same conversion one decoder layer at a time from safetensors shards;
- `export`      relational models -> plain `LlamaForCausalLM` checkpoints (`relational-hf export`).
"""

from .export import ExportError, ExportReport, export_checkpoint, to_free_gauge, to_llama
from .relational import ConversionError, ConversionReport, max_logit_difference, relational_config_for, to_relational
from .streaming import stream_to_relational

__all__ = [
    "ConversionError",
    "ConversionReport",
    "ExportError",
    "ExportReport",
    "export_checkpoint",
    "max_logit_difference",
    "relational_config_for",
    "stream_to_relational",
    "to_free_gauge",
    "to_llama",
    "to_relational",
]
