"""Slicing of relational models keeps a tied head tied and never grows a model."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_relational

from relational_hf.compress.eval import ModelGrewError, check_not_grown, stored_parameters
from relational_hf.compress.slicing import slice_relational


def _tied_with_varying_gain():
    model = tiny_relational(tie_word_embeddings=True, final_norm_gain=True, seed=0).eval()
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.linspace(0.3, 2.0, model.config.hidden_size))
        for p in model.parameters():
            p.mul_(3.0)  # away from the near-uniform initial predictions
    return model


def test_slicing_nothing_is_exact_and_keeps_the_head_tied():
    model = _tied_with_varying_gain()
    data = torch.randint(0, model.config.vocab_size, (6, 20), generator=torch.Generator().manual_seed(1))
    sliced, report = slice_relational(model, 0.0, data)
    assert sliced.lm_head.weight is sliced.model.embed_tokens.weight and sliced.config.tie_word_embeddings
    assert not report.head_untied
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (sliced(ids).logits - model(ids).logits).abs().max().item() < 1e-4
    assert report.parameters_after == report.parameters_before == stored_parameters(model)["total"]


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_slicing_a_tied_head_with_a_varying_gain_always_shrinks(fraction):
    model = _tied_with_varying_gain()
    data = torch.randint(0, model.config.vocab_size, (6, 20), generator=torch.Generator().manual_seed(1))
    sliced, report = slice_relational(model, fraction, data)
    d, d_new, v = model.config.hidden_size, sliced.config.hidden_size, model.config.vocab_size
    assert d_new == d - round(fraction * d)
    assert sliced.lm_head.weight is sliced.model.embed_tokens.weight
    assert report.parameters_after == stored_parameters(sliced)["total"] < report.parameters_before
    # every d-sized dimension shrinks to d': the count is (d'/d) times the source's
    assert report.parameters_after * d == report.parameters_before * d_new
    assert sliced.model.embed_tokens.weight.shape == (v, d_new)
    assert torch.isfinite(sliced(data[:1]).logits).all()


def test_the_gain_becomes_the_spectrum_of_its_compression_to_the_kept_subspace():
    """At d' = d the new gain is the sorted old gain (eigenvalues of Q^T diag(g) Q for orthogonal Q)."""
    model = _tied_with_varying_gain()
    data = torch.randint(0, model.config.vocab_size, (6, 20), generator=torch.Generator().manual_seed(1))
    sliced, _ = slice_relational(model, 0.0, data)
    expected = model.model.norm.weight.detach().sort(descending=True).values
    assert torch.allclose(sliced.model.norm.weight.detach(), expected, atol=1e-5)


def test_bad_fraction_and_growth_are_refused():
    model = _tied_with_varying_gain()
    data = torch.randint(0, model.config.vocab_size, (2, 8))
    with pytest.raises(ValueError, match="fraction"):
        slice_relational(model, 1.0, data)
    with pytest.raises(ValueError, match="fraction"):
        slice_relational(model, -0.1, data)
    with pytest.raises(ModelGrewError, match="more than the source"):
        check_not_grown(100, 101, "test method")
    check_not_grown(model, model)  # equal size is allowed
