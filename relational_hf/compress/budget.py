"""The budget of `compress.lowrank`: stored parameters of one layer's truncated maps at given widths, and the
Lagrangian choice of one width per (layer, kind) that minimises the summed measured error at a stored size, the
grids of candidate widths, and the check that a budget can be met at all."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..modeling import RelationalConfig

KINDS = ("qk", "vo", "mlp")


# ----------------------------------------------------------------------------------------------------------------
# Parameter counts of one layer at given widths (relational pivot gauge; checked against the model in the tests)
# ----------------------------------------------------------------------------------------------------------------


def layer_kind_parameters(config: RelationalConfig, kind: str, width: int, layer: int | None = None) -> int:
    """Stored parameters of one layer's `kind` at `width` (qk: r, vo: r_v, mlp: d_ff), pivot or free gauge; `layer`
    (default: a layer with the model's positions) decides rotary or not (`RelationalConfig.rope_layers`). With
    QK-norm the QK pair is stored as it is, with its two gain vectors."""
    d, h, hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    pivot = config.gauge == "pivot"
    rope = config.position_encoding == "rope" if layer is None else config.layer_rope(layer)
    if kind == "qk":  # QK-norm and partial rotary: the QK pair is stored as it is (no pivot)
        free = not pivot or config.qk_norm or (rope and 0 < config.rotary_dim < config.qk_rank)
        fixed = 0 if free else hkv * (width if rope else width * width)
        n = (h + hkv) * width * d - fixed + (2 * width if config.qk_norm else 0)
        return n + ((h + hkv) * width if config.attention_bias else 0)
    if kind == "vo":
        n = (hkv + h) * width * d - (hkv * width * width if pivot and not config.value_parallel_removal else 0)
        return n + (hkv * width if config.attention_bias else 0)
    if kind == "mlp":  # a plain MLP (mlp_gated=False): up and down, the up bias per unit, no scale gauge
        if not config.mlp_gated:
            return 2 * d * width + (width if config.mlp_bias else 0)
        return 3 * d * width - (width if pivot else 0)
    raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}")


def qk_truncatable(config: RelationalConfig, layer: int) -> bool:
    """Whether layer `layer`'s QK width can be truncated (whole rotary pairs): rotary positions and no QK-norm (the
    per-head norm is over all qk_rank coordinates, so a narrower QK form is another function: it keeps its width) and
    no partial rotary (GL on the non-rotated coordinates leaves no pairs to rank; the QK form is stored as it is)."""
    return config.layer_rope(layer) and not config.qk_norm and not 0 < config.rotary_dim < config.qk_rank


def qk_kept_full(config: RelationalConfig) -> dict[str, str]:
    """Layer index -> why its QK form keeps its full width, for the layers `qk_truncatable` excludes."""
    if config.qk_norm:
        why = "QK-norm normalises over the whole head: no narrower QK form is the same function"
    elif 0 < config.rotary_dim < config.qk_rank:
        why = "partial rotary: the QK form is stored as it is (GL on the non-rotated coordinates), at full width"
    elif config.position_encoding == "learned":
        why = "learned positions (no rotary pairs): the QK rank is removed a rotary pair at a time"
    else:
        why = "no rotary positions: the QK rank is removed a rotary pair at a time"
    return {str(li): why for li in range(config.num_hidden_layers) if not qk_truncatable(config, li)}


def in_gauge(config: RelationalConfig, gauge: str | None) -> RelationalConfig:
    """`config` with `gauge` (a copy when it changes; None: as it is): the counts above follow `config.gauge`, so the
    budget of a compression is counted in the gauge it writes."""
    if gauge is None or gauge == config.gauge:
        return config
    config = copy.deepcopy(config)
    config.gauge = gauge
    return config


# ----------------------------------------------------------------------------------------------------------------
# Budget: a Lagrangian choice of widths from measured error curves
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class WidthOption:
    """One candidate width of one (layer, kind): its stored parameters and its measured (weighted) error."""

    width: int
    parameters: int
    error: float


def plan_widths(options: dict[tuple[int, str], list[WidthOption]], budget: int) -> dict[tuple[int, str], WidthOption]:
    """Choose one option per (layer, kind) minimising the summed error with summed parameters <= budget:
    for a multiplier lam, each slot takes argmin error + lam parameters; lam is bisected to the smallest value that
    meets the budget. Raises ValueError when even the narrowest widths exceed the budget."""
    slots = list(options)

    def choose(lam: float) -> dict:
        return {s: min(options[s], key=lambda o: (o.error + lam * o.parameters, o.parameters)) for s in slots}

    def total(choice: dict) -> int:
        return sum(o.parameters for o in choice.values())

    smallest = sum(min(o.parameters for o in options[s]) for s in slots)
    if smallest > budget:
        raise ValueError(f"the narrowest widths store {smallest:,} parameters, more than the budget {budget:,}")
    choice = choose(0.0)
    if total(choice) <= budget:
        return choice
    lo, hi = 0.0, 1e-12
    while total(choose(hi)) > budget:
        hi *= 4.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if total(choose(mid)) > budget:
            lo = mid
        else:
            hi = mid
    return choose(hi)


def width_grid(width: int, step: int, smallest: int) -> range:
    """Candidate widths below `width`: steps of `step` down to `smallest`, both shrunk for narrow maps (at least
    8 candidates when the width allows)."""
    step = max(1, min(step, width // 8))
    smallest = max(1, min(smallest, width // 4))
    return range(width - step, smallest - 1, -step)


def mlp_width_grid(width: int, opts) -> list[int]:
    """Candidate SwiGLU widths below `width` (`opts`: `compress.lowrank.LowRankOptions`): `width_grid`'s, or with
    `opts.width_multiple` N the multiples of N below `width` in steps of at least `mlp_step`, down to
    `min_mlp_units` (at least N); the plain grid itself where all of it is multiples of N already. A compressed
    model's SwiGLU widths are the only rows llama.cpp sees at their own length (QK and value widths are padded to the
    head width in GGUF), and its K-quants need rows of 256."""
    multiple = getattr(opts, "width_multiple", None)
    plain = list(width_grid(width, opts.mlp_step, opts.min_mlp_units))
    if not multiple or (plain and all(w % multiple == 0 for w in plain)):
        return plain  # a multiple the plain grid already honours changes nothing (SmolLM2's 1536 in steps of 64)
    step = multiple * max(1, -(-opts.mlp_step // multiple))
    top = (width - 1) // multiple * multiple
    smallest = max(multiple, opts.min_mlp_units)
    return list(range(top, smallest - 1, -step))


def check_budget(config: RelationalConfig, budget: int, fixed: int, opts) -> None:
    """ValueError before any work when even the narrowest widths the planner may choose (the grids' smallest,
    `opts.kinds` only; `opts`: `compress.lowrank.LowRankOptions`) store more than `budget` with the `fixed` parameters outside the truncated maps."""
    narrowest = fixed
    for li in range(config.num_hidden_layers):
        r, rv, f = config.layer_qk_rank(li), config.layer_value_rank(li), config.layer_intermediate_size(li)
        if "qk" in opts.kinds and qk_truncatable(config, li):
            r = min([r, *(2 * kp for kp in width_grid(r // 2, opts.qk_step, opts.min_qk_pairs))])
        if "vo" in opts.kinds:
            rv = min([rv, *width_grid(rv, opts.vo_step, opts.min_vo_rank)])
        if "mlp" in opts.kinds:
            f = min([f, *mlp_width_grid(f, opts)])
        narrowest += sum(layer_kind_parameters(config, k, w, li) for k, w in (("qk", r), ("vo", rv), ("mlp", f)))
    if narrowest > budget:
        raise ValueError(
            f"the narrowest widths store {narrowest:,} parameters ({fixed:,} of them in the embedding, head and norms, "
            f"which are not truncated), more than the budget {budget:,}: choose a smaller `remove`"
        )


def fixed_parameters(config: RelationalConfig, total: int) -> int:
    """Of a relational model of `config` storing `total` parameters, those outside the truncated maps."""
    return total - sum(
        layer_kind_parameters(config, "qk", config.layer_qk_rank(li), li)
        + layer_kind_parameters(config, "vo", config.layer_value_rank(li), li)
        + layer_kind_parameters(config, "mlp", config.layer_intermediate_size(li), li)
        for li in range(config.num_hidden_layers)
    )


__all__ = [
    "KINDS",
    "WidthOption",
    "check_budget",
    "fixed_parameters",
    "in_gauge",
    "layer_kind_parameters",
    "qk_kept_full",
    "qk_truncatable",
    "plan_widths",
    "mlp_width_grid",
    "width_grid",
]

