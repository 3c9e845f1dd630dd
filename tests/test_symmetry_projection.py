"""Projected updates: orthogonal to the orbits, conserve the balance to second order in the step (plain AdamW
drifts at first order), stay finite on rank-deficient heads, and the wrapped optimiser round-trips its state."""

from __future__ import annotations

import copy

import pytest
import torch
from test_symmetry_zoo import (
    build,
    perturb,
    token_ids,
)

from relational_hf.symmetry import (
    ProjectedOptimizer,
    UpdateProjector,
    orbit_balance,
    orbit_drift,
    symmetry_groups,
    vertical_horizontal_split,
)


def _inner(a: dict, b: dict) -> float:
    return sum(float((a[k].double() * b[k].double()).sum()) for k in a)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gpt2", "relational_free", "relational_free_none_vpr"])
@pytest.mark.parametrize("residual", [False, True])
def test_projected_update_is_orthogonal_to_random_vertical_directions(name, residual):
    model = perturb(build(name)).double()
    projector = UpdateProjector(model, residual=residual, tol=1e-11, max_iter=300)
    generator = torch.Generator().manual_seed(0)
    delta = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in projector.params.items()}
    vertical = projector.vertical_part(delta)
    horizontal = {k: delta[k] - vertical[k] for k in delta}
    assert projector.last_stats.vertical_share > 0.01  # a random update has a vertical part
    h_norm = _inner(horizontal, horizontal) ** 0.5
    for group in projector.groups:
        probe = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in projector.params.items()}
        direction = {k: torch.zeros_like(v) for k, v in delta.items()}
        group.vertical(group.adjoint(probe), direction)  # xi(X) for a random X of the group's algebra
        cos = _inner(horizontal, direction) / (h_norm * _inner(direction, direction) ** 0.5)
        assert abs(cos) < 1e-8, group.key
    again = projector.vertical_part(horizontal)  # the horizontal part has no vertical part left
    assert _inner(again, again) ** 0.5 < 1e-8 * h_norm


def test_split_by_parameter_name_adds_up_and_leaves_other_tensors_horizontal():
    model = perturb(build("llama")).double()
    update = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    vertical, horizontal = vertical_horizontal_split(model, update)
    for n in update:
        assert torch.allclose(vertical[n] + horizontal[n], update[n])
    embed = "model.embed_tokens.weight"  # only the residual rotation moves the embedding; it is not projected here
    assert vertical[embed].abs().max() == 0
    assert vertical["model.layers.0.self_attn.k_proj.weight"].abs().max() > 0


def _adamw_balance_drift(model: torch.nn.Module, lr: float, project: bool) -> float:
    model = copy.deepcopy(model)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    optimizer = ProjectedOptimizer(inner, model, tol=1e-13, max_iter=200) if project else inner
    before = orbit_balance(model)
    ids = token_ids(batch=4, length=16)
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return orbit_drift(before, orbit_balance(model))["total"]


@pytest.mark.parametrize("name", ["llama", "relational_free"])
def test_balance_is_conserved_to_second_order_with_projection_and_drifts_without(name):
    """One AdamW step of size lr: the balance W_Q^T W_Q - W_K^T W_K (and VO, gains, MLP scales) changes by O(lr)
    without projection and by O(lr^2) with it, so a 10x smaller step shrinks the drift ~10x vs ~100x."""
    model = perturb(build(name)).double().train()
    free = [_adamw_balance_drift(model, lr, project=False) for lr in (1e-3, 1e-4)]
    projected = [_adamw_balance_drift(model, lr, project=True) for lr in (1e-3, 1e-4)]
    assert 5 < free[0] / free[1] < 20  # first order
    assert projected[0] / projected[1] > 60  # second order
    assert projected[1] < 0.05 * free[1]


def test_rank_deficient_heads_give_finite_projections():
    model = perturb(build("llama")).double()
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight[:8].zero_()  # query head 0 entirely zero
        attn.k_proj.weight[:8] = attn.k_proj.weight[:1].expand(8, -1)  # key head 0 of rank 1
        attn.v_proj.weight[8:].zero_()  # value head 1 zero
    projector = UpdateProjector(model, tol=1e-12, max_iter=300)
    generator = torch.Generator().manual_seed(1)
    delta = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in projector.params.items()}
    vertical = projector.vertical_part(delta)
    assert all(torch.isfinite(v).all() for v in vertical.values())
    horizontal = {k: delta[k] - vertical[k] for k in delta}
    for group in projector.groups:
        probe = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in projector.params.items()}
        direction = {k: torch.zeros_like(v) for k, v in delta.items()}
        group.vertical(group.adjoint(probe), direction)
        scale = (_inner(horizontal, horizontal) * _inner(direction, direction)) ** 0.5
        assert abs(_inner(horizontal, direction)) < 1e-7 * scale, group.key


