"""The relational-transformer model family (self-contained: these files travel to the Hub)."""

from .configuration_relational import RelationalConfig
from .modeling_gauge import clear_weight_caches, weight_cache
from .modeling_relational import (
    GaugeFixedLinear,
    RelationalForCausalLM,
    RelationalForSequenceClassification,
    RelationalModel,
    RelationalPreTrainedModel,
)

__all__ = [
    "RelationalConfig",
    "RelationalModel",
    "RelationalForCausalLM",
    "RelationalForSequenceClassification",
    "RelationalPreTrainedModel",
    "GaugeFixedLinear",
    "clear_weight_caches",
    "weight_cache",
]
