"""The three truncations of relational invariants, as pure functions on full, Linear-layout weights (DESIGN.md 2.2a).

VO per key/value head by the activation-aware SVD (`vo_truncate`), QK by whole rotary pairs (`qk_pair_scores`,
`qk_truncate`), SwiGLU units by their gauge-invariant importance with a least-squares refit of W_down
(`mlp_unit_scores`, `mlp_refit`, `mlp_error_curve`). `relational_hf.compress.lowrank` plans the widths and applies
them layer by layer; the notation is in its docstring.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..modeling.modeling_relational import apply_rotary_pair_subset, rotary_layout
from ..modeling.modeling_rotary import apply_partial_rotary

# ----------------------------------------------------------------------------------------------------------------
# The three truncations (pure functions on full, Linear-layout weights)
# ----------------------------------------------------------------------------------------------------------------


def _sqrt_psd(cov: torch.Tensor) -> torch.Tensor:
    """A square root L (d x d) of a PSD matrix with L L^T = C (symmetric eigen square root, negative parts cut)."""
    evals, evecs = torch.linalg.eigh(cov.double())
    return (evecs * evals.clamp_min(0).sqrt()) @ evecs.T


def value_grams(wv: torch.Tensor, cov: torch.Tensor, *, num_kv_heads: int) -> torch.Tensor:
    """E = W_V^T C W_V per key/value head (H_kv, d_h, d_h): the value-space Gram of inputs with covariance C."""
    dh = wv.shape[0] // num_kv_heads
    v = wv.double().view(num_kv_heads, dh, -1)
    return v @ cov.double() @ v.transpose(1, 2)


def _vo_factors(
    wo: torch.Tensor, grams: torch.Tensor, num_kv_heads: int, metric: torch.Tensor | None = None
) -> list[tuple]:
    """Per key/value head: (P = E^1/2, the SVD of M = P [W_O^1 N ... W_O^g N]): (p, u, s, blocks), N = metric^1/2
    (the output-space metric; identity when None)."""
    dh = grams.shape[-1]
    g = wo.shape[1] // (dh * num_kv_heads)
    root = None if metric is None else _sqrt_psd(metric)
    out = []
    for kv in range(num_kv_heads):
        blocks = [wo[:, (kv * g + j) * dh : (kv * g + j + 1) * dh].double().T for j in range(g)]  # (d_h, d) each
        p = _sqrt_psd(grams[kv])  # (d_h, d_h), symmetric
        seen = blocks if root is None else [b @ root for b in blocks]
        _, r_o = torch.linalg.qr(torch.cat(seen, dim=1).T)  # [W_O^j N]^T = Q_o R_o
        u, s, _ = torch.linalg.svd(p @ r_o.T)  # M = P R_o^T Q_o^T
        out.append((p, u, s, blocks))
    return out


@torch.no_grad()
def vo_truncate(
    wv: torch.Tensor,
    wo: torch.Tensor,
    bv: torch.Tensor | None,
    grams: torch.Tensor,
    *,
    num_kv_heads: int,
    rank: int,
    factors: list[tuple] | None = None,
    metric: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Activation-aware rank-`rank` VO maps per key/value head, the value factor shared by its g query heads.

    wv: (H_kv d_h, d), wo: (d, H d_h) in Linear layout, bv: (H_kv d_h,) or None; grams: (H_kv, d_h, d_h) value-space
    Grams E of what the output maps read: E = W_V^T C W_V for inputs with C = X^T X (`value_grams`; then this is the
    DESIGN.md 2.2a solution with C = L L^T, M = L^T W_V [W_O^1 ... W_O^g]), or sum_j O_j^T O_j of the attention-mixed
    values O_j = A_j X W_V of the group's query heads (the input the maps actually see). Minimises
    sum_j ||E^1/2 (W_O^j - T T' W_O^j)||^2 over rank-r projections T T' of value space through the SVD of
    M = E^1/2 [W_O^1 ... W_O^g] = U S V^T: T = E^-1/2 U_r, T' = U_r^T E^1/2; W_V <- W_V T, W_O^j <- T' W_O^j,
    b_V <- b_V T. metric (d, d), optional: an output-space metric Q (e.g. the Fisher metric of the attention output,
    `compress.sensitivity.fisher_metric`): the error is then measured as sum_j ||E^1/2 (I - T T') W_O^j Q^1/2||^2,
    through the SVD of E^1/2 [W_O^1 Q^1/2 ... W_O^g Q^1/2]. Returns (wv (H_kv r, d), wo (d, H r), bv (H_kv r,) or
    None, the singular values S (H_kv, d_h))."""
    dh = wv.shape[0] // num_kv_heads
    if not 1 <= rank <= dh:
        raise ValueError(f"`rank` must be in [1, {dh}], got {rank}")
    factors = factors or _vo_factors(wo, grams, num_kv_heads, metric)
    new_v, new_o, new_b, spectra = [], [], [], []
    for kv, (p, u, s, blocks) in enumerate(factors):
        w_v = wv[kv * dh : (kv + 1) * dh].double().T  # (d, d_h)
        spectra.append(s)
        u_r = u[:, :rank]
        t = torch.linalg.pinv(p, hermitian=True) @ u_r  # (d_h, r)
        t_left = u_r.T @ p  # (r, d_h)
        new_v.append((w_v @ t).T)  # (r, d)
        new_o.append(torch.cat([(t_left @ b).T for b in blocks], dim=1))  # (d, g r)
        if bv is not None:
            new_b.append(bv[kv * dh : (kv + 1) * dh].double() @ t)
    wv_new = torch.cat(new_v, 0).to(wv.dtype)
    wo_new = torch.cat(new_o, 1).to(wo.dtype)
    bv_new = torch.cat(new_b).to(bv.dtype) if bv is not None else None
    return wv_new, wo_new, bv_new, torch.stack(spectra)


