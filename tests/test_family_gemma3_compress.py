"""Gemma 3 (text) compressed and exported back: `compress` of the Gemma 3 checkpoint and of its conversion, with
random norm gains, a sliding-window layer (window 4, sequences longer than it) and sandwich norms; `export --to gemma3`
back to Transformers' Gemma3ForCausalLM. The model, its checkpoint and its conversion are conftest.py's fixtures
(`gemma3_models.convertible`); the layer-streamed compression against the in-memory one:
tests/test_family_gemma3_stream.py."""

from __future__ import annotations

import pytest
import torch
from family_checks import run_cli
from gemma3_models import convertible, longer_than_the_window

from relational_hf.compress import LowRankOptions, compress_relational
from relational_hf.convert import to_relational

#: small grids for the tiny model (d_ff 64, head width 8)
SMALL = dict(mlp_step=8, min_mlp_units=8, vo_step=2, min_vo_rank=2, plan_windows=4)


@pytest.fixture(scope="module")
def relational(gemma3_source):
    return to_relational(gemma3_source)


def _calibration() -> torch.Tensor:
    from family_helpers import token_ids

    return token_ids(batch=8, length=24, seed=3)


def _stored(model) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def test_the_compression_reads_each_layer_as_the_model_computes_it(relational):
    """The stream the compression fits layer by layer (the embedding scale, each layer's own mask and rotary table,
    the sandwich norms) is the model's own: pass 1's layer outputs equal the forward's hidden states. A sliding layer
    attended fully, or an update taken before its sandwich norm, would differ by O(1)."""
    from relational_hf.compress.layer_inputs import layer_positions
    from relational_hf.compress.lowrank import embedded, layer_error_curves

    ids = longer_than_the_window(batch=2, length=16)
    expected = relational(ids, output_hidden_states=True).hidden_states
    opts = LowRankOptions(sensitivity="relative", **SMALL).resolved(relational.config, ids)
    positions = layer_positions(relational.config, ids.shape[1])
    assert not torch.equal(positions[0][2], positions[1][2])  # the sliding layer's mask is its own
    h = embedded(relational, ids)
    torch.testing.assert_close(h, expected[0])
    for li, layer in enumerate(relational.model.layers):
        _, h = layer_error_curves(relational.config, layer, h, opts, positions[li])
        if li + 1 < len(relational.model.layers):  # the last hidden state is after the final norm
            torch.testing.assert_close(h, expected[li + 1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sensitivity", ["fisher", "relative"])
def test_compress_at_the_full_budget_keeps_the_logits_and_a_small_removal_stays_close(
    gemma3_source, relational, sensitivity
):
    """At the full budget (pivot gauge: no width removed) the refitted model computes the source's logits (within
    1e-4 of their scale); at 5% removed, the widths narrow and the logits stay within a third of their scale."""
    from family_helpers import relative_logit_difference

    full = _stored(relational)
    ids = longer_than_the_window()
    opts = LowRankOptions(gauge="pivot", sensitivity=sensitivity, **SMALL)
    same, result = compress_relational(relational, _calibration(), full, opts, progress=False)
    assert result.widths["mlp"] == [64, 64] and result.widths["vo"] == [8, 8]
    assert relative_logit_difference(gemma3_source, same, ids) < 1e-4
    smaller, result = compress_relational(relational, _calibration(), int(0.95 * full), opts, progress=False)
    assert _stored(smaller) <= int(0.95 * full)
    assert relative_logit_difference(gemma3_source, smaller, ids) < 0.35
    assert result.qk_kept_full  # QK-norm over the whole head: the QK forms keep their width


def test_the_compressed_model_keeps_its_options_gains_and_reloads(relational, tmp_path):
    """The compressed model keeps the sandwich norms' gains, the embedding scale and the sliding-window layers, its
    tied head stays tied, and AutoModelForCausalLM reloads it with the same logits."""
    from transformers import AutoModelForCausalLM

    new, _ = compress_relational(relational, _calibration(), int(0.9 * _stored(relational)), LowRankOptions(**SMALL),
                                 progress=False)  # fmt: skip
    c = new.config
    assert c.sandwich_norms and c.embedding_scale == relational.config.embedding_scale
    assert (c.layer_types, c.sliding_window) == (relational.config.layer_types, relational.config.sliding_window)
    assert new.lm_head.weight is new.model.embed_tokens.weight
    for mine, theirs in zip(new.model.layers, relational.model.layers, strict=True):
        assert torch.equal(mine.mlp_output_norm.weight, theirs.mlp_output_norm.weight)
        assert torch.equal(mine.attention_output_norm.weight, theirs.attention_output_norm.weight)
        assert torch.equal(mine.self_attn.k_norm.weight, theirs.self_attn.k_norm.weight)
    new.save_pretrained(tmp_path / "c")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "c").eval()
    ids = longer_than_the_window()
    with torch.no_grad():
        logits = new(ids).logits
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(again(ids).logits, logits)


def test_compress_gemma3_and_its_conversion_from_the_command_line(
    gemma3_checkpoint, gemma3_converted, tmp_path, capsys
):
    """`compress --remove 0.1` of the Gemma 3 checkpoint and of its conversion (layer-streamed, the default for a
    local safetensors folder): the report's stored count is the checkpoint's and the closed form's, the tied head
    stays tied, it loads and generates (`assert_compress`); the MLP or VO widths narrowed; the refit's target behind
    the sandwich norms is the local one (recorded)."""
    import json

    from family_helpers import assert_compress

    for name, src in (("from_source", gemma3_checkpoint), ("from_relational", gemma3_converted)):
        model = assert_compress(src, tmp_path, capsys, name)
        c = model.config
        assert c.sandwich_norms and c.layer_types == ["sliding_attention", "full_attention"]
        widths = [c.layer_intermediate_size(i) + c.layer_value_rank(i) for i in range(c.num_hidden_layers)]
        assert sum(widths) < 2 * (64 + 8)
        report = json.loads((tmp_path / name / "compression_report.json").read_text())
        assert report["streamed"] and '"correction": "local"' in json.dumps(report)


def test_slicing_in_compress_is_refused_in_one_line(gemma3_checkpoint, tmp_path):
    """`--method slice` and `--slice-fraction` rotate the stream, which the sandwich norms do not commute with."""
    from family_helpers import error_line, text_file

    common = [
        "--remove",
        "0.1",
        "--window",
        "16",
        "--calibration-windows",
        "2",
        "--calibration",
        str(text_file(tmp_path)),
    ]
    for name, extra in (("method", ["--method", "slice"]), ("fraction", ["--slice-fraction", "0.1"])):
        code, _, err = run_cli(["compress", str(gemma3_checkpoint), str(tmp_path / name), *common, *extra])
        line = error_line(err)
        assert code != 0 and "sandwich norms" in line and "not sliced" in line, line
        assert not (tmp_path / name).exists()


# ---- export --to gemma3 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [dict(), dict(tie_word_embeddings=False), dict(attention_bias=True), dict(layer_types=["full_attention"] * 2)],
    ids=["tied", "untied_head", "attention_bias", "full_layers_only"],
)
def test_export_to_gemma3_gives_the_sources_logits(variant):
    """Gemma 3 -> relational -> Gemma3ForCausalLM: the logits of the source within 1e-4 of their scale (fp32, random
    non-zero gains, sequences longer than the window); every norm's 1 + w is the gain the relational model applies
    (unit pre-norms, stored sandwich, QK and final gains), query_pre_attn_scalar = head_dim."""
    from family_helpers import relative_logit_difference

    from relational_hf.convert.export_gemma import to_gemma3

    source = convertible(seed=2, **variant)
    relational = to_relational(source)
    exported, report = to_gemma3(relational)
    assert type(exported).__name__ == "Gemma3ForCausalLM" and exported.config.model_type == "gemma3_text"
    ids = longer_than_the_window()
    assert relative_logit_difference(source, exported, ids) < 1e-4
    assert report.max_logit_difference < 1e-4 and report.padding_zeros == 0
    c, mine = exported.config, relational.model.layers[1]
    assert c.layer_types == source.config.layer_types and c.query_pre_attn_scalar == c.head_dim
    assert c.tie_word_embeddings == source.config.tie_word_embeddings
    layer = exported.model.layers[1]
    assert float(layer.input_layernorm.weight.detach().abs().max()) == 0.0  # folded into q/k/v: unit
    torch.testing.assert_close(1 + layer.post_feedforward_layernorm.weight, mine.mlp_output_norm.weight)
    torch.testing.assert_close(1 + layer.self_attn.q_norm.weight, mine.self_attn.q_norm.weight)


