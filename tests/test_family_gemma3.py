"""Gemma 3 (text, Gemma3ForCausalLM) from Transformers' own config class: (1 + w) RMS gains, sandwich norms, per-head
QK-norm before RoPE, GELU-tanh gated MLP, sqrt(d) embedding scale, query_pre_attn_scalar, sliding-window layers with
their own rotary base, tied head. The groups counted are those of its forward pass; analyze and the Trainer work on
it. `convert` is exact, streamed and in memory (`relational_hf.convert.gemma`: (1 + w) gains folded or stored,
sandwich norms, the embedding scale and the sliding-window layers held by options of the relational architecture),
with random gains on a model with a sliding and a full layer, on sequences longer than the window; --slice and the
Llama-like exports refuse it in one line naming the features (compress and `export --to gemma3`:
tests/test_family_gemma3_compress.py; compress streamed: tests/test_family_gemma3_stream.py). The tiny models are
gemma3_models.py's, the model, checkpoint and conversion conftest.py's fixtures."""

from __future__ import annotations

import types

import pytest
import torch
from family_checks import (
    analyze_report,
    assert_refused_in_one_line,
    assert_site_updates_add_up,
    counted_dimension,
    largest_logit_change_under_random_symmetry,
    measured_orbit_dimension,
    nonlinear_weights,
    projected_update_is_horizontal,
    randomize_gains_and_biases,
    run_cli,
    train_projected_and_suppressed,
)
from gemma3_models import DH, HKV, D, F, L, V, config, convertible, longer_than_the_window, tiny
from torch import nn
from transformers import Gemma3ForCausalLM

from relational_hf.symmetry import redundancy_report
from relational_hf.symmetry.report import redundancy_report_from_checkpoint


def test_counts_at_initial_gains_equal_the_closed_forms():
    """Gains at their initial w = 0 (all 1 + w equal): per layer QK rotations on every rotary pair per key head
    (QK-norm), the gain exchange per pair, GL(d_h) VO per key head, d_ff gated-MLP scales, the two pre-norms' gains;
    the sandwich norms' gains are equal, so the residual rotation O(d) survives."""
    report = redundancy_report(tiny(random_gains=False), descriptors=False)
    assert report.by_group == {
        "qk_gauge": L * HKV * DH // 2,
        "qk_norm_gain_exchange": L * DH // 2,
        "vo_gauge": L * HKV * DH**2,
        "mlp_scale": L * F,
        "norm_gain": 2 * L * D,
        "residual_rotation": D * (D - 1) // 2,
    }


def test_random_gains_remove_the_qk_rotations_and_the_residual_rotation():
    """Random QK-norm gains differ within rotary pairs (no rotation commutes with them); random sandwich-norm gains
    leave no rotation of the stream that commutes with all of them."""
    report = redundancy_report(tiny(), descriptors=False)
    assert report.by_group == {
        "qk_norm_gain_exchange": L * DH // 2,
        "vo_gauge": L * HKV * DH**2,
        "mlp_scale": L * F,
        "norm_gain": 2 * L * D,
    }
    assert any("commutant" in note for note in report.notes)


@pytest.mark.parametrize("random_gains", [False, True])
def test_a_random_group_element_keeps_the_logits(random_gains):
    model = tiny(random_gains)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    scale = model(ids).logits.abs().max().item()
    assert largest_logit_change_under_random_symmetry(model, ids) < 1e-4 * max(1.0, scale)


