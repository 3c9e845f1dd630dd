"""SmolLM3 through every command, on a tiny checkpoint of Transformers' own SmolLM3 classes with random norm gains and
random q/k/v/o biases, one layer in two without rotary positions (`no_rope_layers` = [1, 0, 1]).

A layer without rotary positions has no rotation for its QK gauge to commute with: the full GL(d_h) per key head
holds there (d_h^2 instead of d_h), and the key bias cancels in the softmax (a translation of b_K per key head). The
relational model holds the layer pattern exactly with `rope_layers` = [True, False, True]: a block pivot fixes the
full GL in the layer without rotary, the rotary commutant's pivot the others."""

from __future__ import annotations

import pytest
import torch
from family_helpers import (
    DH,
    HKV,
    TINY,
    D,
    F,
    L,
    assert_analyze,
    assert_canonicalize,
    assert_compress,
    assert_finetune,
    assert_random_symmetry_keeps_logits,
    assert_redundancy_commands,
    assert_remote_code_load,
    assert_slice,
    assert_trainer_projection_and_suppression,
    convert_both_ways,
    error_line,
    load,
    orbit_rank,
    perplexity_of,
    randomize,
    relative_logit_difference,
    run,
    save,
    stored,
    token_ids,
)
from transformers import SmolLM3Config, SmolLM3ForCausalLM

ROPE = [True, False, True]


def smollm3(seed: int = 0, **overrides) -> SmolLM3ForCausalLM:
    """Tied head (SmolLM3's default), q/k/v/o biases, random gains, layer 1 without rotary positions."""
    torch.manual_seed(seed)
    settings = TINY | dict(no_rope_layers=[int(r) for r in ROPE], attention_bias=True, tie_word_embeddings=True)
    return randomize(SmolLM3ForCausalLM(SmolLM3Config(**(settings | overrides))), seed=seed + 1)


EXPECTED = {
    "qk_gauge": 2 * HKV * DH + 1 * HKV * DH * DH,  # rotary commutant in two layers, GL(d_h) in the one without
    "key_bias_shift": 1 * HKV * DH,  # b_K cancels in the softmax where no rotation turns it
    "vo_gauge": L * HKV * DH * DH,
    "value_bias_fold": L * HKV * DH,
    "mlp_scale": L * F,
    "norm_gain": 2 * L * D,  # the final gain in front of the tied head does not fold
}  # no residual rotation: the random final gain in front of the tied head has no two equal values


@pytest.fixture(scope="module")
def source():
    return smollm3()


@pytest.fixture(scope="module")
def checkpoint(source, tmp_path_factory):
    return save(source, tmp_path_factory.mktemp("smollm3") / "src")


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    from relational_hf.commands.main import main

    out = tmp_path_factory.mktemp("smollm3_rel") / "relational"
    assert main(["convert", str(checkpoint), str(out)]) == 0
    return out


def test_redundancy_counts_the_groups_that_hold(source, checkpoint, tmp_path, capsys):
    assert_redundancy_commands(source, checkpoint, tmp_path, capsys, EXPECTED)


def test_random_group_element_leaves_the_logits_unchanged(source):
    assert_random_symmetry_keeps_logits(source)


def test_counted_dimension_equals_the_orbit_dimension():
    model = smollm3(num_hidden_layers=2, no_rope_layers=[1, 0], vocab_size=16, hidden_size=16, intermediate_size=12)
    rank, counted = orbit_rank(model)
    assert rank == counted > 0


def test_analyze(checkpoint, tmp_path, capsys):
    assert_analyze(checkpoint, tmp_path, capsys)


def test_trainer_projection_and_parallel_suppression(tmp_path):
    assert_trainer_projection_and_suppression(smollm3(seed=3), tmp_path)


