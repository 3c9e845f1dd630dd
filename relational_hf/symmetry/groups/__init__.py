"""Continuous symmetry groups of a model's weights as stored (DESIGN.md 2.1), built through the architecture adapter.

One file per family of groups; every name is importable from here (`from relational_hf.symmetry.groups import X`):
- `base`          the `SymmetryGroup` interface, parameter-space vectors (`ParamDict`) and Lie-algebra elements
                  (`Algebra`);
- `heads`         `QKGauge`, `VOGauge`, `QKNormGainExchange` (head-space gauges);
- `scaling`       `NormGain`, `MLPScale` (tori of positive scalings);
- `translations`  `KeyBiasShift`, `ValueBiasFold`, `LayerNormBiasShift`, `CentringTranslation`,
                  `ReaderCentringTranslation`, `CentringBiasExchange`, `ParallelBiasExchange`;
- `residual`      `ResidualRotation` and the `ResidualReader`s it acts through;
- `builder`       `symmetry_groups(model)`: which groups hold for a model, and notes on what breaks the others.
"""

from .base import Algebra, ParamDict, SymmetryGroup
from .builder import symmetry_groups
from .heads import QKGauge, QKNormGainExchange, VOGauge
from .residual import ResidualReader, ResidualRotation
from .scaling import MLPScale, NormGain
from .translations import (
    CentringBiasExchange,
    CentringTranslation,
    KeyBiasShift,
    LayerNormBiasShift,
    ParallelBiasExchange,
    ReaderCentringTranslation,
    ValueBiasFold,
)

__all__ = [
    "Algebra",
    "CentringBiasExchange",
    "CentringTranslation",
    "KeyBiasShift",
    "LayerNormBiasShift",
    "MLPScale",
    "NormGain",
    "ParallelBiasExchange",
    "ParamDict",
    "QKGauge",
    "QKNormGainExchange",
    "ReaderCentringTranslation",
    "ResidualReader",
    "ResidualRotation",
    "SymmetryGroup",
    "VOGauge",
    "ValueBiasFold",
    "symmetry_groups",
]
