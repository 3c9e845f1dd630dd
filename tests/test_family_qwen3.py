"""Qwen3 through every command, on a tiny checkpoint of Transformers' own Qwen3 classes with random norm gains (the
QK-norm's included) and random q/k/v/o biases.

Qwen3 normalises each head's query and key (RMS over the head width) and multiplies by per-dimension gains g_q, g_k
shared by the heads, before RoPE. A QK gauge element A must keep the norm (A orthogonal: the scale is a symmetry only
up to the norm's epsilon), commute with diag(g_q), diag(g_k) and every rotary rotation: one rotation angle per rotary
pair whose q and k gains are equal within the pair, per key head. The gains themselves trade a constant per rotary
pair (g_q c, g_k / c). The relational model holds this exactly with `qk_norm=True`: W_Q, W_K and both gains stored as
they are (the QK pair keeps its small gauge, reported as left), VO and the SwiGLU scales in the pivot gauge."""

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
from transformers import Qwen3Config, Qwen3ForCausalLM

EQUAL_PAIRS = 2  # rotary pairs (of DH / 2) whose q and k gains are made equal in every layer


@torch.no_grad()
def qwen3(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    """Untied head, q/k/v/o biases, random gains; in every layer the first EQUAL_PAIRS rotary pairs get equal gains
    within the pair (coordinates j and j + DH/2), on the queries and on the keys."""
    torch.manual_seed(seed)
    config = Qwen3Config(**(TINY | dict(head_dim=DH, attention_bias=True, tie_word_embeddings=False) | overrides))
    model = randomize(Qwen3ForCausalLM(config), seed=seed + 1)
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight[DH // 2 : DH // 2 + EQUAL_PAIRS] = norm.weight[:EQUAL_PAIRS]
    return model


EXPECTED = {
    "qk_gauge": L * HKV * EQUAL_PAIRS,  # a rotation per rotary pair with equal gains, per key head
    "qk_norm_gain_exchange": L * DH // 2,  # g_q c, g_k / c with c constant per rotary pair
    "vo_gauge": L * HKV * DH * DH,
    "value_bias_fold": L * HKV * DH,  # b_V folds into b_O
    "mlp_scale": L * F,
    "norm_gain": (2 * L + 1) * D,  # untied head: the final gain folds into it
    "residual_rotation": O_D,
}


@pytest.fixture(scope="module")
def source():
    return qwen3()


@pytest.fixture(scope="module")
def checkpoint(source, tmp_path_factory):
    return save(source, tmp_path_factory.mktemp("qwen3") / "src")


@pytest.fixture(scope="module")
def converted(source, checkpoint, tmp_path_factory):
    from relational_hf.commands.main import main

    out = tmp_path_factory.mktemp("qwen3_rel") / "relational"
    assert main(["convert", str(checkpoint), str(out)]) == 0
    return out


# ---- analysis on the model as it is ----------------------------------------------------------------------------


def test_redundancy_counts_the_groups_that_hold(source, checkpoint, tmp_path, capsys):
    assert_redundancy_commands(source, checkpoint, tmp_path, capsys, EXPECTED)


def test_unequal_gains_in_a_pair_remove_its_rotation():
    from relational_hf.symmetry import redundancy_report

    model = qwen3()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_norm.weight[DH // 2] += 0.25  # pair 0 of layer 0: key gains now differ
    by_group = redundancy_report(model, descriptors=False).by_group
    assert by_group["qk_gauge"] == EXPECTED["qk_gauge"] - HKV
    assert by_group["qk_norm_gain_exchange"] == EXPECTED["qk_norm_gain_exchange"]


def test_random_group_element_leaves_the_logits_unchanged(source):
    assert_random_symmetry_keeps_logits(source)


def test_counted_dimension_equals_the_orbit_dimension():
    model = qwen3(num_hidden_layers=1, vocab_size=16, hidden_size=16, intermediate_size=12)
    rank, counted = orbit_rank(model)
    assert rank == counted > 0


def test_analyze(checkpoint, tmp_path, capsys):
    assert_analyze(checkpoint, tmp_path, capsys)


def test_trainer_projection_and_parallel_suppression(tmp_path):
    assert_trainer_projection_and_suppression(qwen3(seed=3), tmp_path)


# ---- conversion -------------------------------------------------------------------------------------------------


def test_convert_is_exact_streamed_and_in_memory(source, checkpoint, tmp_path, capsys):
    folder, report = convert_both_ways(source, checkpoint, tmp_path, capsys)
    model = load(folder)
    assert model.config.qk_norm and model.config.gauge == "pivot"
    # the QK pair stays as it is; VO and the SwiGLU scales are fixed; every layer and the final gain fold
    assert report["removed_orbit_dimensions"] == {"vo_gauge": EXPECTED["vo_gauge"], "mlp_scale": EXPECTED["mlp_scale"]}
    assert report["remaining_symmetries"]["qk_gauge"] == EXPECTED["qk_gauge"]
    assert stored(model) == stored(source) - EXPECTED["norm_gain"] - EXPECTED["vo_gauge"] - EXPECTED["mlp_scale"]
    from relational_hf.symmetry import redundancy_report

    left = redundancy_report(model, descriptors=False).by_group
    assert left["qk_gauge"] == EXPECTED["qk_gauge"] and "vo_gauge" not in left and "mlp_scale" not in left


def test_converted_checkpoint_loads_with_remote_code_alone(source, converted, tmp_path):
    assert_remote_code_load(converted, tmp_path, source, token_ids(length=12))


def test_converted_model_generates_with_its_cache_like_without(converted):
    model = load(converted)
    out = model.generate(token_ids(batch=1, length=4), max_new_tokens=5, do_sample=False)
    assert torch.equal(model(out[:, :-1]).logits[0, 3:].argmax(-1), out[0, 4:])


# ---- compression, export --------------------------------------------------------------------------------------


def test_compress_keeps_every_qk_form_at_full_width(checkpoint, converted, tmp_path, capsys):
    """QK-norm normalises over the whole head width: no narrower QK form is the same function, so compression keeps
    every QK width (and says so in the config: no per-layer QK ranks below qk_rank) and shrinks VO and the MLP."""
    cases = (("from_source", checkpoint), ("from_relational", converted), ("streamed_pivot", checkpoint))
    for name, src in cases:
        extra = ("--stream", "--gauge", "pivot") if name == "streamed_pivot" else ()
        model = assert_compress(src, tmp_path, capsys, name, *extra)
        c = model.config
        assert c.qk_norm and all(c.layer_qk_rank(i) == c.qk_rank for i in range(c.num_hidden_layers))
        kept = model.compression_report["qk_kept_full"]  # and the report says why
        assert sorted(kept) == ["0", "1", "2"] and all("QK-norm" in why for why in kept.values())


def test_export_to_qwen3_keeps_the_function_and_llama_is_refused(source, converted, tmp_path, capsys):
    run(["export", converted, tmp_path / "qwen3", "--to", "qwen3"], capsys)
    exported = load(tmp_path / "qwen3")
    assert type(exported) is Qwen3ForCausalLM
    assert relative_logit_difference(source, exported, token_ids()) < 1e-4
    _, err = run(["export", converted, tmp_path / "llama", "--to", "llama"], capsys, code=2)
    line = error_line(err)
    assert "qk_norm" in line and "--to qwen3" in line
    assert not (tmp_path / "llama").exists()


# ---- canonicalize, evaluate, finetune -----------------------------------------------------------------------------


def test_canonicalize_source_and_converted(source, checkpoint, converted, tmp_path, capsys):
    assert_canonicalize(checkpoint, tmp_path, capsys, source, "canonical_source")
    assert_canonicalize(converted, tmp_path, capsys, source, "canonical_relational")


def test_evaluate_gives_the_same_perplexity_before_and_after_conversion(checkpoint, converted, tmp_path, capsys):
    before, after = perplexity_of(checkpoint, tmp_path, capsys), perplexity_of(converted, tmp_path, capsys)
    assert after == pytest.approx(before, rel=1e-4)


def test_finetune_converted_and_source_with_projection(checkpoint, converted, tmp_path, capsys):
    tuned = assert_finetune(converted, tmp_path, capsys, "tuned")
    assert tuned.config.qk_norm
    assert_finetune(converted, tmp_path, capsys, "lora", "--method", "lora", "--merge")
    assert_finetune(checkpoint, tmp_path, capsys, "projected", "--projection", "update")


def test_convert_with_slicing_keeps_an_honest_count(source):
    assert_slice(source)


def test_qk_norm_option_is_validated_in_one_line():
    from relational_hf import RelationalConfig

    base = dict(vocab_size=16, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"`layer_qk_ranks` must be None with qk_norm=True"):
        RelationalConfig(**base, qk_norm=True, layer_qk_ranks=[8, 4])
    with pytest.raises(ValueError, match="qk_norm"):
        RelationalConfig(**base, qk_norm="yes")
    config = RelationalConfig(**base, qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm"):
        config.qk_norm = 1


def test_projected_finetuning_of_the_converted_model(converted, tmp_path, capsys):
    """The QK pair of a QK-normed relational model is stored free: its rotations and the gain exchange are what the
    projection keeps the updates horizontal to."""
    assert_finetune(converted, tmp_path, capsys, "projected_relational", "--projection", "update")
