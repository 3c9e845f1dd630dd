"""Compression in relational coordinates (DESIGN.md 2.2a): activation-aware truncation of the invariants.

Notation: row vectors, X (n x d) the normalised input of a map (what it reads), per key/value head h with g query
heads: W_V (d x d_h) shared, W_O^j (d_h x d) per query head j, so the head's invariants are G_VO^j = W_V W_O^j;
per key head the QK forms G_QK^j = W_Q^j W_K^T split into rotary frequency pairs (the RoPE commutant); a SwiGLU
hidden unit i has z_i = act(x w_gate,i) (x w_up,i) and writes z_i w_down,i.

- VO: with C = X^T X = L L^T, the best rank-r_v maps minimising sum_j ||X (G_VO^j - A B_j)||^2 with a SHARED A
  come from the SVD of M = L^T W_V [W_O^1 ... W_O^g] (the g output blocks side by side): M = U S V^T, keep r_v.
  With P = L^T W_V (d x d_h): A = W_V T, B_j = T' W_O^j, T = P^+ U_r, T' = U_r^T P (T' T = I), so the new maps
  stay in the span of the old value space and no inverse of C is needed (`vo_truncate`).
- QK: the logit of head j is sum over pairs p of Re(q_p conj(k_p) e^{i theta_p (t - s)}); the commutant scales q_p
  by 1/conj(z) and k_p by z, so the gauge-invariant size of pair p is sqrt(E|q_p|^2 E|k_p|^2), summed over the g
  query heads of the key head. Whole pairs are removed (`qk_pair_scores`, `qk_truncate`).
- MLP: the scale gauge (w_up,i c, w_down,i / c) leaves a_i = sqrt(E z_i^2) ||w_down,i|| invariant: units with the
  smallest a_i go; W_down of the kept units S is refitted by least squares, W_down' = argmin ||Z_S W - Y||^2 with Y
  the dense MLP output (`local`) or the dense trajectory's residual target (`dense`, which also absorbs the error
  of everything compressed before it; by default blended half and half with the local target, `refit_blend`)
  (`mlp_truncate`). A plain MLP with biases (GPT-2, GPT-NeoX conversions) loses units the same way (`mlp_fit`).
- Where the QK form cannot lose rotary pairs (no rotary positions, learned ones, partial rotary, QK-norm) it keeps
  its width (`LowRankResult.qk_kept_full`); the parallel residual and learned positions are followed as the model
  computes them, and so are Gemma 3's sandwich norms, embedding scale and sliding-window layers (`layer_inputs`: the
  fits weighted as the norm sees an error, each layer's own mask and rotary table).
- Budget: a first pass over the dense model measures, per layer and kind, the error added to the residual stream
  (relative to its energy) at a grid of widths; a Lagrangian choice then minimises the summed (optionally
  loss-sensitivity weighted) error at the requested stored size (`plan_widths`). A second pass compresses layer by
  layer, collecting the calibration activations through the already-compressed layers.
- Gauge: the compressed model is written in `LowRankOptions.gauge` ("free" by default: plain maps holding their full
  weights, what inference reads fastest; "pivot": the gauge-fixed form), and the budget is counted in it.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers.initialization import no_init_weights

from ..modeling import RelationalConfig, RelationalForCausalLM
from .budget import (
    KINDS,
    WidthOption,
    check_budget,
    fixed_parameters,
    in_gauge,
    layer_kind_parameters,
    mlp_width_grid,
    plan_widths,
    qk_kept_full,
    qk_truncatable,
    width_grid,
)
from .layer_inputs import _positions, combined, layer_positions, output_norm_weights, sandwiched, window_mask  # noqa: F401
from .layer_inputs import released as release_layer
from .mlp_fit import (  # noqa: F401  (_accumulate_product, _batches, _token_weights: public here too)
    _accumulate_product,
    _batches,
    _mlp_samples,
    _refine,
    _token_weights,
    centred_columns,
    embedded,
    kept_mlp,
    mean_free_columns,
    mlp_units,
)
from .options import SENSITIVITIES, LowRankOptions, LowRankResult, _check  # noqa: F401  (public here too)
from .sensitivity import fisher_directions, fisher_metric, mlp_fisher_curve, vo_fisher_errors
from .truncation import (  # noqa: F401  (public here too)
    _attention_output,
    _mix,
    _mixed_grams,
    _pair_coordinates,
    _qk_norms,
    _sqrt_psd,
    _vo_errors,
    _vo_factors,
    choose_refit,
    compact_gram,
    greedy_unit_order,
    mlp_error_curve,
    mlp_refit,
    mlp_unit_scores,
    qk_pair_scores,
    qk_rows,
    qk_truncate,
    value_grams,
    vo_truncate,
)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Layer-by-layer machinery
# ----------------------------------------------------------------------------------------------------------------


def _pair_index_of(attn: nn.Module) -> torch.Tensor:
    """The model frequency pair of each head pair (H_kv, r/2), on the attention's device."""
    pairs = getattr(attn, "rope_pair_index", None)
    if pairs is not None:
        return pairs.detach().clone()
    device = next(attn.parameters()).device
    return torch.arange(attn.qk_rank // 2, device=device).expand(attn.num_kv_heads, attn.qk_rank // 2).clone()


def _weighted_energy(e: torch.Tensor, token_weights: torch.Tensor | None) -> float:
    """sum_t w_t |e_t|^2 over (B, T, d) errors (w = 1 without weights)."""
    per_token = e.double().pow(2).sum(-1)
    return float(per_token.sum() if token_weights is None else (per_token * token_weights).sum())


@torch.no_grad()
def _new_model(model: RelationalForCausalLM, widths: dict[str, list[int]], gauge: str) -> RelationalForCausalLM:
    config = compressed_config(model.config, widths, gauge)
    with no_init_weights():
        new = type(model)(config)
    if config.tie_word_embeddings and new.lm_head.weight is not new.model.embed_tokens.weight:
        new.lm_head.weight = new.model.embed_tokens.weight
    new.to(dtype=next(model.parameters()).dtype).eval()
    new.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    mine = dict(new.model.named_parameters())
    for name in ("norm.weight", "norm.bias", "embed_positions.weight"):  # final gain and bias, learned positions
        if name in mine:
            mine[name].copy_(model.model.get_parameter(name))
    if not config.tie_word_embeddings:
        new.lm_head.weight.copy_(model.lm_head.weight)
    return new


@dataclass
class ErrorCurves:
    """Pass 1's measurements: the candidate widths of every (layer, kind) and, with sensitivity="fisher", the
    per-layer Fisher metrics of the attention and MLP outputs ({"attn": (d, d), "mlp": (d, d)}), used by pass 2
    when `fisher_metric` is on."""

    options: dict[tuple[int, str], list[WidthOption]]
    metrics: list[dict[str, torch.Tensor]] | None = None


@torch.no_grad()
def _require_resolved(opts: LowRankOptions) -> None:
    if opts.automatic():
        raise ValueError(
            f"options {', '.join(opts.automatic())} are left to the automatic choice: pass "
            "`options.resolved(config, calibration)` to the per-layer functions"
        )


def layer_error_curves(
    config: RelationalConfig, layer: nn.Module, h: torch.Tensor, opts: LowRankOptions, positions: tuple, *,
    directions: dict[str, torch.Tensor] | None = None, metric: dict[str, torch.Tensor | None] | None = None,
    weight: float = 1.0, release: bool = False,
) -> tuple[dict[str, list[WidthOption]], torch.Tensor]:
    """Pass 1 for one dense decoder layer: its candidate widths per kind ({"qk", "vo", "mlp"} -> [WidthOption]) with
    the error each truncation adds (currency of `opts.sensitivity`; `directions`: the layer's sampled Fisher
    directions {"attn", "mlp"} when it is "fisher"; `metric`: the Fisher metrics used with `fisher_metric`), measured
    on the layer's input hidden states h (B, T, d); and the layer's output (B, T, d). `positions`: `_positions` (of
    this layer: a sliding-window layer's own; errors behind sandwich norms as `layer_inputs` weighs them). The
    same function serves the in-memory (`measure_error_curves`) and the layer-streamed (`compress.streamed`) paths.
    release: the layer's parameters are dropped once its full weights are assembled (a layer the caller is done with:
    its memory is not held twice), its sandwich norms' gains kept (`layer_inputs.released`)."""
    _require_resolved(opts)
    attn, mlp = layer.self_attn, layer.mlp
    li = attn.layer_idx
    rope = attn.rope
    cos, sin = (positions[0], positions[1]) if rope else (None, None)
    fisher = opts.sensitivity == "fisher"
    metric = metric or {"attn": None, "mlp": None}
    x = layer.input_layernorm(h)
    w = {k: v.detach() for k, v in attn.full_weights().items()}
    pairs = _pair_index_of(attn)
    nh, nkv = attn.num_heads, attn.num_kv_heads
    mask = window_mask(attn, positions)
    base, mixed = _attention_output(
        x, w, pairs, cos, sin, num_heads=nh, num_kv_heads=nkv, return_values=True, qk_norm=_qk_norms(attn), mask=mask
    )
    attn_norm, mlp_norm = layer.attention_output_norm, layer.mlp_output_norm  # sandwich norms (or None)
    written = sandwiched(attn_norm, base)
    h_mid = h + written
    xm = layer.post_attention_layernorm(h if layer.parallel_residual else h_mid)  # parallel: the MLP reads h too
    m = {k: v.detach() for k, v in mlp.full_weights().items()}
    if release:
        release_layer(layer)
    z = mlp_units(mlp, m, xm)
    y = F.linear(z, m["down"])  # the units' writes: a down bias is written whatever units are kept
    u = y + (0 if m.get("down_bias") is None else m["down_bias"])
    h_out = h_mid + sandwiched(mlp_norm, u)
    tw = _token_weights(h_out, opts.sensitivity)  # (B, T) or None
    tw_attn, tw_mlp = combined(tw, output_norm_weights(attn_norm, base)), combined(tw, output_norm_weights(mlp_norm, u))
    scale = float(h_out.double().pow(2).sum()) if opts.sensitivity == "relative" else 1.0  # fisher: nats
    scale = scale / weight
    flat_x = x.reshape(-1, x.shape[-1]).double()
    cov = flat_x.T @ flat_x
    r, rv, f = attn.qk_rank, attn.head_dim, m["down"].shape[1]
    # QK: drop the least important pairs, measure the attention output change
    qk_opts = [WidthOption(r, layer_kind_parameters(config, "qk", r, li), 0.0)]
    if "qk" in opts.kinds and qk_truncatable(config, li):
        scores = qk_pair_scores(
            w["q"], w["k"], w.get("q_bias"), w.get("k_bias"), cov, flat_x.sum(0), flat_x.shape[0], num_kv_heads=nkv
        )
        order = scores.argsort(dim=1, descending=True)
        # a truncated projection is the full one's columns (`qk_rows`): project once, and measure each candidate's
        # change in the mixed values, mapped to the output by W_O (or, for "fisher", the directions mapped back)
        qf, kf, vf = (F.linear(x, w[n], w.get(f"{n}_bias")) for n in ("q", "k", "v"))
        back = None
        if fisher:
            dirs = directions["attn"]
            back = (dirs.float().reshape(dirs.shape[0], -1, dirs.shape[-1]) @ w["o"].float()).view(
                dirs.shape[0], *mixed.shape
            )  # (K, B, T, H, r_v): W_O^T g
        for kp in width_grid(r // 2, opts.qk_step, opts.min_qk_pairs):
            qi, ki, factor, new_pairs = qk_rows(pairs, order[:, :kp], r, nh // nkv)
            new_mixed = _mix(
                qf[..., qi] * factor, kf[..., ki], vf, new_pairs, cos, sin, num_heads=nh, num_kv_heads=nkv, mask=mask
            )
            delta = new_mixed - mixed
            if fisher:
                proj = (back * delta.unsqueeze(0)).sum((-1, -2))  # (K, B, T): g . (change of the output)
                err = 0.5 * float(proj.double().pow(2).sum()) / back.shape[0]
            else:  # the change of what enters the stream (through the sandwich norm, exactly)
                change = F.linear(delta.reshape(*delta.shape[:2], -1), w["o"])
                change = change if attn_norm is None else attn_norm(base + change) - written
                err = _weighted_energy(change, tw)
            qk_opts.append(WidthOption(2 * kp, layer_kind_parameters(config, "qk", 2 * kp, li), err / scale))
        del back
    vo_opts = [WidthOption(rv, layer_kind_parameters(config, "vo", rv), 0.0)]
    if "vo" in opts.kinds:
        per_head, grams = _mixed_grams(mixed, nkv, tw_attn)
        if opts.vo_weighting == "input":
            grams = value_grams(w["v"], cov, num_kv_heads=nkv)
        factors = _vo_factors(w["o"], grams, nkv, metric["attn"])
        ranks = list(width_grid(rv, opts.vo_step, opts.min_vo_rank))
        if fisher:
            errs = vo_fisher_errors(mixed, w["o"], factors, ranks, directions["attn"])
        else:
            errs = [_vo_errors(per_head, w["o"], factors, rank) for rank in ranks]
        for rank, err in zip(ranks, errs, strict=True):
            vo_opts.append(WidthOption(rank, layer_kind_parameters(config, "vo", rank), err / scale))
    del w, x, flat_x, cov  # the attention's weights and statistics: memory for the MLP's (the peak of a layer)
    mlp_opts = [WidthOption(f, layer_kind_parameters(config, "mlp", f), 0.0)]
    if "mlp" in opts.kinds:
        zf = z.reshape(-1, f).double()
        del z
        yf = y.reshape(-1, y.shape[-1]).double()
        weights = None if tw_mlp is None else tw_mlp.reshape(-1, 1).double()
        zw = zf if weights is None else zf * weights
        if opts.mlp_order == "greedy":  # the order needs the statistics (a transient d_ff x d_ff matrix)
            order = greedy_unit_order(zw.T @ zf, zw.T @ yf, opts.ridge)
        else:  # (zw * zf).sum(0): the Gram's diagonal
            order = mlp_unit_scores(m["down"], (zw * zf).sum(0), metric["mlp"]).argsort(descending=True)
        m.clear()
        # the statistics built in that order, so the curves factor them in place (memory: one d_ff x d_ff matrix)
        zf = zf[:, order]
        zw = zf if weights is None else zf * weights
        gram, cross = zw.T @ zf, zw.T @ yf
        del zw
        y_energy = _weighted_energy(y, tw_mlp)
        if fisher:
            curve = mlp_fisher_curve(zf, yf, gram, cross, None, opts.ridge, directions["mlp"])
        else:
            curve = mlp_error_curve(gram, cross, y_energy, None, opts.ridge)
        del gram, cross, zf
        full = float(curve[-1])  # what the refit cannot explain even with every unit (regularisation)
        for units in mlp_width_grid(f, opts):
            err = max(float(curve[units - 1]) - full, 0.0) / scale
            mlp_opts.append(WidthOption(units, layer_kind_parameters(config, "mlp", units), err))
    return {"qk": qk_opts, "vo": vo_opts, "mlp": mlp_opts}, h_out


@torch.no_grad()
def measure_error_curves(
    model: RelationalForCausalLM, calibration: torch.Tensor, options: LowRankOptions | None = None, *,
    progress: bool = True,
) -> ErrorCurves:
    """Pass 1 of `compress_relational`: the candidate widths of every (layer, kind) with their stored parameters and
    measured error (in the currency of `options.sensitivity`) on the first `plan_windows` calibration windows of the
    dense model (`layer_error_curves`, layer after layer). They do not depend on the budget, so one measurement serves
    several budgets (`curves=`)."""
    opts = options or LowRankOptions()
    _check(model.config, calibration, opts)
    opts = opts.resolved(model.config, calibration)
    model = model.eval()
    config: RelationalConfig = model.config
    layers = model.model.layers
    n_layers = len(layers)
    positions = layer_positions(config, calibration.shape[1])
    plan_ids = calibration[: opts.plan_windows]
    fisher = opts.sensitivity == "fisher"
    dirs = fisher_directions(model, plan_ids, samples=opts.fisher_samples, batch_size=opts.batch_size) if fisher else None
    h = embedded(model, plan_ids)
    options: dict[tuple[int, str], list[WidthOption]] = {}
    metrics = [{s: fisher_metric(d[s]) for s in d} for d in dirs] if fisher else None
    use = metrics if fisher and opts.fisher_metric else [None] * n_layers
    weights = opts.layer_weights or [1.0] * n_layers
    for li, layer in enumerate(tqdm(layers, desc="measuring error curves", disable=not progress)):
        kinds, h = layer_error_curves(
            config, layer, h, opts, positions[li], directions=dirs[li] if fisher else None, metric=use[li],
            weight=weights[li],
        )
        options.update({(li, kind): o for kind, o in kinds.items()})
        if fisher:
            dirs[li] = None  # what the later layers do not need
    return ErrorCurves(options, metrics)


def plan(
    config: RelationalConfig, curves: ErrorCurves, budget: int, fixed: int, result: LowRankResult
) -> dict[str, list[int]]:
    """The widths {"qk", "vo", "mlp"} -> per layer that minimise the measured error with at most `budget` stored
    parameters, `fixed` of them outside the truncated maps (embedding, head, norms), each width's parameters counted
    in `config.gauge` (the gauge the compression writes); recorded in `result`."""
    n_layers = config.num_hidden_layers
    options = {
        (li, kind): [WidthOption(o.width, layer_kind_parameters(config, kind, o.width, li), o.error) for o in candidates]
        for (li, kind), candidates in curves.options.items()
    }
    choice = plan_widths(options, budget - fixed)
    widths = {kind: [choice[(li, kind)].width for li in range(n_layers)] for kind in KINDS}
    result.widths = widths
    result.qk_kept_full = qk_kept_full(config)
    result.planned_parameters = fixed + sum(o.parameters for o in choice.values())
    logger.info("planned widths: %s", widths)
    return widths


def compressed_config(config: RelationalConfig, widths: dict[str, list[int]], gauge: str | None = None) -> RelationalConfig:
    """`config` with the per-layer widths of a plan (and `gauge`; None: `config`'s)."""
    config = copy.deepcopy(in_gauge(config, gauge))
    partial = 0 < config.rotary_dim < config.qk_rank  # its QK forms keep their width (`budget.qk_truncatable`)
    config.layer_qk_ranks = None if partial else list(widths["qk"])
    config.layer_value_ranks = list(widths["vo"])
    config.layer_intermediate_sizes = list(widths["mlp"])
    config.validate()
    return config


@torch.no_grad()
def compress_layer(
    layer: nn.Module, target: nn.Module, h: torch.Tensor, h_dense: torch.Tensor | None, widths: dict[str, int],
    opts: LowRankOptions, positions: tuple, metric: dict[str, torch.Tensor | None] | None = None,
    release: bool = False, record: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pass 2 for one layer: load into `target` (a `RelationalDecoderLayer` of the planned widths {"qk": r, "vo": r_v,
    "mlp": d_ff}) the truncation of the dense `layer` fitted on the calibration hidden states h (N, T, d) that reach
    it through the already-compressed layers (`h_dense`: the dense model's own, for correction="dense", else None).
    Returns the next (h, h_dense); h is updated in place. Shared by the in-memory and the layer-streamed paths.
    release: the dense layer's parameters (but its sandwich norms' gains, `layer_inputs.released`) are dropped once
    its full weights are assembled and, with correction="dense", once it has carried h_dense one layer on (the caller
    is done with it). record: a dict that
    receives the refit chosen on held-back windows (`LowRankOptions.refit_holdout`)."""
    _require_resolved(opts)
    cos, sin, mask, pos = positions
    attn, mlp = layer.self_attn, layer.mlp
    window = window_mask(attn, positions)  # a sliding-window layer's mask for the truncations' own attention
    attn_norm, mlp_norm = layer.attention_output_norm, layer.mlp_output_norm  # sandwich norms (or None)
    rope = cos is not None and attn.rope
    cos, sin = (cos, sin) if rope else (None, None)
    metric = metric or {"attn": None, "mlp": None}
    n, t, d = h.shape

    def run_layer(block, hidden):
        return block(hidden, attention_mask=mask, position_embeddings=(cos, sin) if rope else None, position_ids=pos)

    cov = torch.zeros(d, d, dtype=torch.float64, device=h.device)
    mean = torch.zeros(d, dtype=torch.float64, device=h.device)
    for s in _batches(n, opts.batch_size):
        xb = layer.input_layernorm(h[s]).reshape(-1, d).double()
        cov += xb.T @ xb
        mean += xb.sum(0)
    tokens = n * t
    w = {k: v.detach().clone() for k, v in attn.full_weights().items()}
    pairs = _pair_index_of(attn)
    nkv = attn.num_kv_heads
    r_new, rv_new = widths["qk"], widths["vo"]
    if r_new < attn.qk_rank:
        scores = qk_pair_scores(w["q"], w["k"], w.get("q_bias"), w.get("k_bias"), cov, mean, tokens, num_kv_heads=nkv)
        keep = scores.argsort(dim=1, descending=True)[:, : r_new // 2]
        w["q"], w["k"], bq, bk, pairs = qk_truncate(
            w["q"], w["k"], w.get("q_bias"), w.get("k_bias"), pairs, keep, num_kv_heads=nkv
        )
        if bq is not None:
            w["q_bias"], w["k_bias"] = bq, bk
    if rv_new < attn.head_dim:
        if opts.vo_weighting == "input":
            grams = value_grams(w["v"], cov, num_kv_heads=nkv)
        else:  # the attention-mixed values the output maps read, through the truncated QK forms
            grams = torch.zeros(nkv, attn.head_dim, attn.head_dim, dtype=torch.float64, device=h.device)
            for s in _batches(n, opts.batch_size):
                xb = layer.input_layernorm(h[s])
                out, mixed = _attention_output(
                    xb, w, pairs, cos, sin, num_heads=attn.num_heads, num_kv_heads=nkv, return_values=True,
                    qk_norm=_qk_norms(attn), mask=window,
                )
                weights = combined(_token_weights(h[s], opts.sensitivity), output_norm_weights(attn_norm, out))
                grams += _mixed_grams(mixed, nkv, weights)[1]
        w["v"], w["o"], bv, _ = vo_truncate(
            w["v"], w["o"], w.get("v_bias"), grams, num_kv_heads=nkv, rank=rv_new, metric=metric["attn"]
        )
        if bv is not None:
            w["v_bias"] = bv
    target.self_attn.set_full_weights(w, fix_gauge=True)  # a free-gauge target: well-scaled factors
    if getattr(target.self_attn, "rope_pair_index", None) is not None:
        target.self_attn.rope_pair_index.copy_(pairs)
    for norm, kept in ((attn_norm, target.attention_output_norm), (mlp_norm, target.mlp_output_norm)):
        if norm is not None:  # the sandwich norms' gains, as they are
            kept.weight.copy_(norm.weight)
    # MLP: statistics at the compressed attention's output
    m = {k: v.detach() for k, v in mlp.full_weights().items()}
    norm = layer.post_attention_layernorm
    dense_out = None if h_dense is None else torch.empty_like(h_dense)
    if h_dense is not None:  # the dense trajectory's next hidden states, before the dense layer's weights go
        for s in _batches(n, opts.batch_size):
            dense_out[s] = run_layer(layer, h_dense[s])
    if release:
        release_layer(layer)
    f = m["down"].shape[1]
    f_new = widths["mlp"]
    h_mid = torch.empty_like(h)
    for s in _batches(n, opts.batch_size):
        h_mid[s] = h[s] + target.attention_update(
            h[s], position_embeddings=(cos, sin) if rope else None, attention_mask=mask
        )
    h_in = h if layer.parallel_residual else h_mid  # the stream the MLP reads
    if f_new < f or opts.correction == "dense":
        held_back = opts.refit_holdout if opts.correction != "none" else 0
        gram = torch.zeros(f, f, dtype=torch.float64, device=h.device)
        cross = torch.zeros(f, d, dtype=torch.float64, device=h.device)
        for z, zw, y, _ in _mlp_samples(mlp, m, norm, h_in, h_mid, dense_out, range(0, n - held_back), opts, mlp_norm):
            _accumulate_product(gram, zw, z)  # per-batch products in fp32, accumulated in fp64
            _accumulate_product(cross, zw, y)
        # the held-back windows' samples are kept (windows x T x d_ff floats): only the kept units' Gram is formed
        held = [torch.cat(t) if i < 3 else sum(t) for i, t in enumerate(zip(*_mlp_samples(
            mlp, m, norm, h_in, h_mid, dense_out, range(n - held_back, n), opts, mlp_norm)))] if held_back else None  # fmt: skip
        if opts.mlp_order == "greedy":
            both = (gram, cross) if held is None else (gram + held[1].T @ held[0], cross + held[1].T @ held[2])
            order = greedy_unit_order(*both, opts.ridge)
        else:
            diag = torch.diagonal(gram) + (0 if held is None else (held[1] * held[0]).sum(0))
            order = mlp_unit_scores(m["down"], diag, metric["mlp"]).argsort(descending=True)
        keep = torch.sort(order[:f_new]).values
        down, ridge, blend = m["down"][:, keep], opts.ridge, 1.0
        if opts.correction != "none":  # kept units' statistics only, the full ones freed first; Z^T Y_local = G W^T
            prior = down.double() if opts.refit_prior == "dense" else None  # the kept units' own W_down columns
            local = gram[keep] @ m["down"].double().T if held is not None and opts.correction == "dense" else None
            gram, cross = compact_gram(gram, keep), cross[keep]
            if held is not None:  # the ridge and the targets' blend chosen on the held-back windows, then fit on all
                z_h, zw_h = held[0][:, keep].double(), held[1][:, keep].double()
                back = (zw_h.T @ z_h, zw_h.T @ held[2].double(), held[3])
                choice = choose_refit((gram, cross, local), back, prior=prior)
                ridge, blend = choice["ridge"], choice["blend"]
                (record if record is not None else {}).update(choice)
                gram, cross = gram.add_(back[0]), cross + back[1]
                if blend != 1.0:
                    local = local + zw_h.T @ F.linear(held[0], m["down"].float()).double()
                    cross = blend * cross + (1 - blend) * local
                del held, back, z_h, zw_h, local
            down = mlp_refit(gram, cross, None, ridge, prior=prior).to(down.dtype)
        del gram, cross
        dense_mlp, m = m, kept_mlp(m, keep, down)
        if opts.refine_epochs:
            m = _refine(mlp, dense_mlp, m, norm, h_in, h_mid, dense_out, opts, record, mlp_norm)
        if mean_free_columns(dense_mlp["down"]):  # a mean-free write stays mean-free (`mlp_fit`)
            m["down"] = centred_columns(m["down"])
    target.mlp.set_full_weights(m, fix_gauge=True)
    for s in _batches(n, opts.batch_size):  # h_in is h itself with the parallel residual: read before it is written
        h[s] = h_mid[s] + target._mlp_update(h_in[s])
    return h, dense_out


@torch.no_grad()
def compress_relational(
    model: RelationalForCausalLM,
    calibration: torch.Tensor,
    budget: int,
    options: LowRankOptions | None = None,
    *,
    count: Callable[[nn.Module], int] | None = None,
    progress: bool = True,
    curves: ErrorCurves | None = None,
) -> tuple[RelationalForCausalLM, LowRankResult]:
    """Compress a relational causal LM (any per-layer widths, CPU, fp32) to at most `budget` stored parameters by
    truncating its invariants: per layer the QK rotary pairs, the VO rank and the SwiGLU units (module docstring).

    calibration: token ids (N, T). Pass 1 measures error curves on the first `plan_windows` windows of the dense
    model (`measure_error_curves`; or takes `curves` measured before with the same options) and plans the widths
    (`plan_widths`); pass 2 walks the layers once with all N windows, feeding each layer the output of the
    already-compressed ones (`compress_layer`; memory: the hidden states of the calibration set, twice with
    correction='dense', plus one layer). `compress.streamed` does the same one layer in memory at a time. The new
    model is in the gauge `options.gauge` (the budget counted in it), whatever the gauge of `model`.
    Returns (new model, LowRankResult)."""
    opts = options or LowRankOptions()
    _check(model.config, calibration, opts)
    opts = opts.resolved(model.config, calibration)  # the automatic choices, for this model and calibration
    config: RelationalConfig = model.config
    model = model.eval()
    n_layers = len(model.model.layers)
    count = count or (lambda m: sum(p.numel() for p in m.parameters()))
    result = LowRankResult(budget=budget)
    fixed = fixed_parameters(config, count(model))  # outside the truncated maps: the same in either gauge
    written = in_gauge(config, opts.gauge)  # the budget is counted in the gauge the compression writes
    check_budget(written, budget, fixed, opts)
    t0 = time.perf_counter()
    curves = curves if curves is not None else measure_error_curves(model, calibration, opts, progress=progress)
    use_metric = opts.sensitivity == "fisher" and opts.fisher_metric and curves.metrics is not None
    metrics = curves.metrics if use_metric else [None] * n_layers
    widths = plan(written, curves, budget, fixed, result)
    result.plan_seconds = time.perf_counter() - t0

    # ---------------- pass 2: compress layer by layer through the compressed prefix ----------------
    t1 = time.perf_counter()
    positions = layer_positions(config, calibration.shape[1])
    new = _new_model(model, widths, opts.gauge)
    n = calibration.shape[0]
    h = torch.cat([embedded(model, calibration[s]) for s in _batches(n, opts.batch_size)])
    h_dense = h.clone() if opts.correction == "dense" else None
    layers = zip(model.model.layers, new.model.layers, strict=True)
    for li, (layer, target) in enumerate(tqdm(layers, total=n_layers, desc="compressing layers", disable=not progress)):
        chosen = {kind: widths[kind][li] for kind in KINDS}
        record: dict[str, float] = {}
        h, h_dense = compress_layer(layer, target, h, h_dense, chosen, opts, positions[li], metrics[li], record=record)
        if record:
            result.refits.append(record)
    result.compress_seconds = time.perf_counter() - t1
    return new, result


__all__ = [
    "KINDS",
    "SENSITIVITIES",
    "ErrorCurves",
    "LowRankOptions",
    "LowRankResult",
    "WidthOption",
    "check_budget",
    "compress_layer",
    "compress_relational",
    "compressed_config",
    "fixed_parameters",
    "layer_error_curves",
    "layer_kind_parameters",
    "measure_error_curves",
    "mlp_error_curve",
    "mlp_refit",
    "mlp_unit_scores",
    "plan",
    "plan_widths",
    "qk_pair_scores",
    "qk_truncate",
    "value_grams",
    "vo_truncate",
]
