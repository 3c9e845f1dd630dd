"""Sampled Fisher directions (`relational_hf.compress.sensitivity`): the second-order KL estimate, and the closed forms
the planner uses for the VO and MLP truncations."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_relational

from relational_hf.compress.lowrank import _mixed_grams
from relational_hf.compress.sensitivity import fisher_directions, fisher_energy, mlp_fisher_curve, vo_fisher_errors
from relational_hf.compress.truncation import _vo_factors, mlp_refit, mlp_unit_scores, vo_truncate


def _kl(model, ids, module, change) -> float:
    """Actual sum_t KL(p_t || p_t') when `change` is added to `module`'s output."""

    def add(mod, args, out):
        return (out[0] + change, *out[1:]) if isinstance(out, tuple) else out + change

    with torch.no_grad():
        p = model(ids).logits[:, :-1].double().log_softmax(-1)
        handle = module.register_forward_hook(add)
        q = model(ids).logits[:, :-1].double().log_softmax(-1)
        handle.remove()
    return float((p.exp() * (p - q)).sum())


def test_fisher_energy_predicts_the_kl_of_a_small_change():
    """For a small change of a sublayer output, 1/(2K) sum (g . e)^2 over sampled Fisher directions matches the actual
    KL of the next-token distributions (second order; K = 256 samples keeps the estimate's noise small), at both sites
    of both layers; the model's weights and requires_grad flags are untouched."""
    model = tiny_relational(gauge="pivot", seed=0).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 48, (4, 16))
    dirs = fisher_directions(model, ids, samples=256, batch_size=2, dtype=torch.float32)
    assert len(dirs) == 2 and dirs[0]["mlp"].shape == (256, 4, 16, 32)
    for li, site in ((0, "attn"), (1, "attn"), (0, "mlp"), (1, "mlp")):
        change = torch.randn(4, 16, 32) * 2e-3
        module = getattr(model.model.layers[li], "self_attn" if site == "attn" else "mlp")
        predicted, actual = fisher_energy(change, dirs[li][site]), _kl(model, ids, module, change)
        assert predicted == pytest.approx(actual, rel=0.15), (li, site)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())


def test_fisher_directions_are_reproducible_and_validate_input():
    model = tiny_relational(gauge="pivot", seed=0).eval()
    ids = torch.randint(0, 48, (2, 8))
    a = fisher_directions(model, ids, samples=2, seed=3)
    b = fisher_directions(model, ids, samples=2, seed=3)
    assert torch.equal(a[1]["mlp"], b[1]["mlp"])
    with pytest.raises(ValueError, match="ids"):
        fisher_directions(model, ids[0])
    with pytest.raises(ValueError, match="samples"):
        fisher_directions(model, ids, samples=0)
    with pytest.raises(ValueError, match="does not match"):
        fisher_energy(torch.zeros(2, 8, 5), a[0]["attn"])


def test_mlp_fisher_curve_equals_the_refit_changes():
    """The cumulative closed form gives, for every prefix of the unit order, the Fisher energy of the change made by
    the ridge refit of W_down on exactly those units."""
    n, f, d, k = 120, 16, 6, 3
    z = torch.randn(n, f)
    y = z @ torch.randn(f, d) + 0.1 * torch.randn(n, d)
    w = torch.rand(n)
    gram = (z * w[:, None]).T.double() @ z.double()
    cross = (z * w[:, None]).T.double() @ y.double()
    order = torch.randperm(f)
    dirs = torch.randn(k, 1, n, d)
    curve = mlp_fisher_curve(z, y, gram, cross, order, 1e-2, dirs)
    lam = 1e-2 * float(torch.diagonal(gram).mean())
    for units in (1, 7, f):
        keep = order[:units]
        refit = torch.linalg.solve(gram[keep][:, keep] + lam * torch.eye(units, dtype=torch.float64), cross[keep])
        change = z[:, keep].double() @ refit - y.double()
        assert float(curve[units - 1]) == pytest.approx(fisher_energy(change[None].float(), dirs), rel=1e-4)
    # the refit of `mlp_refit` on the whole set agrees with the curve's solution up to its ridge convention
    full = mlp_refit(gram, cross, order, 1e-2)
    assert full.shape == (d, f)


