"""Conversion of Llama / Mistral / Qwen2 into the relational pivot gauge: exact logits, exact parameter savings,
refusals, principal-gauge slicing, and the `convert` command's checkpoint."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_symmetry_zoo import (
    VOCAB,
    build,
    perturb,
    token_ids,
)
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import relational_hf
from relational_hf.architectures import UnsupportedModelError
from relational_hf.commands.main import main
from relational_hf.convert import (
    ConversionError,
    to_relational,
)

# zoo sizes: d = 32, d_ff = 64, L = 2, H = 4, H_kv = 2, d_h = 8, V = 128
D, F, L, HKV, DH = 32, 64, 2, 2, 8
REMOVED = L * (HKV * DH + HKV * DH * DH + F)  # RoPE commutant + GL(d_h) + SwiGLU scales = 2 x 208
GAINS = (2 * L + 1) * D


def _scaled(model: torch.nn.Module) -> torch.nn.Module:
    """Random norm gains and biases, weights x4: logits of order one, so agreement is not trivial."""
    perturb(model, scale=0.3)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
        final = model.model.norm.weight
        final.add_(0.3 * torch.randn(final.shape, generator=torch.Generator().manual_seed(5)))
    return model


@pytest.mark.parametrize("name", ["llama", "llama_tied_bias", "mistral", "qwen2"])
def test_conversion_is_exact_and_saves_exactly_the_orbit_dimensions(name):
    source = _scaled(build(name))
    relational, report = to_relational(source, return_report=True)
    assert isinstance(relational, relational_hf.RelationalForCausalLM) and relational.config.gauge == "pivot"
    ids = token_ids(batch=3, length=20, seed=9)
    expected = source(ids).logits
    assert expected.abs().max() > 1.0
    assert (relational(ids).logits - expected).abs().max().item() < 1e-4
    assert report.max_logit_difference < 1e-4
    tied = source.config.tie_word_embeddings
    stored = sum(p.numel() for p in relational.parameters())
    source_total = sum(p.numel() for p in source.parameters())
    # the final gain (randomised above) folds into an untied head and is kept in front of a tied one
    assert stored == source_total - GAINS - REMOVED + (D if tied else 0)
    assert report.kept_final_gain == (D if tied else 0)
    assert relational.config.tie_word_embeddings == relational.config.final_norm_gain == tied


def test_tied_head_stays_tied_behind_its_final_gain_and_keeps_gqa_and_biases():
    source = _scaled(build("llama_tied_bias"))  # biases, per-layer and final gains random
    relational = to_relational(source)
    assert relational.config.tie_word_embeddings and relational.lm_head.weight is relational.model.embed_tokens.weight
    assert torch.equal(relational.model.norm.weight, source.model.norm.weight)
    assert relational.config.num_key_value_heads == 2
    assert relational.config.attention_bias and relational.config.attention_output_bias
    stored = sum(p.numel() for p in relational.parameters())
    assert stored == sum(p.numel() for p in source.parameters()) - GAINS - REMOVED + D
    ids = token_ids()
    assert (relational(ids).logits - source(ids).logits).abs().max().item() < 1e-4


def test_rope_scaling_settings_are_carried_over():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    torch.manual_seed(0)
    source = _scaled(
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                rope_parameters=rope,
                max_position_embeddings=64,
            )
        ).eval()
    )
    relational = to_relational(source, verify_length=48)
    assert relational.config.rope_parameters["rope_type"] == "llama3"
    ids = token_ids(length=48)
    assert (relational(ids).logits - source(ids).logits).abs().max().item() < 1e-4


def test_mistral_sliding_window_is_warned_and_verified_inside_the_window():
    torch.manual_seed(0)
    source = MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=6,
        )
    ).eval()
    with pytest.warns(UserWarning, match="sliding-window"):
        relational, report = to_relational(source, return_report=True)
    assert report.verified_sequence_length == 6
    ids = token_ids(length=6)
    assert (relational(ids).logits - source(ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["relational_free"])
def test_families_without_an_exact_relational_form_are_refused(name):
    with pytest.raises(UnsupportedModelError, match="unsupported"):
        to_relational(build(name))


def test_converter_refuses_a_model_failing_its_own_check(monkeypatch):
    """A real error fails the float32 check and the float64 one it then asks for."""
    import relational_hf.convert.relational as conversion

    real = conversion._fold_and_load

    def broken(source, target):
        real(source, target)
        with torch.no_grad():
            target.model.layers[0].mlp.down_proj.weight.mul_(1.5)

    monkeypatch.setattr(conversion, "_fold_and_load", broken)
    with pytest.raises(ConversionError, match="logits"):
        to_relational(_scaled(build("llama")))


def test_float32_rounding_past_the_tolerance_is_decided_in_float64(monkeypatch):
    """Float32 rounding that some inputs amplify past the tolerance (seen on SmolLM2 in some processes) does not
    refuse an exact conversion: float64 copies decide, and the report says so (a real error fails both: the test
    above)."""
    import relational_hf.convert.relational as conversion

    real = conversion.logit_difference
    calls = []

    def rounding_amplified(a, b, **kwargs):  # float32: past the tolerance, as in an unlucky process
        diff, scale, relative = real(a, b, **kwargs)
        calls.append(next(a.parameters()).dtype)
        return (diff + scale, scale, relative + 1.0) if calls[-1] == torch.float32 else (diff, scale, relative)

    monkeypatch.setattr(conversion, "logit_difference", rounding_amplified)
    source = _scaled(build("llama"))
    converted, report = to_relational(source, return_report=True)
    assert calls == [torch.float32, torch.float64]
    assert report.verified_in == "float64" and report.relative_logit_difference <= report.tolerance
    assert any("float64" in note for note in report.notes)
    assert next(converted.parameters()).dtype == torch.float32  # the copies were checked, not the result


def test_principal_gauge_alone_is_exact_and_slicing_shrinks_the_width():
    source = _scaled(build("llama"))
    data = torch.randint(0, VOCAB, (12, 24), generator=torch.Generator().manual_seed(3))
    exact = to_relational(source)
    rotated = to_relational(source, slice_fraction=1e-6, calibration_data=data)  # rounds to no slicing
    ids = token_ids()
    assert rotated.config.hidden_size == D
    assert (rotated(ids).logits - exact(ids).logits).abs().max().item() < 1e-4
    assert not torch.allclose(rotated.model.embed_tokens.weight, exact.model.embed_tokens.weight)
    sliced, report = to_relational(
        source, slice_fraction=0.25, calibration_data=data[:8], eval_data=data[8:], return_report=True
    )
    s = report.slicing
    assert sliced.config.hidden_size == s.hidden_size_after == 24
    assert s.parameters_after == sum(p.numel() for p in sliced.parameters()) < s.parameters_before
    assert s.perplexity_before is not None and s.perplexity_after is not None and 0 < s.variance_kept < 1
    assert torch.isfinite(sliced(ids).logits).all()


@pytest.mark.parametrize("constant", [False, True])
def test_slicing_a_tied_head_keeps_it_tied_with_a_varying_or_constant_final_gain(constant):
    """A tied head stays tied: a varying final gain becomes a gain in its own eigenbasis of the kept subspace, a
    constant one stays constant. Either way the rotation is exact."""
    source = _scaled(build("llama_tied_bias"))
    if constant:
        with torch.no_grad():
            source.model.norm.weight.fill_(1.7)
    data = torch.randint(0, VOCAB, (12, 24), generator=torch.Generator().manual_seed(3))
    exact = to_relational(source)
    rotated, report = to_relational(source, slice_fraction=1e-6, calibration_data=data, return_report=True)
    ids = token_ids()
    assert (rotated(ids).logits - exact(ids).logits).abs().max().item() < 1e-4
    assert not report.slicing.head_untied
    assert rotated.config.tie_word_embeddings and rotated.config.final_norm_gain
    assert report.slicing.parameters_after == sum(p.numel() for p in rotated.parameters())
    if constant:
        assert torch.allclose(rotated.model.norm.weight, torch.full((D,), 1.7))


def test_convert_command_saves_a_checkpoint_the_auto_classes_load(tmp_path, capsys):
    source = _scaled(build("qwen2"))
    source.save_pretrained(tmp_path / "src")
    ids = torch.randint(0, VOCAB, (600,), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "calibration.pt")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "exact")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exact")
    probe = token_ids()
    assert (loaded(probe).logits - source(probe).logits).abs().max().item() < 1e-4
    sliced = [
            "convert",
            str(tmp_path / "src"),
            str(tmp_path / "sliced"),
            "--slice",
            "0.25",
            "--calibration",
            str(tmp_path / "calibration.pt"),
            "--seq-len",
            "32",
    ]
    assert main(sliced) == 0
    report = json.loads((tmp_path / "sliced" / "conversion_report.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sliced")
    assert reloaded.config.hidden_size == 24
    assert sum(p.numel() for p in reloaded.parameters()) == report["slicing"]["parameters_after"]
    assert torch.isfinite(reloaded(probe).logits).all()
    assert "held-out perplexity" in capsys.readouterr().out


def test_conversion_leaves_the_source_untouched():
    source = _scaled(build("llama"))
    before = copy.deepcopy(source.state_dict())
    to_relational(source)
    assert all(torch.equal(before[k], v) for k, v in source.state_dict().items())