def test_projected_optimizer_state_dict_round_trip_and_scheduler():
    model_a = perturb(build("relational_free"))
    model_b = copy.deepcopy(model_a)
    ids = token_ids(batch=2, length=8)

    def train(model, optimizer, steps):
        for _ in range(steps):
            optimizer.zero_grad()
            model(ids, labels=ids).loss.backward()
            optimizer.step()

    opt_a = ProjectedOptimizer(torch.optim.AdamW(model_a.parameters(), lr=1e-3), model_a)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda step: 0.5)  # accepts the wrapper
    assert opt_a.param_groups[0]["lr"] == pytest.approx(5e-4)
    train(model_a, opt_a, 2)
    scheduler.step()
    state = copy.deepcopy(opt_a.state_dict())
    assert state["symmetry_projection"]["projected_steps"] == 2
    model_b.load_state_dict(model_a.state_dict())
    opt_b = ProjectedOptimizer(torch.optim.AdamW(model_b.parameters(), lr=1e-3), model_b)
    opt_b.load_state_dict(state)
    assert opt_b.projected_steps == 2 and opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    train(model_a, opt_a, 1)
    train(model_b, opt_b, 1)
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert opt_a.last_stats.vertical_share < 1.0


def test_projection_skips_groups_on_frozen_parameters():
    model = build("llama")
    for layer in model.model.layers:
        layer.self_attn.k_proj.weight.requires_grad_(False)
    keys = {g.key for g in UpdateProjector(model).groups}
    all_keys = {g.key for g in symmetry_groups(model)[0]}
    assert "layers.0.qk_gauge" in all_keys and "layers.0.qk_gauge" not in keys
    assert "layers.0.vo_gauge" in keys


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_float32_projection_is_orthogonal_to_float32_precision(name):
    model = perturb(build(name))
    projector = UpdateProjector(model, residual=True, tol=1e-6, max_iter=300)
    assert projector.dtype == torch.float32
    generator = torch.Generator().manual_seed(0)
    delta = {k: torch.randn(p.shape, generator=generator) for k, p in projector.params.items()}
    vertical = projector.vertical_part(delta)
    horizontal = {k: delta[k] - vertical[k] for k in delta}
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in vertical.values())
    for group in projector.groups:
        probe = {k: torch.randn(p.shape, generator=generator) for k, p in projector.params.items()}
        direction = {k: torch.zeros_like(v) for k, v in delta.items()}
        group.vertical(group.adjoint(probe), direction)
        scale = (_inner(horizontal, horizontal) * _inner(direction, direction)) ** 0.5
        assert abs(_inner(horizontal, direction)) < 1e-4 * scale, group.key


def _relative_difference(a: dict, b: dict) -> float:
    diff = {k: a[k].double() - b[k].double() for k in a}
    return (_inner(diff, diff) / _inner(a, a)) ** 0.5


def test_disjoint_groups_take_the_direct_solve_which_equals_full_cg():
    """Free-gauge relational model: the groups touch disjoint tensors, so the default solver answers with one
    preconditioned solve (no residual evaluation); it agrees with CG on the full normal equations."""
    model = perturb(build("relational_free")).double()
    direct = UpdateProjector(model, tol=1e-12, max_iter=300)
    reference = UpdateProjector(model, tol=1e-12, max_iter=300, solver="cg")
    assert all(not block.second for block in direct.blocks)  # every group eliminated exactly
    generator = torch.Generator().manual_seed(2)
    delta = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in direct.params.items()}
    vertical = direct.vertical_part(delta)
    assert direct.last_stats.iterations == 1
    expected = reference.vertical_part(delta)
    assert reference.last_stats.iterations >= 1
    assert _relative_difference(expected, vertical) < 1e-6
    assert direct.last_stats.vertical_norm == pytest.approx(reference.last_stats.vertical_norm, rel=1e-6)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2"])