@torch.no_grad()
def qk_pair_scores(
    wq: torch.Tensor, wk: torch.Tensor, bq: torch.Tensor | None, bk: torch.Tensor | None, cov: torch.Tensor,
    mean: torch.Tensor | None = None, n: int = 1, *, num_kv_heads: int,
) -> torch.Tensor:
    """Gauge-invariant size of each rotary pair p of each key head: sum over its g query heads of
    sqrt(E|q_p|^2 E|k_p|^2), from C = X^T X (and the input mean, for biases). Shape (H_kv, r/2)."""
    r = wk.shape[0] // num_kv_heads
    h = wq.shape[0] // r
    g = h // num_kv_heads
    cov = cov.double() / max(n, 1)

    def energy(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        e = ((w.double() @ cov) * w.double()).sum(-1)  # E (x w)^2 per output coordinate
        if b is not None:
            mu = torch.zeros(w.shape[1], dtype=torch.float64, device=w.device) if mean is None else mean.double()
            e = e + 2 * b.double() * (w.double() @ mu) + b.double() ** 2
        e = e.view(-1, r)
        return e[:, : r // 2] + e[:, r // 2 :]  # (heads, r/2) pair energies

    eq = energy(wq, bq).view(num_kv_heads, g, r // 2)
    ek = energy(wk, bk).view(num_kv_heads, 1, r // 2)
    return (eq * ek).clamp_min(0).sqrt().sum(1)


def _pair_coordinates(keep: torch.Tensor, r: int) -> torch.Tensor:
    """Head coordinates of the kept pairs `keep` (k,) of a width-r head: [keep, keep + r/2] (the new layout)."""
    return torch.cat([keep, keep + r // 2])


@torch.no_grad()
def qk_truncate(
    wq: torch.Tensor,
    wk: torch.Tensor,
    bq: torch.Tensor | None,
    bk: torch.Tensor | None,
    pair_index: torch.Tensor,
    keep: torch.Tensor,
    *,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Keep the rotary pairs keep[h] (H_kv, k) of each key head (and of its query heads), dropping the others.

    pair_index (H_kv, r/2): the model frequency pair of each head pair. The query rows are scaled by sqrt(2k / r) so
    that the attention scaling 1/sqrt(width) of the narrower layer gives the same logits. Returns
    (wq (H 2k, d), wk (H_kv 2k, d), bq, bk, new pair_index (H_kv, k))."""
    r = wk.shape[0] // num_kv_heads
    g = wq.shape[0] // (r * num_kv_heads)
    qi, ki, factor, pairs = qk_rows(pair_index, keep, r, g)
    return (
        wq[qi] * factor,
        wk[ki],
        None if bq is None else bq[qi] * factor,
        None if bk is None else bk[ki],
        pairs,
    )


def qk_rows(
    pair_index: torch.Tensor, keep: torch.Tensor, r: int, g: int
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """What `qk_truncate` keeps: the query rows, the key rows (of the Linear-layout W_Q, W_K), the query scale
    sqrt(2k / r) and the new pair index (H_kv, k), for kept pairs keep (H_kv, k) of width-r heads with g query heads
    per key head. A truncated projection is the full one's columns at these rows (times the scale for queries)."""
    num_kv_heads, k = keep.shape
    q_rows, k_rows, pairs = [], [], []
    for kv in range(num_kv_heads):
        order = torch.sort(keep[kv]).values
        coords = _pair_coordinates(order, r)
        k_rows.append(kv * r + coords)
        for j in range(g):
            q_rows.append((kv * g + j) * r + coords)
        pairs.append(pair_index[kv][order])
    return torch.cat(q_rows), torch.cat(k_rows), math.sqrt(2 * k / r), torch.stack(pairs)


@torch.no_grad()
def mlp_unit_scores(down: torch.Tensor, gram_diag: torch.Tensor, metric: torch.Tensor | None = None) -> torch.Tensor:
    """Balanced importance a_i = sqrt(E z_i^2) ||w_down,i|| of each SwiGLU unit (invariant under the scale gauge).
    down: (d, d_ff) Linear layout; gram_diag: sum over tokens of z_i^2 (d_ff,); metric (d, d), optional: the norm of
    the unit's output direction is then ||w||_Q = sqrt(w^T Q w) (e.g. the Fisher metric of the MLP output)."""
    w = down.double()
    norms = w.norm(dim=0) if metric is None else ((metric.double() @ w) * w).sum(0).clamp_min(0).sqrt()
    return gram_diag.double().clamp_min(0).sqrt() * norms


def ridge_shift(diag: torch.Tensor, ridge: float) -> float:
    """The refits' ridge in absolute terms: `ridge` (relative) x the mean diagonal of the Gram (`diag`)."""
    return ridge * float(diag.double().mean().clamp_min(1e-12))


@torch.no_grad()
def greedy_unit_order(gram: torch.Tensor, cross: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """SwiGLU units in the order of forward selection for the refit: each next unit is the one whose addition
    explains the most of the target after the least-squares refit of W_down (`mlp_refit`, `mlp_error_curve`) on the
    units chosen before it, i.e. the largest ||c_i||^2 / g_i of the residual cross term and Gram diagonal (a pivoted
    Cholesky factorisation of the regularised Gram, pivoting on the explained energy). Unlike `mlp_unit_scores` it sees
    the correlations between units: a unit that duplicates one already kept gains nothing. gram: Z^T Z (d_ff, d_ff),
    cross: Z^T Y (d_ff, d), ridge as in `mlp_refit` (relative to the mean diagonal). Returns (d_ff,) indices; the
    refit error of its first k units is `mlp_error_curve(gram, cross, ., order)[k - 1]`. Cost: O(d_ff^2 (d_ff + d))
    and one d_ff x d_ff float64 matrix beside the Gram."""
    f = gram.shape[0]
    if gram.shape != (f, f) or cross.dim() != 2 or cross.shape[0] != f:
        raise ValueError(f"gram must be (d_ff, d_ff) and cross (d_ff, d), got {tuple(gram.shape)}, {tuple(cross.shape)}")
    diag = torch.diagonal(gram).double()
    shift = ridge_shift(diag, ridge)
    residual = diag + shift  # Gram diagonal not yet explained by the chosen units' factor columns
    c = cross.double().clone()  # cross term of the part of each unit orthogonal to the chosen ones
    factor = torch.zeros(f, f, dtype=torch.float64, device=gram.device)  # pivoted Cholesky columns, in pick order
    chosen = torch.zeros(f, dtype=torch.bool, device=gram.device)
    order = torch.empty(f, dtype=torch.long, device=gram.device)
    floor = shift * 1e-6 + 1e-300
    for k in range(f):
        gain = c.pow(2).sum(1) / residual.clamp_min(floor)
        gain[chosen] = -1.0
        j = int(gain.argmax())
        pivot = float(residual[j].clamp_min(floor)) ** 0.5
        col = (gram[:, j].double() - factor[:, :k] @ factor[j, :k]) / pivot
        col[j] = pivot
        col[chosen] = 0.0
        c.sub_(col[:, None] * (c[j] / pivot)[None, :])
        residual.sub_(col * col)
        factor[:, k] = col
        chosen[j] = True
        order[k] = j
    return order


@torch.no_grad()
def mlp_refit(
    gram: torch.Tensor, cross: torch.Tensor, keep: torch.Tensor | None, ridge: float = 1e-4,
    prior: torch.Tensor | None = None,
) -> torch.Tensor:
    """Least-squares W_down (d, k) for the kept units: argmin ||Z_S W^T - Y||^2 + ridge tr(G_SS) / k ||W - W_0||^2,
    from the Gram G = Z^T Z (d_ff x d_ff) and the cross term Z^T Y (d_ff x d); W_0 = `prior` (d, k), e.g. the kept
    units' own W_down columns, or zero (None: the plain ridge). keep None: gram and cross are those of the kept units
    already, and gram (float64) is overwritten (no second k x k matrix)."""
    diag = torch.diagonal(gram) if keep is None else torch.diagonal(gram)[keep]
    shift = 0.0 if prior is None else ridge_shift(diag, ridge)  # before the factorisation overwrites the Gram
    chol = ordered_cholesky(gram, keep, ridge)  # the regularised G_SS is positive definite: one factor, in place
    c = (cross if keep is None else cross[keep]).double()
    if prior is not None:
        if prior.shape != (c.shape[1], c.shape[0]):
            raise ValueError(f"prior must be (d, k) = {(c.shape[1], c.shape[0])}, got {tuple(prior.shape)}")
        c = c + shift * prior.double().T
    return torch.cholesky_solve(c, chol).T  # (d, k)


REFIT_RIDGES: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
REFIT_BLENDS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)


@torch.no_grad()
def choose_refit(
    fit: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], held: tuple[torch.Tensor, torch.Tensor, float], *,
    ridges: tuple[float, ...] = REFIT_RIDGES, blends: tuple[float, ...] = REFIT_BLENDS,
    prior: torch.Tensor | None = None,
) -> dict[str, float]:
    """The refit of W_down (`mlp_refit`) that predicts held-back windows best: its ridge, and its blend of two targets.

    fit = (G, C, C_local): the kept units' Gram Z^T Z (k, k) and cross terms Z^T Y (k, d) of the target Y and Z^T
    Y_local of a second target (None: one target) on the fitting windows; held = (G_h, C_h, E_h): the same Gram and
    cross term of Y and the energy ||Y||^2 on the held-back windows. For every ridge (relative, as in `mlp_refit`) and
    blend b, W fits b Y + (1 - b) Y_local on the fitting windows, and its error on the held-back ones,
    ||Z_h W^T - Y_h||^2 = tr(W G_h W^T) - 2 tr(W C_h) + E_h, comes from their statistics alone (one Cholesky factor
    per ridge). prior (d, k): the refits' ridge pulls towards it, as in `mlp_refit`. Returns {"ridge", "blend",
    "held_error"} of the smallest error, relative to E_h."""
    gram, cross, local = fit
    g_h, c_h, energy = held
    k = gram.shape[0]
    if gram.shape != (k, k) or cross.shape[0] != k or g_h.shape != (k, k) or c_h.shape != cross.shape:
        raise ValueError("choose_refit: the fitting and held-back statistics must be of the same kept units")
    if local is None:
        blends = (1.0,)
    best = {"ridge": ridges[0], "blend": blends[0], "held_error": math.inf}
    for ridge in ridges:
        chol = ordered_cholesky(gram, torch.arange(k, device=gram.device), ridge)
        pull = 0.0 if prior is None else ridge_shift(torch.diagonal(gram), ridge) * prior.double().T
        for b in blends:
            c = (cross.double() if b == 1.0 else b * cross.double() + (1 - b) * local.double()) + pull
            w = torch.cholesky_solve(c, chol)  # (k, d): W^T
            err = float(((g_h.double() @ w) * w).sum() - 2 * (w * c_h.double()).sum() + energy)
            if err < best["held_error"]:
                best = {"ridge": ridge, "blend": b, "held_error": err}
    best["held_error"] = best["held_error"] / max(energy, 1e-300)
    return best


def compact_gram(gram: torch.Tensor, keep: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """G[keep][:, keep] for increasing indices `keep`, written into the first k^2 entries of `gram`'s own storage
    (contiguous (n, n); returned as a (k, k) view of it, and `gram` is overwritten): the kept units' Gram without a
    second matrix beside the d_ff x d_ff one. One pass, `rows` kept rows at a time: kept rows i0..i1-1, their kept
    columns gathered first, go to entries [i0 k, i1 k), which end before the source row of the next kept row (it
    starts at keep[i1] n >= i1 k), so no source is overwritten before it is read."""
    n, k = gram.shape[0], keep.numel()
    if gram.shape != (n, n) or not gram.is_contiguous():
        raise ValueError("compact_gram needs a contiguous square matrix")
    if k and bool((keep[1:] <= keep[:-1]).any()):
        raise ValueError("compact_gram needs increasing indices")
    flat = gram.view(-1)
    for i0 in range(0, k, rows):
        i1 = min(i0 + rows, k)
        block = gram.index_select(0, keep[i0:i1]).index_select(1, keep)  # (i1 - i0, k), a copy
        flat[i0 * k : i1 * k] = block.reshape(-1)
    return flat[: k * k].view(k, k)


def _regularised(gram: torch.Tensor, index: torch.Tensor, ridge: float) -> torch.Tensor:
    """G[index, index] (float64, a new matrix: one copy of the d_ff x d_ff Gram at most) + ridge x its mean diagonal
    on the diagonal: the regularised Gram of the refit and the error curves."""
    g = gram[index[:, None], index[None, :]].double()
    g.diagonal().add_(ridge_shift(torch.diagonal(g), ridge))
    return g


def ordered_cholesky(gram: torch.Tensor, order: torch.Tensor | None, ridge: float) -> torch.Tensor:
    """The Cholesky factor L of the regularised Gram in the order `order` (`_regularised`): the prefix k of L is the
    factor of the first k units, so one factorisation gives the refit of every prefix at once. order None: `gram`
    (float64) is already in that order and is regularised and factored in place (no second d_ff x d_ff matrix)."""
    if order is None:
        g = gram
        g.diagonal().add_(ridge_shift(torch.diagonal(g), ridge))
    else:
        g = _regularised(gram, order, ridge)
    info = torch.empty((), dtype=torch.int32, device=g.device)
    torch.linalg.cholesky_ex(g, out=(g, info))
    if int(info):
        raise torch.linalg.LinAlgError(f"the regularised Gram of the refit is not positive definite (order {int(info)})")
    return g.tril_()


def mlp_error_curve(
    gram: torch.Tensor, cross: torch.Tensor, y_energy: float, order: torch.Tensor | None, ridge: float = 1e-4
) -> torch.Tensor:
    """Least-squares residual ||Z_S W* - Y||^2 after the refit for every prefix S = order[:k], k = 1..d_ff, at once:
    with the Cholesky factor G_oo + ridge = L L^T of the Gram in that order, the energy explained by the first k units
    is the squared norm of the first k rows of L^-1 (Z^T Y)_o. Returns (d_ff,) errors (entry k-1 for k units).
    order None: gram and cross are already in that order, and gram (float64) is overwritten (`ordered_cholesky`)."""
    chol = ordered_cholesky(gram, order, ridge)
    c = cross if order is None else cross[order]
    proj = torch.linalg.solve_triangular(chol, c.double(), upper=False)  # (d_ff, d)
    explained = proj.pow(2).sum(1).cumsum(0)
    return (y_energy - explained).clamp_min(0.0)


def _qk_norms(attn: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """The per-head QK-norms of a relational attention (`RelationalConfig.qk_norm`), None without them."""
    return None if getattr(attn, "q_norm", None) is None else (attn.q_norm, attn.k_norm)


def _attention_output(
    x: torch.Tensor, w: dict, pairs: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
    *, num_heads: int, num_kv_heads: int, return_values: bool = False, qk_norm: tuple | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of full Linear-layout weights w (q, k, v, o, biases) on normalised inputs x (B, T, d); the
    rotary angles of pair pairs[h, j] from the model table cos/sin (B, T, R). Returns (B, T, d), and with
    `return_values` also the mixed values O before W_O (B, T, H, r_v). `qk_norm`: the (query, key) per-head norms
    applied before the rotary embedding (`RelationalConfig.qk_norm`). `mask`: as `_mix`."""
    b, t, _ = x.shape
    q, k, v = (F.linear(x, w[n], w.get(f"{n}_bias")) for n in ("q", "k", "v"))
    if qk_norm is not None:
        r = k.shape[-1] // num_kv_heads
        q, k = (norm(y.unflatten(-1, (-1, r))).flatten(-2) for norm, y in zip(qk_norm, (q, k), strict=True))
    out = _mix(q, k, v, pairs, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads, mask=mask)
    result = F.linear(out.reshape(b, t, -1), w["o"], w.get("o_bias"))
    return (result, out) if return_values else result


def _mix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: torch.Tensor | None, cos: torch.Tensor | None,
    sin: torch.Tensor | None, *, num_heads: int, num_kv_heads: int, mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mixed values O (B, T, H, r_v) of causal attention from the projections q (B, T, H r), k (B, T, H_kv r) and
    v (B, T, H_kv r_v), rotary pair pairs[h, j] at the model table's angles, logits scaled by 1/sqrt(r). `mask`: an
    additive mask (1, 1, T, T) instead of the plain causal one (a sliding window, `layer_inputs.window_mask`)."""
    b, t, _ = q.shape
    r = k.shape[-1] // num_kv_heads
    rv = v.shape[-1] // num_kv_heads
    q = q.view(b, t, num_heads, r).transpose(1, 2)
    k = k.view(b, t, num_kv_heads, r).transpose(1, 2)
    v = v.view(b, t, num_kv_heads, rv).transpose(1, 2)
    g = num_heads // num_kv_heads
    if cos is not None and cos.shape[-1] < r:  # partial rotary: the table turns the first cos.shape[-1] coordinates
        q, k = apply_partial_rotary(q, k, cos, sin, cos.shape[-1])
    elif cos is not None:
        columns, _, sign = rotary_layout(pairs, num_heads)
        n = num_kv_heads * r  # the key heads' part of the layout
        q, k = apply_rotary_pair_subset(q, k, cos, sin, columns[-n:], sign[-n:])
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    causal = dict(is_causal=True) if mask is None else dict(attn_mask=mask.to(q.dtype))
    return F.scaled_dot_product_attention(q, k, v, scale=r**-0.5, **causal).transpose(1, 2)


def _mixed_grams(
    values: torch.Tensor, num_kv_heads: int, token_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """From mixed values O (B, T, H, r_v): per query head E_j = O_j^T diag(w) O_j (H, r_v, r_v) and their sums over
    each key/value head's group (H_kv, r_v, r_v); w: optional token weights (B, T)."""
    h, rv = values.shape[2], values.shape[3]
    o = values.reshape(-1, h, rv).double().transpose(0, 1)  # (H, n, r_v)
    ow = o if token_weights is None else o * token_weights.reshape(1, -1, 1).double()
    per_head = ow.transpose(1, 2) @ o
    return per_head, per_head.view(num_kv_heads, h // num_kv_heads, rv, rv).sum(1)


def _vo_errors(per_head: torch.Tensor, wo: torch.Tensor, factors: list[tuple], rank: int) -> float:
    """sum_j ||O_j (I - T T') W_O^j||^2 for the rank-r projection of `vo_truncate`, from the Grams E_j."""
    rv = per_head.shape[-1]
    g = per_head.shape[0] // len(factors)
    total = 0.0
    for kv, (p, u, _, blocks) in enumerate(factors):
        u_r = u[:, :rank]
        proj = torch.linalg.pinv(p, hermitian=True) @ u_r @ u_r.T @ p  # T T'
        rest = torch.eye(rv, dtype=torch.float64, device=proj.device) - proj
        for j, b in enumerate(blocks):
            a = rest @ b  # (r_v, d)
            total += float(((per_head[kv * g + j] @ a) * a).sum())
    return total
