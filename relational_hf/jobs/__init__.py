"""Jobs: library entry points that compose the packages below them into one call.

- `compress`: `compress_model`, a causal LM converted to relational coordinates (`convert`), compressed to a share of
  its stored parameters (`compress`) and optionally healed by a LoRA fine-tune (`training.heal`), with its report;
  `compress_checkpoint`, the same compression of a safetensors checkpoint one decoder layer in memory at a time.

The package sits above `convert`, `compress` and `training` and is imported by no library package below it.
"""

from .compress import METHODS, compress_checkpoint, compress_model

__all__ = ["METHODS", "compress_checkpoint", "compress_model"]
