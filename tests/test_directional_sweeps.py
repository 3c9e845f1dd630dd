"""The fast sweep engine and the per-layer protocol: a replay from a recorded layer input gives exactly the edited
model's loss, the head-chunked NLL equals the model's own perplexity (and falls back where logits are
post-processed), per-layer sweeps edit one layer only, and the tables keep their layout for any value."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import corpus_or_skip
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.commands import analyze
from relational_hf.commands.analyze import compression_settings
from relational_hf.compress import compress_weights
from relational_hf.directional import (
    CleanPass,
    compression_error,
    perplexity,
    scale_components,
    sweep_all,
    sweep_components,
    sweep_layers,
    sweep_per_layer,
)
from relational_hf.directional.replay import replay_blocks
from relational_hf.directional.tables import format_number, markdown_table

VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2)).eval()


def tiny_relational() -> RelationalForCausalLM:
    return RelationalForCausalLM(RelationalConfig(**TINY, num_key_value_heads=2)).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


class LlamaScaledLogits(LlamaForCausalLM):
    """A Llama whose forward post-processes the logits (like logit soft-capping or scaling): hidden state -> head is not the
    whole story, so the chunked-head NLL must not be used."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2.0 * out.logits + 1.0
        return out


FAMILIES = {"llama": tiny_llama, "relational": tiny_relational, "gpt2": tiny_gpt2}


def data(rows: int = 5, length: int = 12, pad: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, length))
    mask = torch.ones_like(ids)
    mask[1, length - pad :] = 0
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_clean_pass_perplexity_equals_the_models_own_perplexity(family):
    model = FAMILIES[family]()
    ids, mask = data()
    clean = CleanPass(model, ids, mask, batch_size=2, progress=False)
    assert clean._fast_head and clean.chained
    assert clean.baseline == pytest.approx(perplexity(model, ids, mask, 2), rel=1e-5)
    assert clean.baseline_of(3) == pytest.approx(perplexity(model, ids[:3], mask[:3], 2), rel=1e-5)


