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


_SUBPACKAGES = (
    "architectures",
    "commands",
    "compress",
    "convert",
    "directional",
    "dynamics",
    "hub",
    "jobs",
    "lm",
    "outputs",
    "symmetry",
    "training",
)


def __getattr__(name: str):
    # Toolkits and the trainer pull in more dependencies; import them only when asked for.
    import importlib

    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in ("RelationalTrainer", "RelationalTrainingArguments"):
        return getattr(importlib.import_module(".training", __name__), name)
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
