"""Canonical gauges (dressing): the function is preserved, and every point of an orbit canonicalises to the same
parameters; degenerate spectra are detected and broken deterministically."""

from __future__ import annotations

import copy

import pytest
import torch
from test_symmetry_zoo import (
    build,
    perturb,
    token_ids,
)

from relational_hf.symmetry import apply_random_symmetry, canonicalize
from relational_hf.symmetry.algebra import balanced_factors


def _max_state_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(
        (sa[k].double() - sb[k].double()).abs().max().item()
        if sa[k].is_floating_point()
        else float((sa[k] != sb[k]).any())
        for k in sa
    )


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "llama_tied_bias",
        "qwen2",
        "qwen3",
        "gpt2",
        "relational_free",
        "relational_free_none_vpr",
        "relational_pivot",
        "relational_pivot_vpr",
    ],
)
def test_orbit_canonicalises_to_one_point_and_function_is_kept(name):
    model = perturb(build(name)).double()
    ids = token_ids()
    reference = model(ids).logits
    moved = apply_random_symmetry(copy.deepcopy(model), torch.Generator().manual_seed(11), scale=0.5)
    assert _max_state_difference(model, moved) > 1e-2  # really a different point of the orbit
    canonical, report = canonicalize(model, return_report=True)
    canonical_moved = canonicalize(moved)
    assert (canonical(ids).logits - reference).abs().max().item() < 1e-6
    assert _max_state_difference(canonical, canonical_moved) < 1e-7
    assert report.groups  # something was fixed
    assert _max_state_difference(model, canonical) > 0  # and the input model was left alone (a copy moved)
    assert (model(ids).logits - reference).abs().max().item() == 0


def test_canonical_form_is_balanced_and_sign_fixed():
    """Balanced SVD gauge: W_Q^T W_Q = W_K^T W_K = S (diagonal), largest-magnitude entry of each U column positive."""
    model = canonicalize(perturb(build("relational_free_none_vpr")).double())
    attn = model.model.layers[0].self_attn
    r = 8
    q = attn.q_proj.weight.detach().reshape(4, r, -1).transpose(1, 2)  # (H, d, r) = W_Q per head
    k = attn.k_proj.weight.detach().reshape(4, r, -1).transpose(1, 2)
    q = torch.cat([q, attn.q_proj.bias.detach().reshape(4, 1, r)], 1)
    gq, gk = q.transpose(1, 2) @ q, k.transpose(1, 2) @ k
    assert torch.allclose(gq, gk, atol=1e-10)
    assert torch.allclose(gq, torch.diag_embed(torch.diagonal(gq, dim1=1, dim2=2)), atol=1e-10)
    lead = torch.gather(q, 1, q.abs().argmax(1, keepdim=True))
    assert (lead > 0).all()


def test_degenerate_singular_values_are_reported_and_broken_invariantly():
    """G = A B^T with two equal singular values: any rotation inside that pair gives the same G; the canonical
    factors must not depend on it, and the cluster must be reported."""
    generator = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(12, 3, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(10, 3, generator=generator, dtype=torch.float64))
    s = torch.tensor([3.0, 2.0, 2.0], dtype=torch.float64)
    a, b = u * s.sqrt(), v * s.sqrt()
    theta = torch.tensor(0.7, dtype=torch.float64)
    rot = torch.eye(3, dtype=torch.float64)
    rot[1:, 1:] = torch.stack([torch.stack([theta.cos(), -theta.sin()]), torch.stack([theta.sin(), theta.cos()])])
    mix = torch.randn(3, 3, generator=generator, dtype=torch.float64) + 3 * torch.eye(3)
    a2, b2 = (a @ rot) @ mix, (b @ rot) @ torch.linalg.inv(mix).T  # same G, different factors
    a_c, b_c, sv, degs = balanced_factors(a[None], b[None])
    a_c2, b_c2, _, degs2 = balanced_factors(a2[None], b2[None])
    assert len(degs) == 1 and degs[0].indices == [1, 2] and len(degs2) == 1
    assert torch.allclose(sv[0], s, atol=1e-12)
    assert torch.allclose(a_c, a_c2, atol=1e-10) and torch.allclose(b_c, b_c2, atol=1e-10)
    assert torch.allclose(a_c[0] @ b_c[0].T, a @ b.T, atol=1e-12)