def test_export_command_round_trip_and_a_compressed_model_padded_with_zeros(
    gemma3_source, gemma3_converted, tmp_path, capsys
):
    """`export --to gemma3` of the conversion writes a checkpoint that Transformers' Gemma3ForCausalLM loads (no
    plugin code) with the source's logits; a compressed conversion (per-layer VO and MLP widths) exports padded with
    zeros, with its own logits."""
    from family_helpers import load, relative_logit_difference, run
    from transformers import Gemma3ForCausalLM

    run(["export", gemma3_converted, tmp_path / "g", "--to", "gemma3"], capsys)
    back = Gemma3ForCausalLM.from_pretrained(tmp_path / "g").eval()
    ids = longer_than_the_window()
    assert relative_logit_difference(gemma3_source, back, ids) < 1e-4
    relational = load(gemma3_converted)
    smaller, _ = compress_relational(relational, _calibration(), int(0.85 * _stored(relational)),
                                     LowRankOptions(**SMALL), progress=False)  # fmt: skip
    c = smaller.config
    assert c.layer_intermediate_sizes != [c.intermediate_size] * 2 or c.layer_value_ranks != [c.head_dim] * 2
    smaller.save_pretrained(tmp_path / "small")
    run(["export", tmp_path / "small", tmp_path / "small_g", "--to", "gemma3"], capsys)
    padded = Gemma3ForCausalLM.from_pretrained(tmp_path / "small_g").eval()
    assert relative_logit_difference(smaller, padded, ids) < 1e-4
    import json

    report = json.loads((tmp_path / "small_g" / "export_report.json").read_text())
    assert report["padding_zeros"] > 0


