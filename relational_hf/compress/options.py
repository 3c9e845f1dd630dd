"""The settings of the relational compression (`LowRankOptions`), what it reports (`LowRankResult`) and their
validation, shared by the in-memory (`compress.lowrank`) and streamed (`compress.streamed`) paths."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..modeling import RelationalConfig
from .budget import KINDS
from .refine import DEFAULT_REFINE_LR, RefineOptions, check_refine

SENSITIVITIES = ("fisher", "token", "relative", "uniform")
GAUGES = ("free", "pivot")
DEFAULT_REFIT_BLEND = 0.5  # the blend most layers chose on held-back windows (refit_holdout), on both splits


@dataclass
class LowRankOptions:
    """Settings of `compress_relational` (see its docstring)."""

    qk_step: int = 2  # pairs per grid step (rank step 2 * qk_step)
    vo_step: int = 4
    mlp_step: int = 64
    min_qk_pairs: int = 2
    min_vo_rank: int = 4
    min_mlp_units: int = 64
    plan_windows: int = 8  # calibration windows used to measure the error curves
    batch_size: int = 4
    # MLP down-projection refit target: "dense" (the dense model's next hidden states: also absorbs the error of all
    # compressed before it; best with 128 windows), "local" (dense MLP output; better with 16 windows) or "none"
    correction: str = "dense"
    ridge: float = 1e-2  # relative ridge of the refit: 1e-2 generalised better than 1e-3 on SmolLM2 (held-out text)
    vo_weighting: str = "mixed"  # VO weighting: "mixed" (attention-mixed values) or "input" (C = X^T X)
    kinds: tuple[str, ...] = KINDS
    # error currency of the plan: "fisher" (the predicted KL of the model's next-token distributions, from sampled
    # Fisher directions: one currency for every layer and kind, `compress.sensitivity`), "token" (each token's error
    # relative to its residual energy, what the next norm sees), "relative" (error / total residual energy of the
    # layer output) or "uniform" (plain error energy)
    sensitivity: str = "fisher"
    fisher_samples: int = 2  # label sets sampled per window for the Fisher directions (sensitivity="fisher")
    # with sensitivity="fisher": choose the VO subspace and rank the SwiGLU units by their error in the Fisher metric
    # of the sublayer's output (what the rest of the model reads) instead of the Euclidean norm
    fisher_metric: bool = False
    layer_weights: list[float] | None = None  # optional per-layer loss sensitivities multiplying the errors
    # order in which SwiGLU units are kept: "score" (each unit's balanced importance alone, `mlp_unit_scores`) or
    # "greedy" (forward selection for the refit, `greedy_unit_order`: sees the correlations between units; one more
    # d_ff x d_ff float64 matrix and O(d_ff^3) work per layer)
    mlp_order: str = "score"
    # calibration windows (the last ones) held back to choose each layer's refit: its ridge and its blend of the dense
    # and local targets, by the error on them (`truncation.choose_refit`); the refit then uses every window
    refit_holdout: int = 0
    # correction "dense" without refit_holdout: the refit's target is b x the dense trajectory's step + (1 - b) x the
    # dense MLP's output on the compressed stream (the local target); None: DEFAULT_REFIT_BLEND (`target_blend`)
    refit_blend: float | None = None
    # what the refit's ridge pulls W_down towards: "dense" (the kept units' own W_down columns: directions the
    # calibration text does not determine keep the source's weights; 1.2-1.6% lower held-out perplexity on both
    # splits at 25%) or "zero" (the plain ridge, shrinking them; the default before). The plan's error curves use the
    # plain ridge (one factorisation serves every prefix of units only with a prior that does not depend on it)
    refit_prior: str = "dense"
    # after the refit: epochs of Adam on each layer's kept SwiGLU maps (gate, up, down together) against the refit's
    # own target, the epoch kept by its error on the last `refine_holdout` windows (None: an eighth of them, at least
    # one), the closed form counting as epoch 0 (`compress.refine`); 0: the closed form alone
    refine_epochs: int = 0
    refine_lr: float = DEFAULT_REFINE_LR
    refine_holdout: int | None = None
    # the gauge of the compressed model, in which the budget is counted: "free" (every map a plain Linear holding the
    # full weight it computes with: inference reads the weights as stored) or "pivot" (the gauge-fixed relational
    # form: the pivot entries are not stored, so the same budget keeps a little more width, but a call assembles the
    # full weights from the free entries: slower on a CPU, `benchmarks/compress_speed.py`)
    gauge: str = "free"

    def refine_options(self, windows: int) -> RefineOptions:
        """The `refine.RefineOptions` of a compression on `windows` calibration windows."""
        held = max(1, windows // 8) if self.refine_holdout is None else self.refine_holdout
        return RefineOptions(epochs=self.refine_epochs, lr=float(self.refine_lr), held_out=held)

    def as_report(self) -> dict:
        """The settings as the compression report records them (JSON types), with the blend the refit used."""
        fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}
        return fields | {"refit_target_blend": self.target_blend()}

    def target_blend(self) -> float:
        """The share b of the dense trajectory's step in the refit's target: `refit_blend` (default
        DEFAULT_REFIT_BLEND) with correction "dense", 1 with "local" or "none" (one target) and with `refit_holdout`
        (which chooses b per layer)."""
        if self.correction != "dense" or self.refit_holdout:
            return 1.0
        return DEFAULT_REFIT_BLEND if self.refit_blend is None else float(self.refit_blend)


@dataclass
class LowRankResult:
    """What `compress_relational` chose and measured."""

    widths: dict[str, list[int]] = field(default_factory=dict)
    planned_parameters: int = 0
    budget: int = 0
    plan_seconds: float = 0.0
    compress_seconds: float = 0.0
    # per layer, with refit_holdout: the refit chosen (`choose_refit`); with refine_epochs: the refinement's record
    refits: list[dict[str, float]] = field(default_factory=list)


def _check(config: RelationalConfig, calibration: torch.Tensor, opts: LowRankOptions) -> None:
    """ValueError in one line for options, a model or calibration ids the compression cannot take (both paths)."""
    if opts.sensitivity not in SENSITIVITIES:
        raise ValueError(f"`sensitivity` must be one of {', '.join(SENSITIVITIES)}, got {opts.sensitivity!r}")
    if opts.gauge not in GAUGES:
        raise ValueError(f"`gauge` must be one of {', '.join(GAUGES)}, got {opts.gauge!r}")
    if opts.mlp_order not in ("score", "greedy"):
        raise ValueError(f"`mlp_order` must be 'score' or 'greedy', got {opts.mlp_order!r}")
    if opts.refit_prior not in ("zero", "dense"):
        raise ValueError(f"`refit_prior` must be 'zero' or 'dense', got {opts.refit_prior!r}")
    if opts.correction not in ("dense", "local", "none"):
        raise ValueError(f"`correction` must be 'dense', 'local' or 'none', got {opts.correction!r}")
    held = opts.refit_holdout
    if isinstance(held, bool) or not isinstance(held, int) or held < 0:
        raise ValueError(f"`refit_holdout` must be a number of calibration windows >= 0, got {held!r}")
    if held and opts.correction == "none":
        raise ValueError("`refit_holdout` chooses the refit of W_down: it needs correction 'dense' or 'local'")
    b = opts.refit_blend
    if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b <= 1.0):
        raise ValueError(f"`refit_blend` must be a share in [0, 1] (or None: the default), got {b!r}")
    if b is not None and (held or opts.correction != "dense"):
        raise ValueError(
            "`refit_blend` blends the dense trajectory's target with the local one: it needs correction 'dense' and "
            "no `refit_holdout` (which chooses the blend itself)"
        )
    if held and isinstance(calibration, torch.Tensor) and held >= calibration.shape[0]:
        raise ValueError(f"`refit_holdout` ({held}) must leave windows to fit on (of {calibration.shape[0]})")
    n = calibration.shape[0] if isinstance(calibration, torch.Tensor) and calibration.dim() == 2 else None
    held = 1 if opts.refine_holdout is None else opts.refine_holdout  # None: an eighth, at least one
    check_refine(opts.refine_epochs, opts.refine_lr, held, n)
    if config.value_parallel_removal:
        raise ValueError("models with value_parallel_removal are not supported (VO truncation changes its value space)")
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.shape[1] < 2:
        raise ValueError(f"`calibration` must be token ids (N, T) with T >= 2, got {getattr(calibration, 'shape', None)}")
