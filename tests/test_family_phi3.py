"""Phi-3 through every command, on a tiny checkpoint of Transformers' own Phi-3 classes with random norm gains.

Phi-3 is Llama's function in a fused layout: one `qkv_proj` (rows [q | k | v]) and one `gate_up_proj` (rows
[gate | up]). The adapter presents the roles as row views of the fused weights, so the groups are Llama's (rotary
commutant per key head, GL(d_h) VO, SwiGLU scales, norm gains, residual rotation) and every tool writes through the
views; conversion splits the fused maps. Phi-3's longrope (short factors up to `original_max_position_embeddings`,
long factors beyond) converts exactly, and so does partial rotary (the first rot_dim coordinates of each head turn), with
the QK pair stored as it is: GL on the non-rotated block is a gauge the pivot layout does not fix."""

from __future__ import annotations

import pytest
import torch
from family_helpers import (
    DH,
    HKV,
    O_D,
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
from transformers import LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from relational_hf.convert import to_relational
from relational_hf.symmetry import redundancy_report


def phi3(seed: int = 0, **overrides) -> Phi3ForCausalLM:
    """Untied head (Phi-3's default), random gains."""
    torch.manual_seed(seed)
    return randomize(Phi3ForCausalLM(Phi3Config(**(TINY | overrides))), seed=seed + 1)


EXPECTED = {
    "qk_gauge": L * HKV * DH,  # rotary commutant: a complex scalar per rotary pair, per key head
    "vo_gauge": L * HKV * DH * DH,
    "mlp_scale": L * F,
    "norm_gain": (2 * L + 1) * D,
    "residual_rotation": O_D,
}


@pytest.fixture(scope="module")
def source():
    return phi3()


@pytest.fixture(scope="module")
def checkpoint(source, tmp_path_factory):
    return save(source, tmp_path_factory.mktemp("phi3") / "src")


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    from relational_hf.commands.main import main

    out = tmp_path_factory.mktemp("phi3_rel") / "relational"
    assert main(["convert", str(checkpoint), str(out)]) == 0
    return out


def test_redundancy_counts_the_groups_that_hold(source, checkpoint, tmp_path, capsys):
    assert_redundancy_commands(source, checkpoint, tmp_path, capsys, EXPECTED)


def test_partial_rotary_keeps_a_full_gl_on_the_other_coordinates_which_conversion_leaves_free():
    """Partial rotary: the rotary commutant on the rotated half, GL on the rest, per key head. The conversion holds it
    exactly with the QK pair stored as it is (the pivot layout does not fix GL on the non-rotated block): VO and the
    SwiGLU scales are fixed, the QK gauge is reported as left and is the converted model's own."""
    model = phi3(partial_rotary_factor=0.5)
    rot = DH // 2
    expected_qk = L * HKV * (rot + (DH - rot) ** 2)  # commutant on the rotated half, GL on the rest
    assert redundancy_report(model, descriptors=False).by_group["qk_gauge"] == expected_qk
    assert_random_symmetry_keeps_logits(model)
    relational, report = to_relational(model, return_report=True)
    assert relational.config.rotary_dim == rot
    assert report.removed_orbit_dimensions == {"vo_gauge": EXPECTED["vo_gauge"], "mlp_scale": EXPECTED["mlp_scale"]}
    assert report.remaining_symmetries["qk_gauge"] == expected_qk
    assert redundancy_report(relational, descriptors=False).by_group["qk_gauge"] == expected_qk
    assert relative_logit_difference(model, relational, token_ids(length=40)) < 1e-4
    assert_random_symmetry_keeps_logits(relational)


def test_random_group_element_leaves_the_logits_unchanged(source):
    assert_random_symmetry_keeps_logits(source)


def test_counted_dimension_equals_the_orbit_dimension():
    model = phi3(num_hidden_layers=1, vocab_size=16, hidden_size=16, intermediate_size=12)
    rank, counted = orbit_rank(model)
    assert rank == counted > 0


def test_analyze(checkpoint, tmp_path, capsys):
    assert_analyze(checkpoint, tmp_path, capsys)


def test_trainer_projection_and_parallel_suppression(tmp_path):
    assert_trainer_projection_and_suppression(phi3(seed=3), tmp_path)


def test_convert_is_exact_streamed_and_in_memory(source, checkpoint, tmp_path, capsys):
    folder, report = convert_both_ways(source, checkpoint, tmp_path, capsys)
    model = load(folder)
    assert not model.config.qk_norm and model.config.rope_layers is None
    fixed = {k: EXPECTED[k] for k in ("qk_gauge", "vo_gauge", "mlp_scale")}
    assert report["removed_orbit_dimensions"] == fixed
    assert stored(model) == stored(source) - EXPECTED["norm_gain"] - sum(fixed.values())


def test_longrope_converts_exactly_on_both_sides_of_the_original_length():
    rope = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.7], long_factor=[1.5, 2.0, 3.0, 4.5])
    model = phi3(rope_scaling=rope, original_max_position_embeddings=16)
    relational = to_relational(model)
    for length in (12, 40):  # short factors, then long ones (and their attention scaling)
        assert relative_logit_difference(model, relational, token_ids(length=length)) < 1e-4
    short, long = (model.model.rotary_emb(torch.zeros(1), torch.arange(n)[None])[0] for n in (12, 40))
    assert not torch.allclose(short[0, 1], long[0, 1])  # the two regimes do differ