def test_coupled_groups_schur_solve_equals_full_cg_and_is_horizontal(name):
    """Llama-type models: norm gains share W_Q/W_K/W_V/W_up with the QK/VO/MLP groups. The default solver
    eliminates the disjoint groups exactly and runs CG on the rest; it converges to the full CG solution and leaves
    a horizontal part with xi^T h ~ 0 for every group."""
    model = perturb(build(name)).double()
    projector = UpdateProjector(model, tol=1e-12, max_iter=500)
    reference = UpdateProjector(model, tol=1e-12, max_iter=500, solver="cg")
    assert any(block.first and block.second for block in projector.blocks)  # coupled: both parts of the split used
    generator = torch.Generator().manual_seed(3)
    delta = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in projector.params.items()}
    vertical = projector.vertical_part(delta)
    assert projector.last_stats.residual <= 1e-12
    assert _relative_difference(reference.vertical_part(delta), vertical) < 1e-6
    horizontal = {k: delta[k] - vertical[k] for k in delta}
    for group in projector.groups:
        moment = torch.cat([t.reshape(-1) for t in group.adjoint(horizontal)])
        scale = torch.cat([t.reshape(-1) for t in group.adjoint(delta)])
        assert moment.norm() < 1e-8 * scale.norm(), group.key


@pytest.mark.parametrize("name", ["llama", "relational_free"])
def test_projected_optimizer_step_equals_reference_projection_at_old_parameters(name):
    """The optimiser projects at theta_old through a snapshot (the live parameters are not restored); the result
    equals theta_old + delta - P_V(delta) with P_V from full CG at theta_old."""
    model = perturb(build(name)).double().train()
    reference_model = copy.deepcopy(model)
    ids = token_ids(batch=2, length=8)
    optimizer = ProjectedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, tol=1e-12, max_iter=300)
    model(ids, labels=ids).loss.backward()
    optimizer.step()

    inner = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    reference = UpdateProjector(reference_model, tol=1e-12, max_iter=300, solver="cg")
    reference_model(ids, labels=ids).loss.backward()
    old = {k: p.detach().clone() for k, p in reference.params.items()}
    inner.step()
    delta = {k: p.detach() - old[k] for k, p in reference.params.items()}
    with torch.no_grad():
        for k, p in reference.params.items():
            p.copy_(old[k])
    vertical = reference.vertical_part(delta)
    names = dict(model.named_parameters())
    for k in reference.params:
        expected = old[k] + delta[k] - vertical[k]
        got = names[reference.names[k]].detach()
        assert (got - expected).abs().max() <= 1e-7 * delta[k].abs().max() + 1e-15, reference.names[k]


def test_projection_lives_on_the_wrapped_optimizers_public_hooks():
    """Stepping the wrapped optimiser itself projects exactly as stepping the wrapper does; a post-hook registered
    on the wrapper sees the projected parameters; `unwrap` restores the plain, unprojected steps; a projected
    optimiser is not wrapped twice."""
    base = perturb(build("relational_free"))
    ids = token_ids(batch=2, length=8)

    def one_step(model, stepper):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        stepper.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model_a, model_b, model_c = (copy.deepcopy(base) for _ in range(3))
    wrapper_a = ProjectedOptimizer(torch.optim.AdamW(model_a.parameters(), lr=1e-2), model_a)
    inner_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2)
    wrapper_b = ProjectedOptimizer(inner_b, model_b)
    seen = []
    wrapper_b.register_step_post_hook(lambda opt, args, kwargs: seen.append(next(model_b.parameters()).clone()))
    after_a = one_step(model_a, wrapper_a)
    after_b = one_step(model_b, inner_b)  # the inner optimiser, stepped directly
    assert torch.equal(after_a, after_b) and wrapper_b.projected_steps == 1
    assert torch.equal(seen[0], next(model_b.parameters()))

    after_plain = one_step(model_c, torch.optim.AdamW(model_c.parameters(), lr=1e-2))
    assert not torch.allclose(after_a, after_plain)  # the projection changed the step
    model_a.load_state_dict(base.state_dict())
    unwrapped = ProjectedOptimizer(torch.optim.AdamW(model_a.parameters(), lr=1e-2), model_a).unwrap()
    assert torch.equal(one_step(model_a, unwrapped), after_plain)
    with pytest.raises(TypeError, match="optimizer"):
        ProjectedOptimizer(wrapper_a, model_a)