def test_convert_is_exact_streamed_and_in_memory(source, checkpoint, tmp_path, capsys):
    folder, report = convert_both_ways(source, checkpoint, tmp_path, capsys)
    model = load(folder)
    assert model.config.rope_layers == ROPE and not model.config.qk_norm
    assert [layer.self_attn.rope for layer in model.model.layers] == ROPE
    fixed = {k: EXPECTED[k] for k in ("qk_gauge", "vo_gauge", "mlp_scale")}
    assert report["removed_orbit_dimensions"] == fixed
    assert stored(model) == stored(source) - EXPECTED["norm_gain"] - sum(fixed.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_converted_checkpoint_loads_with_remote_code_alone(source, converted, tmp_path):
    assert_remote_code_load(converted, tmp_path, source, token_ids(length=12))


def test_converted_model_generates_with_its_cache_like_without(converted):
    model = load(converted)
    out = model.generate(token_ids(batch=1, length=4), max_new_tokens=5, do_sample=False)
    assert torch.equal(model(out[:, :-1]).logits[0, 3:].argmax(-1), out[0, 4:])


def test_compress_narrows_only_the_rotary_layers_qk_forms(checkpoint, converted, tmp_path, capsys):
    """Whole rotary pairs are removed where there are any; the layer without rotary keeps its QK width."""
    cases = (("from_source", checkpoint), ("from_relational", converted), ("streamed_pivot", checkpoint))
    for name, src in cases:
        extra = ("--stream", "--gauge", "pivot") if name == "streamed_pivot" else ()
        model = assert_compress(src, tmp_path, capsys, name, *extra)
        assert model.config.rope_layers == ROPE
        assert model.config.layer_qk_rank(1) == model.config.qk_rank
        assert list(model.compression_report["qk_kept_full"]) == ["1"]


def test_export_to_smollm3_keeps_the_function_and_llama_is_refused(source, converted, tmp_path, capsys):
    run(["export", converted, tmp_path / "smollm3", "--to", "smollm3"], capsys)
    exported = load(tmp_path / "smollm3")
    assert type(exported) is SmolLM3ForCausalLM and exported.config.no_rope_layers == [1, 0, 1]
    assert relative_logit_difference(source, exported, token_ids()) < 1e-4
    _, err = run(["export", converted, tmp_path / "llama", "--to", "llama"], capsys, code=2)
    assert "rope_layers" in error_line(err) and "--to smollm3" in error_line(err)
    _, err = run(["export", converted, tmp_path / "qwen3", "--to", "qwen3"], capsys, code=2)
    assert "qk_norm" in error_line(err)


def test_canonicalize_source_and_converted(source, checkpoint, converted, tmp_path, capsys):
    assert_canonicalize(checkpoint, tmp_path, capsys, source, "canonical_source")
    assert_canonicalize(converted, tmp_path, capsys, source, "canonical_relational")


def test_evaluate_gives_the_same_perplexity_before_and_after_conversion(checkpoint, converted, tmp_path, capsys):
    before, after = perplexity_of(checkpoint, tmp_path, capsys), perplexity_of(converted, tmp_path, capsys)
    assert after == pytest.approx(before, rel=1e-4)


def test_finetune_converted_and_source_with_projection(checkpoint, converted, tmp_path, capsys):
    tuned = assert_finetune(converted, tmp_path, capsys, "tuned")
    assert tuned.config.rope_layers == ROPE
    assert_finetune(converted, tmp_path, capsys, "lora", "--method", "lora", "--merge")
    assert_finetune(checkpoint, tmp_path, capsys, "projected", "--projection", "update")


def test_mlp_biases_are_refused_in_one_line(tmp_path, capsys):
    save(smollm3(mlp_bias=True), tmp_path / "src")
    for argv in (["convert", tmp_path / "src", tmp_path / "out"], ["convert", tmp_path / "src", tmp_path / "o2", "--no-stream"]):
        _, err = run(argv, capsys, code=2)
        assert "MLP biases" in error_line(err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "o2").exists()


def test_convert_with_slicing_keeps_an_honest_count(source):
    assert_slice(source)


def test_rope_layers_option_is_validated_in_one_line():
    from relational_hf import RelationalConfig

    base = dict(vocab_size=16, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"`rope_layers` must be a list of 2 booleans"):
        RelationalConfig(**base, rope_layers=[True])
    with pytest.raises(ValueError, match=r"rope_layers.*\[1, 0\]"):
        RelationalConfig(**base, rope_layers=[1, 0])
    with pytest.raises(ValueError, match=r"`rope_layers` needs position_encoding='rope'"):
        RelationalConfig(**base, rope_layers=[True, False], position_encoding="none")
    config = RelationalConfig(**base, rope_layers=[True, False])
    assert [config.layer_rope(i) for i in range(2)] == [True, False]
