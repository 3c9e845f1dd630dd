"""relational-hf: symmetry reduction and directional decomposition for Hugging Face Transformers.

``import relational_hf`` registers the "relational-transformer" architecture with AutoConfig, AutoModel,
AutoModelForCausalLM and AutoModelForSequenceClassification.
"""

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


def __getattr__(name: str):
    # The trainer pulls in accelerate/datasets; import it only when asked for.
    if name in ("RelationalTrainer", "RelationalTrainingArguments"):
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module 'relational_hf' has no attribute {name!r}")


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
