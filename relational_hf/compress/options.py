"""The settings of the relational compression (`LowRankOptions`), what it reports (`LowRankResult`) and their
validation, shared by the in-memory (`compress.lowrank`) and streamed (`compress.streamed`) paths."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..modeling import RelationalConfig
from .budget import KINDS
from .refine import DEFAULT_REFINE_BATCH_TOKENS, DEFAULT_REFINE_LR, RefineOptions, check_refine

SENSITIVITIES = ("fisher", "token", "relative", "uniform")
GAUGES = ("free", "pivot")
DEFAULT_REFIT_BLEND = 0.5  # the blend most layers chose on held-back windows (refit_holdout), on both splits
MLP_ORDERS = ("auto", "score", "greedy")
#: mlp_order "auto" takes forward selection when the widest SwiGLU layer has at most this many units: its d_ff x d_ff
#: float64 matrix is then at most 128 MiB and its O(d_ff^3) work about a minute a layer on 2 cores (4 s at SmolLM2's
#: 1,536); wider (7B's 11,008: 1 GB and 6 minutes a layer) it takes each unit's own score
AUTO_GREEDY_MAX_UNITS = 4096
#: refine_epochs None ("auto") refines AUTO_REFINE_EPOCHS epochs when the refinement's two more copies of the
#: calibration hidden states (2 x windows x tokens x hidden size float32) fit in this many bytes (302 MB for SmolLM2
#: with 128 windows of 512 tokens; a 1B model's 2,048-wide stream needs 1 GiB), else none
AUTO_REFINE_MAX_BYTES = 512 * 2**20
AUTO_REFINE_EPOCHS = 4


@dataclass
class LowRankOptions:
    """Settings of `compress_relational` (see its docstring)."""

    qk_step: int = 2  # pairs per grid step (rank step 2 * qk_step)
    vo_step: int = 4
    mlp_step: int = 64
    min_qk_pairs: int = 2
    min_vo_rank: int = 4
    min_mlp_units: int = 64
    # every kept SwiGLU width a multiple of this (None: mlp_step's grid): 256 lets llama.cpp's K-quants take the
    # compressed down maps, 32 its other block types (`budget.mlp_width_grid`)
    width_multiple: int | None = None
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
    # order in which SwiGLU units are kept: "score" (each unit's balanced importance alone, `mlp_unit_scores`),
    # "greedy" (forward selection for the refit, `greedy_unit_order`: sees the correlations between units; one more
    # d_ff x d_ff float64 matrix and O(d_ff^3) work per layer) or "auto" (greedy up to AUTO_GREEDY_MAX_UNITS units)
    mlp_order: str = "auto"
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
    # one), the closed form counting as epoch 0 (`compress.refine`); 0: the closed form alone; None ("auto"):
    # AUTO_REFINE_EPOCHS when the memory it takes is at most AUTO_REFINE_MAX_BYTES (`resolved`)
    refine_epochs: int | None = None
    refine_lr: float = DEFAULT_REFINE_LR
    refine_holdout: int | None = None
    refine_batch_tokens: int = DEFAULT_REFINE_BATCH_TOKENS  # tokens a step of Adam in the refinement
    # the gauge of the compressed model, in which the budget is counted: "free" (every map a plain Linear holding the
    # full weight it computes with: inference reads the weights as stored) or "pivot" (the gauge-fixed relational
    # form: the pivot entries are not stored, so the same budget keeps a little more width, but a call assembles the
    # full weights from the free entries: slower on a CPU, `benchmarks/compress_speed.py`)
    gauge: str = "free"

    def automatic(self) -> tuple[str, ...]:
        """The fields left to the automatic choice ("auto" / None), which `resolved` decides."""
        return tuple(f for f, v in (("mlp_order", self.mlp_order == "auto"), ("refine_epochs", self.refine_epochs is None)) if v)

    def resolved(self, config: RelationalConfig, calibration: torch.Tensor) -> LowRankOptions:
        """These options with the automatic choices made for a model of `config` and calibration ids (N, T):
        forward selection of the SwiGLU units for models no wider than AUTO_GREEDY_MAX_UNITS units, and
        AUTO_REFINE_EPOCHS epochs of refinement when its memory is at most AUTO_REFINE_MAX_BYTES (none with one
        window, which leaves none to hold back, with correction "none", which refits nothing, or for a plain MLP). Measured on
        SmolLM2-135M at 25%: held-out perplexity 50.85 instead of 53.33 (x1.44 instead of x1.51), 27.99 instead of
        28.68 on the reverse split, for 710 s of compression instead of 308 s on 2 cores. Explicit values are kept,
        but for correction "dense" behind sandwich norms (Gemma 3), which becomes "local": the dense trajectory's step
        is what the sublayer writes after its norm, no linear target for the maps before it (`layer_inputs`)."""
        order, epochs = self.mlp_order, self.refine_epochs
        correction = "local" if self.correction == "dense" and config.sandwich_norms else self.correction
        if order == "auto":
            widest = max(config.layer_intermediate_size(i) for i in range(config.num_hidden_layers))
            order = "greedy" if widest <= AUTO_GREEDY_MAX_UNITS else "score"
        if epochs is None:
            n, t = (calibration.shape[0], calibration.shape[1]) if calibration.dim() == 2 else (0, 0)
            copies = 2 * n * t * config.hidden_size * 4
            fits = n >= 2 and self.correction != "none" and copies <= AUTO_REFINE_MAX_BYTES and config.mlp_gated
            epochs = AUTO_REFINE_EPOCHS if fits else 0
        return dataclasses.replace(self, mlp_order=order, refine_epochs=epochs, correction=correction)

    def refine_options(self, windows: int) -> RefineOptions:
        """The `refine.RefineOptions` of a compression on `windows` calibration windows."""
        held = max(1, windows // 8) if self.refine_holdout is None else self.refine_holdout
        return RefineOptions(
            epochs=self.refine_epochs, lr=float(self.refine_lr), held_out=held, batch_tokens=self.refine_batch_tokens
        )

    def as_report(self, config: RelationalConfig | None = None, calibration: torch.Tensor | None = None) -> dict:
        """The settings as the compression report records them (JSON types), with the blend the refit used; given the
        model's config and the calibration ids, the automatic choices made (`resolved`) and which fields they were
        ("automatic")."""
        opts = self if config is None or calibration is None else self.resolved(config, calibration)
        fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()}
        extra = {} if opts is self else {"automatic": list(self.automatic())}
        return fields | {"refit_target_blend": opts.target_blend()} | extra

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
    # layer index -> why its QK form keeps its full width (QK-norm over the whole head, or no rotary pairs to remove)
    qk_kept_full: dict[str, str] = field(default_factory=dict)


def _check(config: RelationalConfig, calibration: torch.Tensor, opts: LowRankOptions) -> None:
    """ValueError in one line for options, a model or calibration ids the compression cannot take (both paths)."""
    if opts.sensitivity not in SENSITIVITIES:
        raise ValueError(f"`sensitivity` must be one of {', '.join(SENSITIVITIES)}, got {opts.sensitivity!r}")
    if opts.gauge not in GAUGES:
        raise ValueError(f"`gauge` must be one of {', '.join(GAUGES)}, got {opts.gauge!r}")
    if opts.mlp_order not in MLP_ORDERS:
        raise ValueError(f"`mlp_order` must be one of {', '.join(MLP_ORDERS)}, got {opts.mlp_order!r}")
    if opts.refit_prior not in ("zero", "dense"):
        raise ValueError(f"`refit_prior` must be 'zero' or 'dense', got {opts.refit_prior!r}")
    if opts.correction not in ("dense", "local", "none"):
        raise ValueError(f"`correction` must be 'dense', 'local' or 'none', got {opts.correction!r}")
    plan = opts.plan_windows
    if isinstance(plan, bool) or not isinstance(plan, int) or plan < 1:
        raise ValueError(f"`plan_windows` must be a number of calibration windows >= 1, got {plan!r}")
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
    if b is not None and config.sandwich_norms:
        raise ValueError("`refit_blend`: behind sandwich norms (Gemma 3) the refit's target is the local one alone")
    if held and isinstance(calibration, torch.Tensor) and held >= calibration.shape[0]:
        raise ValueError(f"`refit_holdout` ({held}) must leave windows to fit on (of {calibration.shape[0]})")
    n = calibration.shape[0] if isinstance(calibration, torch.Tensor) and calibration.dim() == 2 else None
    held = 1 if opts.refine_holdout is None else opts.refine_holdout  # None: an eighth, at least one
    epochs = opts.refine_epochs
    if epochs is None:  # the automatic choice, as `resolved` makes it for these calibration ids
        epochs = opts.resolved(config, calibration).refine_epochs if n is not None else 0
    check_refine(epochs, opts.refine_lr, held, n, opts.refine_batch_tokens)
    if opts.refine_epochs and not config.mlp_gated:
        raise ValueError(
            "`refine_epochs` refines SwiGLU maps; a plain MLP (mlp_gated=False, a GPT-2 or GPT-NeoX conversion) takes "
            "the closed-form refit alone: leave it out or give 0"
        )
    if config.value_parallel_removal:
        raise ValueError("models with value_parallel_removal are not supported (VO truncation changes its value space)")
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.shape[1] < 2:
        raise ValueError(f"`calibration` must be token ids (N, T) with T >= 2, got {getattr(calibration, 'shape', None)}")