def test_export_refuses_what_gemma3_does_not_hold_in_one_line(tmp_path, capsys):
    """A relational model without the sandwich norms (a Llama-shaped one) and one whose QK rank is below the head
    width are refused in one line naming the field; nothing is written."""
    from family_helpers import error_line

    from relational_hf import RelationalConfig, RelationalForCausalLM

    base = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2)
    for name, fields, named in (
        ("llama_shaped", dict(), "qk_norm=False"),
        ("no_sandwich", dict(qk_norm=True, embedding_scale=4.0), "sandwich_norms=False"),
        ("other_scale", dict(qk_norm=True, sandwich_norms=True, embedding_scale=2.0), "embedding_scale=2.0"),
        ("thin_keys", dict(qk_norm=True, sandwich_norms=True, embedding_scale=4.0, qk_rank=4), "qk_rank"),
    ):
        torch.manual_seed(0)
        RelationalForCausalLM(RelationalConfig(**base, **fields)).save_pretrained(tmp_path / name)
        code, _, err = run_cli(["export", str(tmp_path / name), str(tmp_path / f"{name}_out"), "--to", "gemma3"])
        line = error_line(err)
        assert code == 2 and "--to gemma3" in line and named in line, line
        assert not (tmp_path / f"{name}_out").exists()
