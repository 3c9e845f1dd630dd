"""Compression diagnostics: the layer-local counterfactual error of a compressed model, the report that ranks the
compression settings and the `analyze` command."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import corpus_or_skip
from scipy.stats import spearmanr
from test_compress_ops import MODELS, ids, wide_llama
from test_directional import tiny_relational

from relational_hf.commands import analyze
from relational_hf.compress.ops import compress_weights, compressed_view, quantize_weights
from relational_hf.directional import CleanPass, compression_error, compression_report
from relational_hf.lm.metrics import perplexity


@pytest.mark.parametrize("family", list(MODELS))
def test_a_model_compared_with_itself_or_its_copy_has_zero_error(family):
    model = MODELS[family]()
    batch = ids()
    mask = torch.ones_like(batch)
    mask[-1, -5:] = 0
    for other in (model, copy.deepcopy(model)):
        errors = compression_error(model, other, batch, mask, batch_size=3)
        assert [e.layer for e in errors] == [0, 1]
        assert all(e.count == 4 * 16 - 5 for e in errors)
        assert all(e.parallel == e.perpendicular == e.total == 0.0 for e in errors)


@pytest.mark.parametrize("family", list(MODELS))
def test_int4_has_larger_error_than_int8_in_every_layer(family):
    model = MODELS[family]()
    batch = ids()
    int8 = compression_error(model, quantize_weights(model, bits=8, group_size=16), batch)
    int4 = compression_error(model, quantize_weights(model, bits=4, group_size=16), batch)
    for e8, e4 in zip(int8, int4):
        assert 0 < e8.total < e4.total
        assert e8.perpendicular < e4.perpendicular
        assert e4.total <= e4.parallel + e4.perpendicular + 1e-12  # |e| <= |e_par| + |e_perp| per token


def test_counterfactual_error_is_layer_local():
    """Changing only layer 1 of the copy leaves layer 0's error at zero and gives layer 1 an error whose parts
    match a direct computation on the dense layer-1 input."""
    model = wide_llama()
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(1.5)  # delta~ = delta + 0.5 * mlp(...): not along delta
    batch = ids(2, 8)
    errors = compression_error(model, other, batch)
    assert errors[0].total == 0.0
    hs = model(input_ids=batch, output_hidden_states=True).hidden_states
    h = hs[1]
    layer, layer_c = model.model.layers[1], other.model.layers[1]
    pos = model.model.rotary_emb(h, torch.arange(8)[None])
    mask = torch.full((8, 8), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        delta = layer(h, attention_mask=mask, position_embeddings=pos) - h
        e = layer_c(h, attention_mask=mask, position_embeddings=pos) - h - delta
    coef = (e * delta).sum(-1, keepdim=True) / (delta * delta).sum(-1, keepdim=True)
    par = (coef * delta).norm(dim=-1) / delta.norm(dim=-1)
    perp = (e - coef * delta).norm(dim=-1) / delta.norm(dim=-1)
    assert errors[1].parallel == pytest.approx(par.mean().item(), rel=1e-4)
    assert errors[1].perpendicular == pytest.approx(perp.mean().item(), rel=1e-4)


def test_compression_report_ranks_settings_and_correlates_with_perplexity():
    model = wide_llama()
    batch = ids(4, 16)
    report = compression_report(
        model, batch, ["int8", "int4", "magnitude", "wanda-2:4"], calibration_ids=ids(2, 16), progress=False
    )
    data = report.to_dict()
    errors = {s["setting"]: s for s in data["settings"]}
    assert data["ranking_perpendicular"] == sorted(errors, key=lambda k: errors[k]["perpendicular"])
    assert data["ranking_total"] == sorted(errors, key=lambda k: errors[k]["total"])
    assert data["ranking_perpendicular"][0] == "int8"
    rho = spearmanr([s["perpendicular"] for s in data["settings"]], [s["perplexity"] for s in data["settings"]])
    assert data["spearman_perpendicular"]["rho"] == pytest.approx(rho.statistic)
    json.dumps(data, allow_nan=False)
    assert "Spearman" in report.to_markdown()
    with pytest.raises(ValueError, match="allowed settings: int8, int4"):
        compression_report(model, batch, ["int8", "int2"], progress=False)


@pytest.mark.parametrize("family", ["relational", "gpt2"])
def test_the_report_without_copies_measures_what_the_compressed_copies_measure(family):
    """`compression_report` computes each setting through `compressed_view` of the model itself: its errors and
    perplexities are those of `compress_weights`' deep copies, and the model is dense afterwards."""
    torch.manual_seed(0)
    model = MODELS[family]().eval()
    batch, calibration = ids(4, 16), ids(2, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    settings = ["int4", "magnitude-2:4", "wanda"]
    report = compression_report(model, batch, settings, calibration_ids=calibration, batch_size=3, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for result in report.results:
        copy_ = compress_weights(model, result.setting, calibration_ids=calibration)
        expected = compression_error(model, copy_, batch, batch_size=3)
        for got, want in zip(result.layers, expected):
            assert got.count == want.count and got.total == pytest.approx(want.total, rel=1e-5)
            assert got.parallel == pytest.approx(want.parallel, rel=1e-5, abs=1e-9)
        assert result.perplexity == pytest.approx(perplexity(copy_, batch, batch_size=3), rel=1e-5)
    assert report.dense_perplexity == pytest.approx(perplexity(model, batch, batch_size=3), rel=1e-5)


def test_a_model_inside_its_compressed_view_needs_the_dense_record():
    model = wide_llama().eval()
    batch = ids(2, 8)
    clean = CleanPass(model, batch, batch_size=2, progress=False)
    with compressed_view(model, "int4"):
        with pytest.raises(ValueError, match="pass `clean`"):
            compression_error(model, model, batch, batch_size=2)
        errors = compression_error(model, model, batch, batch_size=2, clean=clean)
    assert all(e.total > 0 for e in errors)


def test_analyze_command_writes_report_and_figures(tmp_path, capsys):
    shakespeare = corpus_or_skip("tinyshakespeare")
    model_dir = tmp_path / "model"
    tiny_relational().save_pretrained(model_dir)  # no tokenizer saved: the command falls back to UTF-8 bytes
    text = tmp_path / "text.txt"
    text.write_bytes(shakespeare.read_bytes()[:4000])
    args = analyze.Arguments.parse(
        [
            str(model_dir),
            "--text",
            str(text),
            "--out",
            str(tmp_path / "out"),
            "--max-tokens",
            "1024",
            "--seq-len",
            "64",
            "--sweep-values",
            "0",
            "0.5",
            "--compression",
            "int8",
            "int4",
            "wanda-2:4",
        ]
    )
    report = analyze.run(args)
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["decomposition"].keys() == report["decomposition"].keys() and len(saved["decomposition"]) == 5
    assert len(saved["sweeps"]) == 10 and saved["compression"]["ranking_perpendicular"]
    assert saved["tokens_analysed"] == 1024 - 4 * 64  # a quarter of the rows calibrates Wanda
    for name in ("parallel_ratio.png", "sweep.png", "compression.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "value_exclude_self" in printed and "Spearman" in printed
    with pytest.raises(ValueError, match="allowed settings"):
        analyze.run(analyze.Arguments.parse([str(model_dir), "--text", str(text), "--compression", "int3"]))
