"""The relational-transformer model family (self-contained: these files travel to the Hub)."""

from .configuration_relational import RelationalConfig
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
]