def test_vo_fisher_errors_equal_the_truncated_outputs():
    """The value-space closed form equals the Fisher energy of the actual output change of `vo_truncate` at each rank
    (GQA: 2 key/value heads shared by 4 query heads)."""
    b, t, h, nkv, rv, d, k = 2, 10, 4, 2, 6, 12, 3
    wv, wo = torch.randn(nkv * rv, d), torch.randn(d, h * rv)
    x = torch.randn(b, t, d)
    mixed = (x @ wv.T).view(b, t, nkv, rv).repeat_interleave(h // nkv, 2) + 0.1 * torch.randn(b, t, h, rv)
    _, grams = _mixed_grams(mixed, nkv)
    factors = _vo_factors(wo, grams, nkv)
    dirs = torch.randn(k, b, t, d)
    errs = vo_fisher_errors(mixed, wo, factors, [2, 5], dirs)
    dense = mixed.reshape(b, t, -1) @ wo.T
    for rank, err in zip([2, 5], errs, strict=True):
        v2, o2, _, _ = vo_truncate(wv, wo, None, grams, num_kv_heads=nkv, rank=rank)
        # the truncated maps read the mixed values through T: o_j T, i.e. the projection onto the kept value space
        t_maps = [torch.linalg.lstsq(wv[i * rv : (i + 1) * rv].T, v2[i * rank : (i + 1) * rank].T).solution for i in range(nkv)]
        reduced = torch.cat(
            [mixed[:, :, j] @ t_maps[j // (h // nkv)] for j in range(h)], dim=-1
        )  # (B, T, H r)
        change = reduced @ o2.T - dense
        assert err == pytest.approx(fisher_energy(change, dirs), rel=1e-3)


def test_vo_truncation_in_a_metric_minimises_the_metric_error():
    """With an output-space metric Q, the rank-r VO maps have a smaller sum_j ||O_j (G_j - G_j,r) Q^1/2||^2 than the
    Euclidean choice (and the Euclidean choice is better in the Euclidean norm); the metric identity changes nothing."""
    b, t, h, nkv, rv, d = 2, 40, 4, 2, 6, 10
    wv, wo = torch.randn(nkv * rv, d, dtype=torch.float64), torch.randn(d, h * rv, dtype=torch.float64)
    mixed = torch.randn(b, t, h, rv, dtype=torch.float64)
    _, grams = _mixed_grams(mixed, nkv)
    a = torch.randn(d, d, dtype=torch.float64)
    metric = a @ a.T * torch.logspace(0, -3, d, dtype=torch.float64)
    metric = metric @ metric.T

    def error(o2, v2, rank, q):
        t_maps = [torch.linalg.lstsq(wv[i * rv : (i + 1) * rv].T, v2[i * rank : (i + 1) * rank].T).solution for i in range(nkv)]
        reduced = torch.cat([mixed[:, :, j] @ t_maps[j // (h // nkv)] for j in range(h)], dim=-1)
        change = reduced @ o2.T - mixed.reshape(b, t, -1) @ wo.T
        return float(((change @ q) * change).sum())

    eye = torch.eye(d, dtype=torch.float64)
    v_e, o_e, _, _ = vo_truncate(wv, wo, None, grams, num_kv_heads=nkv, rank=3)
    v_m, o_m, _, _ = vo_truncate(wv, wo, None, grams, num_kv_heads=nkv, rank=3, metric=metric)
    v_i, o_i, _, _ = vo_truncate(wv, wo, None, grams, num_kv_heads=nkv, rank=3, metric=eye)
    assert error(o_m, v_m, 3, metric) < error(o_e, v_e, 3, metric)
    assert error(o_e, v_e, 3, eye) < error(o_m, v_m, 3, eye)
    torch.testing.assert_close(o_i, o_e)
    torch.testing.assert_close(v_i, v_e)


def test_mlp_unit_scores_in_a_metric_are_scale_invariant():
    """The metric score sqrt(E z_i^2) ||w_down,i||_Q is unchanged by the per-unit scale gauge (z_i c, w_i / c) and
    equals the Euclidean score for Q = I."""
    n, f, d = 50, 12, 7
    z, down = torch.randn(n, f, dtype=torch.float64), torch.randn(d, f, dtype=torch.float64)
    a = torch.randn(d, d, dtype=torch.float64)
    metric = a @ a.T
    c = torch.rand(f, dtype=torch.float64) + 0.5
    before = mlp_unit_scores(down, (z * z).sum(0), metric)
    after = mlp_unit_scores(down / c, ((z * c) ** 2).sum(0), metric)
    torch.testing.assert_close(before, after)
    torch.testing.assert_close(mlp_unit_scores(down, (z * z).sum(0), torch.eye(d, dtype=torch.float64)),
                               mlp_unit_scores(down, (z * z).sum(0)))
