"""Compression baselines: magnitude / Wanda pruning at a target share, and the SliceGPT reimplementation (exact at
d' = d, counts as its closed form, shrinks to the asked size, sequential calibration, tied and untied heads)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf.compress.baselines import (
    prunable_parameters,
    prune_to_target,
    slicegpt,
    slicegpt_parameter_count,
    slicegpt_width_for,
)
from relational_hf.compress.eval import ModelGrewError, perplexity_on_windows, stored_parameters


def _llama(tied: bool, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=tied)).eval()
    with torch.no_grad():  # non-trivial gains and larger weights, so that folding and slicing are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 1.5 + 0.25)
            else:
                p.mul_(8.0)
    return model


def _data(n: int = 6, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [False, True])
def test_slicegpt_at_full_width_is_exact(tied):
    model = _llama(tied)
    sliced, report = slicegpt(model, _data(), width=TINY["hidden_size"], progress=False, allow_growth=True)
    ids = _data(2, 16, seed=5)
    with torch.no_grad():
        diff = (sliced(ids).logits - model(ids).logits).abs().max().item()
    assert diff < 1e-3 * model(ids).logits.abs().max().item()
    assert report.head == ("tied" if tied else "untied")
    assert (sliced.lm_head.weight is sliced.model.embed_tokens.weight) is tied
    with pytest.raises(ModelGrewError):  # the shortcuts make the full width larger than the source
        slicegpt(model, _data(), width=TINY["hidden_size"], progress=False)


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_slicegpt_counts_shortcuts_and_head_and_matches_the_closed_form(head):
    model = _llama(tied=True)
    width = 20
    sliced, report = slicegpt(model, _data(), width=width, head=head, progress=False)
    counts = stored_parameters(sliced)
    assert counts["total"] == report.parameters_after == slicegpt_parameter_count(model, width, head)
    assert counts["by_kind"]["other"] == report.shortcut_parameters == 2 * TINY["num_hidden_layers"] * width**2
    v = TINY["vocab_size"]
    assert counts["by_kind"]["head"] == (0 if head == "tied" else v * width)
    assert torch.isfinite(sliced(_data(1)).logits).all()


def test_slicegpt_width_for_a_target_is_the_widest_that_fits():
    model = _llama(tied=True)
    total = stored_parameters(model)["total"]
    for remove in (0.1, 0.25, 0.3):
        width = slicegpt_width_for(model, remove)
        assert slicegpt_parameter_count(model, width) <= (1 - remove) * total
        assert width == TINY["hidden_size"] or slicegpt_parameter_count(model, width + 1) > (1 - remove) * total
    sliced, report = slicegpt(model, _data(), remove=0.25, progress=False)
    assert report.removed_share >= 0.25 and report.parameters_after < total


def test_slicegpt_calibration_is_sequential_and_slicing_costs_quality():
    """Less width keeps less variance and predicts the held-out data no better than the dense model's fit."""
    model = _llama(tied=False)
    data = _data(8, 24)
    wide, r_wide = slicegpt(model, data, width=24, progress=False)
    narrow, r_narrow = slicegpt(model, data, width=12, progress=False)
    assert all(0 < k <= 1 + 1e-9 for k in r_wide.variance_kept)
    assert sum(r_narrow.variance_kept) < sum(r_wide.variance_kept)
    assert len(r_wide.variance_kept) == 1 + 2 * TINY["num_hidden_layers"]
    assert len(r_wide.shortcut_overlap) == 2 * TINY["num_hidden_layers"]
    assert all(0 < o <= 1 + 1e-9 for o in r_wide.shortcut_overlap + r_narrow.shortcut_overlap)
    ids = _data(2, 16, seed=9)
    dense = model(ids).logits
    assert (narrow(ids).logits - dense).norm() > (wide(ids).logits - dense).norm()


def test_slicegpt_rejects_bad_arguments():
    model = _llama(tied=False)
    with pytest.raises(ValueError, match="exactly one"):
        slicegpt(model, _data(), progress=False)
    with pytest.raises(ValueError, match="width"):
        slicegpt(model, _data(), width=0, progress=False)
    with pytest.raises(ValueError, match="tied"):
        slicegpt(model, _data(), width=8, head="tied", progress=False)
    with pytest.raises(ValueError, match="calibration"):
        slicegpt(model, _data().float(), width=8, progress=False)
    with pytest.raises(ValueError, match="remove"):
        slicegpt_width_for(model, 1.2)


@pytest.mark.parametrize("score", ["magnitude", "wanda"])
def test_pruning_to_a_target_removes_that_share_as_non_zeros_and_keeps_dense_storage(score):
    model = _llama(tied=True)
    total = stored_parameters(model)["total"]
    pruned, report = prune_to_target(model, score, "unstructured", remove=0.2, calibration=_data())
    assert report["stored_parameters"] == total
    assert report["removed_share_nonzero"] == pytest.approx(0.2, abs=2 * TINY["num_hidden_layers"] * 7 / total)
    pruned24, report24 = prune_to_target(model, score, "2:4", calibration=_data())
    assert report24["nonzero_parameters"] == total - prunable_parameters(model) // 2
    assert perplexity_on_windows(pruned24, _data(2, 16)) > 0
    with pytest.raises(ValueError, match="prunable"):
        prune_to_target(model, score, "unstructured", remove=0.99, calibration=_data())


def test_wanda_with_cached_feature_norms_equals_one_pass_pruning():
    from relational_hf.compress.baselines import wanda_feature_norms

    model = _llama(tied=False)
    data = _data()
    norms = wanda_feature_norms(model, data)
    for pattern, remove in (("unstructured", 0.15), ("2:4", None)):
        direct, _ = prune_to_target(model, "wanda", pattern, remove=remove, calibration=data)
        cached, _ = prune_to_target(model, "wanda", pattern, remove=remove, feature_norms=norms)
        for a, b in zip(direct.parameters(), cached.parameters()):
            assert torch.equal(a, b)


def test_slicegpt_on_the_first_layers_of_smollm2_is_exact_at_full_width_and_keeps_the_head_tied(smollm2_dir):
    """The real checkpoint (tied head, varying final gain, GQA, RoPE), cut to its first 2 layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(smollm2_dir)
    config.num_hidden_layers = 2
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, config=config, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    data = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    sliced, report = slicegpt(model, data, width=config.hidden_size, progress=False, allow_growth=True)
    with torch.no_grad():
        dense = model(ids).logits
        assert (sliced(ids).logits - dense).abs().max().item() <= 1e-3 * dense.abs().max().item()
    assert sliced.lm_head.weight is sliced.model.embed_tokens.weight and report.head == "tied"
    smaller, small_report = slicegpt(model, data, remove=0.25, progress=False)
    assert small_report.parameters_after <= 0.75 * stored_parameters(model)["total"]
    assert small_report.parameters_after == slicegpt_parameter_count(model, small_report.width)
