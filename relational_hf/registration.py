"""Register the relational-transformer architecture with the Auto classes and Transformers' static name tables."""

from __future__ import annotations

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .modeling import (
    RelationalConfig,
    RelationalForCausalLM,
    RelationalForSequenceClassification,
    RelationalModel,
)
from .modeling.modeling_relational import register_static_names

MODEL_TYPE = RelationalConfig.model_type

# The code files a checkpoint carries, and the class each Auto class loads from them (``trust_remote_code``).
AUTO_MAP = {
    "AutoConfig": "configuration_relational.RelationalConfig",
    "AutoModel": "modeling_relational.RelationalModel",
    "AutoModelForCausalLM": "modeling_relational.RelationalForCausalLM",
    "AutoModelForSequenceClassification": "modeling_relational.RelationalForSequenceClassification",
}


def register() -> None:
    """Register config and models with the Auto classes (idempotent).

    `Auto*.register` does not fill Transformers' static name tables, which decide some generic behaviour by class
    name; the modeling file fills them on import (`register_static_names`, so that a ``trust_remote_code`` load gets
    them too) and this calls it again (idempotent).
    """
    AutoConfig.register(MODEL_TYPE, RelationalConfig, exist_ok=True)
    AutoModel.register(RelationalConfig, RelationalModel, exist_ok=True)
    AutoModelForCausalLM.register(RelationalConfig, RelationalForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(RelationalConfig, RelationalForSequenceClassification, exist_ok=True)
    register_static_names()
    # save_pretrained copies the code files next to the weights and writes `auto_map` for every Auto class.
    RelationalConfig.register_for_auto_class()
    RelationalModel.register_for_auto_class("AutoModel")
    RelationalForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    RelationalForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