def test_compress(checkpoint, converted, tmp_path, capsys):
    for name, src in (("from_source", checkpoint), ("from_relational", converted)):
        assert_compress(src, tmp_path, capsys, name)


def test_export_to_phi3_and_to_llama_keep_the_function(source, converted, tmp_path, capsys):
    run(["export", converted, tmp_path / "phi3", "--to", "phi3"], capsys)
    exported = load(tmp_path / "phi3")
    assert type(exported) is Phi3ForCausalLM
    assert relative_logit_difference(source, exported, token_ids()) < 1e-4
    run(["export", converted, tmp_path / "llama", "--to", "llama"], capsys)
    llama = load(tmp_path / "llama")
    assert type(llama) is LlamaForCausalLM and relative_logit_difference(source, llama, token_ids()) < 1e-4
    _, err = run(["export", converted, tmp_path / "qwen3", "--to", "qwen3"], capsys, code=2)
    assert "qk_norm" in error_line(err)


def test_canonicalize_source_and_converted(source, checkpoint, converted, tmp_path, capsys):
    assert_canonicalize(checkpoint, tmp_path, capsys, source, "canonical_source")
    assert_canonicalize(converted, tmp_path, capsys, source, "canonical_relational")


def test_evaluate_gives_the_same_perplexity_before_and_after_conversion(checkpoint, converted, tmp_path, capsys):
    before, after = perplexity_of(checkpoint, tmp_path, capsys), perplexity_of(converted, tmp_path, capsys)
    assert after == pytest.approx(before, rel=1e-4)


def test_finetune_converted_and_source_with_projection(checkpoint, converted, tmp_path, capsys):
    assert_finetune(converted, tmp_path, capsys, "tuned")
    assert_finetune(converted, tmp_path, capsys, "lora", "--method", "lora", "--merge")
    assert_finetune(checkpoint, tmp_path, capsys, "projected", "--projection", "update")


def test_partial_rotary_converts_exactly_streamed_and_in_memory_and_exports_to_phi3(tmp_path, capsys):
    """Logits equal to < 1e-4 of the logit scale both ways on random gains, the stored count drops by the norm gains,
    VO and the SwiGLU scales (the QK pair kept as it is); `export --to phi3` writes it back with its partial rotary,
    `--to llama` and `--to gguf` refuse it in one line (they rotate every coordinate)."""
    source = phi3(seed=3, partial_rotary_factor=0.5)
    folder, report = convert_both_ways(source, save(source, tmp_path / "src"), tmp_path, capsys)
    model = load(folder)
    assert model.config.rotary_dim == DH // 2 and not model.config.qk_norm
    fixed = EXPECTED["vo_gauge"] + EXPECTED["mlp_scale"]
    assert stored(model) == stored(source) - EXPECTED["norm_gain"] - fixed
    run(["export", folder, tmp_path / "phi3", "--to", "phi3"], capsys)
    exported = load(tmp_path / "phi3")
    assert type(exported) is Phi3ForCausalLM and exported.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert relative_logit_difference(source, exported, token_ids(length=40)) < 1e-4
    _, err = run(["export", folder, tmp_path / "llama", "--to", "llama"], capsys, code=2)
    assert "partial rotary" in error_line(err) and not (tmp_path / "llama").exists()
    _, err = run(["export", folder, tmp_path / "model.gguf", "--to", "gguf"], capsys, code=2)
    assert "partial rotary" in error_line(err) and not (tmp_path / "model.gguf").exists()


def test_partial_rotary_with_longrope_converts_exactly_on_both_sides_of_the_original_length():
    """Phi-4-mini's layout: longrope factors over the rotated coordinates only (rot_dim / 2 of them)."""
    rope = dict(rope_type="longrope", short_factor=[1.0, 1.3], long_factor=[1.5, 3.0], partial_rotary_factor=0.5)
    model = phi3(seed=4, rope_scaling=rope, original_max_position_embeddings=16)
    relational = to_relational(model)
    assert relational.config.rotary_dim == DH // 2
    for length in (12, 40):
        assert relative_logit_difference(model, relational, token_ids(length=length)) < 1e-4


def test_partial_rotary_compresses_with_its_qk_forms_at_full_width(tmp_path, capsys):
    """`compress` (streamed, the default for a folder, and in memory): the stored count is the report's and the closed
    form's, the QK forms keep their width (stored as they are: reported as `qk_kept_full`), VO and SwiGLU narrow."""
    src = save(phi3(seed=5, partial_rotary_factor=0.5), tmp_path / "src")
    for name, extra in (("streamed", ()), ("in_memory", ("--no-stream",))):
        model = assert_compress(src, tmp_path, capsys, name, *extra)
        report, c = model.compression_report, model.config
        assert c.layer_qk_ranks is None and c.rotary_dim == DH // 2
        assert sorted(report["qk_kept_full"]) == [str(i) for i in range(L)]
        assert "partial rotary" in report["qk_kept_full"]["0"]


def test_convert_with_slicing_keeps_an_honest_count(source):
    assert_slice(source)