def test_post_processed_logits_fall_back_to_the_full_model():
    model = LlamaScaledLogits(LlamaConfig(**TINY)).eval()
    ids, mask = data()
    clean = CleanPass(model, ids, mask, batch_size=2, progress=False)
    assert clean._fast_head is False  # the chunked head would miss the scaling
    assert clean.baseline == pytest.approx(perplexity(model, ids, mask, 2), rel=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("site", ["residual_attention", "residual_mlp", "block", "value", "value_exclude_self"])
def test_replaying_from_the_recorded_layer_input_equals_a_full_recomputation(family, site):
    model = FAMILIES[family]()
    ids, mask = data()
    clean = CleanPass(model, ids, mask, batch_size=2, progress=False)
    for layer in range(3):
        with scale_components(model, site, parallel=0.0, perpendicular=0.5, layers=[layer]):
            replayed = clean.perplexity(start_layer=layer, rows=3)
            direct = perplexity(model, ids[:3], mask[:3], 2)
        assert replayed == pytest.approx(direct, rel=1e-5), (site, layer)
        assert replayed != pytest.approx(clean.baseline_of(3), rel=1e-7)  # the edit did change the loss


def test_replayed_blocks_compute_nothing_and_are_restored_also_after_an_error():
    model = tiny_llama()
    ids, _ = data(2, 8, 0)
    before = model(input_ids=ids).logits
    clean = CleanPass(model, ids, batch_size=2, progress=False)
    blocks = clean.blocks
    with pytest.raises(RuntimeError, match="boom"), replay_blocks(blocks[:2], clean.outputs[0][:2]):
        garbage = torch.full_like(clean.first_inputs[0], float("nan"))
        # the replayed blocks ignore their (nan) input: the output still equals the clean one
        assert torch.equal(blocks[1](garbage), clean.block_output(0, 1))
        raise RuntimeError("boom")
    assert all("forward" not in block.__dict__ for block in blocks)
    assert torch.equal(model(input_ids=ids).logits, before)


def test_start_layer_and_rows_are_checked():
    model = tiny_llama()
    ids, _ = data(2, 8, 0)
    clean = CleanPass(model, ids, batch_size=2, progress=False)
    with pytest.raises(ValueError, match=r"start_layer must be in \[0, 3\]"):
        clean.nll(start_layer=4)
    with pytest.raises(ValueError, match=r"rows must be in \[1, 2\]"):
        clean.nll(rows=3)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        CleanPass(model, ids, batch_size=0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        CleanPass(model, ids[:, :1])
    with pytest.raises(ValueError, match="another model, other inputs"):
        sweep_components(tiny_llama(), ids, "block", clean=clean, batch_size=2)


def test_per_layer_sweep_edits_one_layer_and_unit_scale_is_the_baseline():
    model = tiny_llama()
    ids, mask = data()
    result = sweep_layers(model, ids, "residual_mlp", "parallel", [0.0, 1.0], attention_mask=mask, batch_size=2)
    assert result.layers == [0, 1, 2] and result.tokens == int(mask[:, 1:].sum())
    assert all(row[1] == 0.0 for row in result.deltas)  # s = 1: the unedited model, exactly
    for layer, row in zip(result.layers, result.perplexities):
        with scale_components(model, "residual_mlp", parallel=0.0, layers=[layer]):
            assert row[0] == pytest.approx(perplexity(model, ids, mask, 2), rel=1e-5)
    # editing every layer at once is a different protocol: its perplexity is none of the one-layer ones
    everywhere = sweep_components(model, ids, "residual_mlp", "parallel", [0.0], mask, batch_size=2)
    assert all(everywhere.perplexities[0] != pytest.approx(row[0], rel=1e-6) for row in result.perplexities)


def test_value_sites_share_their_perpendicular_runs_and_results_are_complete():
    model = tiny_llama()
    ids, _ = data(4, 10, 0)
    clean = CleanPass(model, ids, batch_size=2, progress=False)
    edits = [("parallel", [0.0, 0.5]), ("perpendicular", [0.0])]
    results = sweep_per_layer(model, ids, ["value", "value_exclude_self"], edits, batch_size=2, clean=clean, rows=2)
    assert [(r.site, r.component, r.values) for r in results] == [
        ("value", "parallel", [0.0, 0.5]),
        ("value", "perpendicular", [0.0]),
        ("value_exclude_self", "parallel", [0.0, 0.5]),
        ("value_exclude_self", "perpendicular", [0.0]),
    ]
    assert results[1].perplexities == results[3].perplexities  # o_perp = c_perp: one run serves both
    with scale_components(model, "value_exclude_self", perpendicular=0.0, layers=[1]):
        direct = perplexity(model, ids[:2], batch_size=2)
    assert results[3].perplexities[1][0] == pytest.approx(direct, rel=1e-5)
    assert results[0].perplexities != results[2].perplexities  # the parallel scale acts on different vectors
    all_layers = sweep_all(model, ids, ["value", "value_exclude_self"], values=[0.0], batch_size=2, clean=clean)
    assert all_layers[1].perplexities == all_layers[3].perplexities
    json.dumps([r.to_dict() for r in results])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compression_error_from_the_recorded_pass_equals_the_two_pass_computation(family):
    model = FAMILIES[family]()
    ids, mask = data()
    compressed = compress_weights(model, "int4")
    clean = CleanPass(model, ids, mask, batch_size=2, progress=False)
    cached = compression_error(model, compressed, ids, mask, batch_size=2, clean=clean)
    direct = compression_error(model, compressed, ids, mask, batch_size=2)
    for a, b in zip(cached, direct):
        assert a.count == b.count and a.perpendicular == pytest.approx(b.perpendicular, rel=1e-6)
        assert a.parallel == pytest.approx(b.parallel, rel=1e-6) and a.total > 0


def test_numbers_keep_the_table_layout_whatever_their_size():
    values = [0.0, 1e-9, -3.5e-4, 0.0123, 1.5, -26.0, 9999.4, 12345.0, 1.7e39, -2e300, float("inf"), float("nan")]
    cells = [format_number(v, signed=True) for v in values]
    assert all(len(c) <= 10 for c in cells), cells
    assert format_number(1.7e39, signed=True) == "+1.70e+39" and format_number(1.5, signed=True) == "+1.500"
    assert format_number(None) == "n/a" and format_number(float("inf"), True) == "+inf"
    assert float(format_number(12345.0)) == pytest.approx(12345.0, rel=1e-2)
    table = markdown_table(["site", "dPPL"], [["block", c] for c in cells])
    assert len({len(line) for line in table.splitlines()}) == 1  # every line, header and rule the same width
    assert all(line.count("|") == 3 for line in table.splitlines())


def test_compression_none_is_accepted_and_cannot_be_mixed():
    assert compression_settings(["none"]) == [] and compression_settings(["NONE"]) == []
    assert compression_settings(["int8", "wanda-2:4"]) == ["int8", "wanda-2:4"]
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        compression_settings(["none", "int8"])
    with pytest.raises(ValueError, match="allowed settings"):
        compression_settings(["int3"])




def test_analyze_reports_per_layer_edits_in_json_markdown_and_figure(tmp_path, capsys):
    shakespeare = corpus_or_skip("tinyshakespeare")
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_bytes(shakespeare.read_bytes()[:3000])
    argv = [str(model_dir), "--text", str(text), "--out", str(tmp_path / "out"), "--max-tokens", "640"]
    argv += ["--seq-len", "64", "--batch-size", "4", "--per-layer-tokens", "128", "--compression", "none"]
    report = analyze.run(analyze.Arguments.parse(argv))
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "compression" not in saved  # --compression none skips it
    assert [(s["site"], s["component"], s["values"]) for s in saved["per_layer"]] == [
        (site, component, values)
        for site in ("residual_attention", "residual_mlp", "value_exclude_self")
        for component, values in (("parallel", [0.0, 0.5]), ("perpendicular", [0.0]))
    ]
    first = saved["per_layer"][0]
    assert first["layers"] == [0, 1, 2] and first["rows"] == 2 and first["tokens"] == 2 * 63
    assert len(saved["sweeps"]) == 10 and saved["sweeps"][0]["values"] == [0.0, 0.5]
    assert (tmp_path / "out" / "per_layer.png").read_bytes()[:4] == b"\x89PNG"
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "Per-layer edits (one layer at a time" in markdown and "All-layer edits" in markdown
    layer_rows = [line for line in markdown.splitlines() if re.match(r"\| [0-2] +\|", line)]
    assert len(layer_rows) == 3 and all(line.count("|") == 11 for line in layer_rows)  # layer + 3 sites x 3 edits
    printed = capsys.readouterr().out
    assert "s_par=0.5" in printed and "min dPPL" in printed
    assert report["per_layer"] == saved["per_layer"]
    assert saved["complete"] and set(saved["timings_s"]) == {
        "clean_pass", "decomposition", "all_layer_edits", "per_layer_edits"
    }  # fmt: skip
    assert not list((tmp_path / "out").glob(".*.partial"))  # staged files were renamed into place
    skipped = analyze.run(analyze.Arguments.parse([*argv, "--no-per-layer", "--out", str(tmp_path / "b")]))
    assert "per_layer" not in skipped and not (tmp_path / "b" / "per_layer.png").exists()
    with pytest.raises(ValueError, match="--per-layer-values takes numbers or the single word 'none'"):
        analyze.run(analyze.Arguments.parse([*argv, "--per-layer-values", "zero"]))
    with pytest.raises(ValueError, match="--per-layer-tokens: must be an integer >= 1"):
        analyze.run(analyze.Arguments.parse([*argv, "--per-layer-tokens", "0"]))


def test_an_interrupted_analysis_leaves_the_finished_stages_on_disk(tmp_path, monkeypatch):
    import relational_hf.directional.analysis as analyze_module

    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 8)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(analyze_module, "sweep_per_layer", interrupted)
    argv = [str(model_dir), "--text", str(text), "--out", str(tmp_path / "out"), "--max-tokens", "256"]
    with pytest.raises(KeyboardInterrupt):
        analyze.run(analyze.Arguments.parse([*argv, "--seq-len", "32", "--compression", "none", "--sites", "block"]))
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["complete"] is False and saved["sweeps"] and "per_layer" not in saved
    assert "All-layer edits" in (tmp_path / "out" / "report.md").read_text()


def test_smollm2_layers_replay_exactly(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, num_hidden_layers=2).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 48))
    clean = CleanPass(model, ids, batch_size=2, progress=False)
    assert clean._fast_head and clean.baseline == pytest.approx(perplexity(model, ids, batch_size=2), rel=1e-5)
    with scale_components(model, "value_exclude_self", parallel=0.5, layers=[1]):
        assert clean.perplexity(start_layer=1) == pytest.approx(perplexity(model, ids, batch_size=2), rel=1e-5)