def _exact_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * (x.pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt() * (1 + norm.weight)


def _measurable(model: nn.Module) -> nn.Module:
    """The same function, differentiable as it is computed. Gemma's RMS norms compute in float32: for the float64
    Jacobian, the same formula in the input's dtype, bound as a method (a closure over the module would survive the
    measurement's deepcopy and read the original, constant gains: every gain's column would be zero). The embedding
    has a padding_idx, whose row reverse-mode differentiation leaves without the lookup's gradient (only the tied
    head's): the forward ignores padding_idx, so it is cleared."""
    for module in model.modules():
        if type(module).__name__ == "Gemma3RMSNorm":
            module.forward = types.MethodType(_exact_norm, module)
        if isinstance(module, nn.Embedding):
            module.padding_idx = None
    return model


@pytest.mark.parametrize("random_gains", [False, True])
def test_counted_dimension_equals_the_orbit_dimension_measured_numerically(random_gains):
    """d = 8, 2 layers (sliding, full), 2 query heads sharing one key head of width 4: the Jacobian of the logits
    has a null space of exactly the counted dimension (100 with random gains; 132 at w = 0, with the QK rotations and
    O(8)). The scale symmetries of the norms hold only up to their epsilon (per layer: each query head's and the key
    head's W_Q/W_K scale, the W_O and W_down scales behind the sandwich norms): they sit between the function's
    directions and the null space, are not null, and not counted. 32 rows of 8 tokens: with 16 the Jacobian's rank
    is bounded by the positions' d - 1 normalised directions plus the tied head's V d (about 1150 of 1496
    parameters), and the data, not the symmetries, makes the null space (304)."""
    torch.manual_seed(0)
    small = config(
        vocab_size=32, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
        max_position_embeddings=8, query_pre_attn_scalar=3,
    )  # fmt: skip
    model = nonlinear_weights(Gemma3ForCausalLM(small))
    if random_gains:
        randomize_gains_and_biases(model)
    nullity, gap = measured_orbit_dimension(_measurable(model), vocab=32, length=8, rows=32)
    assert gap > 4
    assert nullity == counted_dimension(model) == (100 if random_gains else 132)


def test_a_saved_checkpoint_is_read_layer_by_layer(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "src")
    streamed = redundancy_report_from_checkpoint(tmp_path / "src", descriptors=False)
    assert streamed.by_group == redundancy_report(model, descriptors=False).by_group


def test_site_updates_are_what_the_sandwich_norms_add_to_the_stream():
    assert_site_updates_add_up(tiny(), V, L)


def test_analyze_measures_every_site(tmp_path):
    report = analyze_report(tiny(), tmp_path, V)
    for site in ("residual_attention", "residual_mlp", "block", "value", "value_exclude_self"):
        assert [row["layer"] for row in report["decomposition"][site]] == list(range(L))


def test_projection_is_horizontal_and_the_trainer_projects_and_suppresses(tmp_path):
    assert projected_update_is_horizontal(tiny()) < 1e-6
    log = train_projected_and_suppressed(tiny(), tmp_path, V)
    assert 0 < log["parallel_suppression"] <= 0.3 and log["orbit_drift"] >= 0


# ---- conversion (the model, its checkpoint and conversion: conftest's gemma3_source, gemma3_checkpoint and
# gemma3_converted, built by gemma3_models.convertible) ----------------------------------------------------------


def test_the_test_model_has_random_gains_a_window_that_matters_and_logits_of_a_few_units(gemma3_source):
    """A folding mistake would hide behind gains at 1 + 0 or near-zero logits, a mask mistake behind a window that
    changes nothing: the window changes the source's logits on these sequences."""
    import copy

    from family_helpers import relative_logit_difference

    layer = gemma3_source.model.layers[0]
    for norm in (
        layer.input_layernorm,
        layer.post_attention_layernorm,
        layer.self_attn.q_norm,
        gemma3_source.model.norm,
    ):
        assert float(norm.weight.detach().std()) > 0.1
    ids = longer_than_the_window()
    with torch.no_grad():
        assert 1.0 < float(gemma3_source(ids).logits.abs().max()) < 100.0
    assert gemma3_source.config.layer_types == ["sliding_attention", "full_attention"] and ids.shape[1] > 4
    wide = copy.deepcopy(gemma3_source)
    wide.config.sliding_window = 64
    with torch.no_grad():
        assert relative_logit_difference(gemma3_source, wide, ids) > 1e-3


def test_convert_is_exact_streamed_and_in_memory(gemma3_source, gemma3_checkpoint, tmp_path, capsys):
    """Logits within 1e-4 of the logit scale both ways (sequences of 24 > the window of 4); the stored count drops by
    the pre-norms' gains (folded: 2 d per layer) and the VO and MLP gauges (pivot); the QK-norm, sandwich and final
    gains are kept; the symmetries the report leaves are the converted model's own."""
    from family_helpers import convert_both_ways, load, stored

    folder, report = convert_both_ways(gemma3_source, gemma3_checkpoint, tmp_path, capsys)
    model = load(folder)
    c = model.config
    assert c.qk_norm and c.sandwich_norms and c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings
    assert c.embedding_scale == pytest.approx(D**0.5) and c.final_norm_gain
    assert (c.layer_types, c.sliding_window) == (["sliding_attention", "full_attention"], 4)
    assert (c.rope_parameters["rope_theta"], c.sliding_rope_parameters["rope_theta"]) == (1e6, 1e4)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report["removed_orbit_dimensions"] == {"vo_gauge": L * HKV * DH**2, "mlp_scale": L * F}
    assert stored(model) == stored(gemma3_source) - 2 * L * D - L * HKV * DH**2 - L * F
    layer, gemma = model.model.layers[1], gemma3_source.model.layers[1]
    torch.testing.assert_close(layer.mlp_output_norm.weight, 1 + gemma.post_feedforward_layernorm.weight)
    torch.testing.assert_close(layer.self_attn.k_norm.weight, 1 + gemma.self_attn.k_norm.weight)
    factor = (DH / gemma3_source.config.query_pre_attn_scalar) ** 0.5  # the attention scale, carried by the query gain
    torch.testing.assert_close(layer.self_attn.q_norm.weight, (1 + gemma.self_attn.q_norm.weight) * factor)
    own = redundancy_report(model, descriptors=False).by_group
    assert report["remaining_symmetries"] == own == {"qk_norm_gain_exchange": L * DH // 2}


@pytest.mark.parametrize(
    "variant",
    [
        dict(attention_bias=True),
        dict(tie_word_embeddings=False),
        dict(layer_types=["full_attention", "full_attention"]),
        dict(
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        ),
    ],
    ids=["attention_bias", "untied_head", "full_layers_only", "linear_rope_scaling"],
)
def test_variants_convert_exactly(variant):
    """Biases on q/k/v/o, an untied head (the final 1 + w folded into it), no sliding layer, Gemma 3's linear rope
    scaling on the full layers."""
    from family_helpers import relative_logit_difference, stored

    from relational_hf.convert import to_relational

    source = convertible(seed=2, **variant)
    model, report = to_relational(source, return_report=True)
    assert relative_logit_difference(source, model, longer_than_the_window()) < 1e-4
    assert stored(model) == report.relational_parameters == report.expected_parameters
    assert model.config.tie_word_embeddings == source.config.tie_word_embeddings


def test_converted_checkpoint_loads_with_remote_code_alone(gemma3_source, gemma3_converted, tmp_path):
    from family_helpers import assert_remote_code_load

    assert {"modeling_windows.py", "modeling_blocks.py"} <= {p.name for p in gemma3_converted.glob("*.py")}
    assert_remote_code_load(gemma3_converted, tmp_path, gemma3_source, longer_than_the_window(batch=2, length=12))


def test_converted_model_generates_the_sources_greedy_tokens(gemma3_source, gemma3_converted):
    """15 positions through a window of 4: the sliding layer's cache drops what leaves the window, in both models;
    a static cache (masks by layer type prepared by generate) gives the same tokens."""
    from family_helpers import load

    model = load(gemma3_converted)
    prompt = longer_than_the_window(batch=2, length=5, seed=4)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    ours = model.generate(prompt, **kw)
    assert torch.equal(ours, gemma3_source.generate(prompt, **kw))
    assert torch.equal(model.generate(prompt, cache_implementation="static", **kw), ours)


@pytest.mark.parametrize("random_gains", [True, False], ids=["random_gains", "initial_gains"])
def test_a_random_element_of_the_surviving_group_keeps_the_converted_logits(random_gains):
    """Random gains: the QK-norm gain exchange survives. Gains at w = 0 (all sandwich and final gains equal): the QK
    rotations and the whole residual rotation O(d) survive too, as in the source."""
    from relational_hf.convert import to_relational

    model, report = to_relational(convertible(seed=5, random_gains=random_gains), return_report=True)
    by_group = redundancy_report(model, descriptors=False).by_group
    assert report.remaining_symmetries == by_group
    if not random_gains:
        assert by_group["residual_rotation"] == D * (D - 1) // 2 and by_group["qk_gauge"] == L * HKV * DH // 2
    ids = longer_than_the_window(length=12)
    with torch.no_grad():
        scale = float(model(ids).logits.abs().max())
    assert largest_logit_change_under_random_symmetry(model, ids) < 1e-4 * max(1.0, scale)


def test_canonicalize_evaluate_and_finetune_the_converted_model(
    gemma3_source, gemma3_checkpoint, gemma3_converted, tmp_path, capsys
):
    from family_helpers import assert_canonicalize, assert_finetune, perplexity_of

    assert_canonicalize(gemma3_converted, tmp_path, capsys, gemma3_source, "canonical_relational")
    assert_canonicalize(
        gemma3_checkpoint, tmp_path, capsys, gemma3_source, "canonical_gemma"
    )  # the checkpoint itself, streamed
    assert_canonicalize(gemma3_checkpoint, tmp_path, capsys, gemma3_source, "canonical_gemma_in_memory", "--no-stream")
    before, after = (
        perplexity_of(gemma3_checkpoint, tmp_path, capsys),
        perplexity_of(gemma3_converted, tmp_path, capsys),
    )
    assert after == pytest.approx(before, rel=1e-4)
    tuned = assert_finetune(gemma3_converted, tmp_path, capsys, "tuned")
    assert tuned.config.sandwich_norms and tuned.config.layer_types == ["sliding_attention", "full_attention"]


# ---- refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "named"),
    [
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ],
)
def test_variants_without_a_relational_form_are_refused_in_one_line(variant, named, tmp_path):
    tiny(**variant).save_pretrained(tmp_path / "src")
    for extra in ([], ["--no-stream"]):
        assert_refused_in_one_line("convert", [str(tmp_path / "src"), str(tmp_path / "c"), *extra], named)
        assert not (tmp_path / "c").exists()


def test_slice_and_the_llama_like_exports_refuse_in_one_line(gemma3_source, gemma3_converted, tmp_path):
    from family_helpers import token_ids

    from relational_hf.convert import ConversionError, to_relational

    with pytest.raises(ConversionError, match="slicing Gemma3ForCausalLM: sandwich norms"):
        to_relational(gemma3_source, slice_fraction=0.25, calibration_data=token_ids(batch=4, length=16))
    for target, named in (("llama", "sandwich_norms=True"), ("qwen3", "sandwich_norms=True")):  # gguf: gemma3
        code, _, err = run_cli(["export", str(gemma3_converted), str(tmp_path / target), "--to", target])
        lines = [line for line in err.splitlines() if "error:" in line]
        assert code == 2 and len(lines) == 1 and named in lines[0], err
        assert "--to gemma3 holds" in lines[0], lines[0]
        assert not (tmp_path / target).exists()


def test_new_options_are_validated_in_one_line():
    from relational_hf import RelationalConfig

    base = dict(vocab_size=16, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2)
    types = ["sliding_attention", "full_attention"]
    local = {"rope_type": "default", "rope_theta": 10000.0}
    config = RelationalConfig(
        **base, sandwich_norms=True, embedding_scale=4.0, layer_types=types, sliding_window=4,
        sliding_rope_parameters=local,
    )  # fmt: skip
    assert config.layer_sliding(0) and not config.layer_sliding(1)
    bad = [
        (dict(embedding_scale=0.0), "embedding_scale"),
        (dict(embedding_scale=float("nan")), "embedding_scale"),
        (dict(sliding_window=0, layer_types=types), "sliding_window"),
        (dict(layer_types=types), "sliding_window"),
        (dict(sliding_window=4), "sliding_window"),
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["chunked_attention", "full_attention"], sliding_window=4), "layer_types"),
        (dict(sliding_rope_parameters=local), "sliding_rope_parameters"),
        (dict(layer_types=types, sliding_window=4, sliding_rope_parameters={"rope_theta": 1.0}), "sliding_rope"),
        (dict(layer_types=types, sliding_window=4, sliding_rope_parameters={**local, "rope_theta": -1.0}), "sliding"),
    ]
    for fields, named in bad:
        with pytest.raises(ValueError, match=named) as err:
            RelationalConfig(**base, **fields)
        assert "\n" not in str(err.value).strip(), str(err.value)
    for field, value in (("sandwich_norms", "yes"), ("embedding_scale", -1.0), ("sliding_window", 1.5)):
        with pytest.raises(ValueError, match=field) as err:
            setattr(config, field, value)
        assert "\n" not in str(err.value).strip(), str(err.value)
