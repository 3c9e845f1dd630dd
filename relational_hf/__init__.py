"""relational-hf: symmetry reduction and directional decomposition for Hugging Face Transformers.

``import relational_hf`` registers the "relational-transformer" architecture with AutoConfig, AutoModel,
AutoModelForCausalLM and AutoModelForSequenceClassification.
"""

from ._lazy import lazy_exports
from .modeling import (
    RelationalConfig,
    RelationalForCausalLM,
    RelationalForSequenceClassification,
    RelationalModel,
    RelationalPreTrainedModel,
)
from .registration import register

register()

__version__ = "0.1.0"


# The toolkits and the trainer pull in more dependencies: each is imported when first read (any subpackage, e.g.
# `relational_hf.directional`, is an attribute too).
__getattr__, __dir__ = lazy_exports(__name__, {".training": ("RelationalTrainer", "RelationalTrainingArguments")})


__all__ = [
    "RelationalConfig",
    "RelationalModel",
    "RelationalForCausalLM",
    "RelationalForSequenceClassification",
    "RelationalPreTrainedModel",
    "RelationalTrainer",
    "RelationalTrainingArguments",
    "register",
]
