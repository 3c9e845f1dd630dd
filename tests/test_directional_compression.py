"""Compression diagnostics: the layer-local counterfactual error, the built-in compressors, the report and the
`analyze` command."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from scipy.stats import spearmanr
from test_directional import VOCAB, tiny_gpt2, tiny_llama, tiny_relational
from transformers import LlamaForCausalLM

from relational_hf.commands import analyze
from relational_hf.directional import (
    COMPRESSION_SETTINGS,
    compress,
    compression_error,
    compression_report,
    prune_weights,
    quantize_weights,
)
from relational_hf.directional.compression import fake_quantize, weight_matrices

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"



def wide_llama() -> LlamaForCausalLM:
    return tiny_llama(hidden_size=64, intermediate_size=128)


MODELS = {"llama": wide_llama, "relational": tiny_relational, "gpt2": tiny_gpt2}


def ids(rows: int = 4, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length))


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


def test_fake_quantisation_uses_at_most_2_to_the_b_levels_per_group_and_keeps_the_original():
    model = wide_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    w = torch.randn(8, 40)
    q = fake_quantize(w, bits=4, group_size=16)
    for g in range(0, 40, 16):
        group = q[:, g : g + 16]
        for row in range(8):
            assert group[row].unique().numel() <= 16
        assert (group - w[:, g : g + 16]).abs().max() <= w[:, g : g + 16].abs().max() / 7 / 2 + 1e-6
    compressed = quantize_weights(model, bits=4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the dense model is untouched
    assert torch.equal(compressed.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert not torch.equal(compressed.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("pattern,n,m", [("2:4", 2, 4), ("4:8", 4, 8)])
def test_n_m_pruning_leaves_at_most_n_nonzeros_in_every_m_consecutive_inputs(family, pattern, n, m):
    model = MODELS[family]()
    for score in ("magnitude", "wanda"):
        pruned = prune_weights(model, score, pattern, calibration_ids=ids())
        matrices = weight_matrices(pruned)
        assert len(matrices) == len(weight_matrices(model)) > 0
        for matrix in matrices:
            rows = matrix.rows.detach()  # (outputs, inputs), whatever the storage layout
            full = rows[:, : rows.shape[1] // m * m].reshape(rows.shape[0], -1, m)
            assert (full.ne(0).sum(-1) <= n).all(), (family, pattern, score)


def test_wanda_scores_weights_by_input_activation_norms():
    model = wide_llama()
    calibration = ids(4, 16)
    pruned = prune_weights(model, "wanda", "unstructured", 0.5, calibration_ids=calibration)
    layer = model.model.layers[0]
    seen = []
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=calibration)
    handle.remove()
    norms = torch.cat(seen).norm(dim=0)  # ||x_j||_2 over all calibration tokens
    w = layer.mlp.down_proj.weight
    score = w.abs() * norms
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(1, score.topk(w.shape[1] // 2, dim=1).indices, True)
    assert torch.equal(pruned.model.layers[0].mlp.down_proj.weight, w * keep)
    magnitude = prune_weights(model, "magnitude", "unstructured", 0.5)
    assert not torch.equal(magnitude.model.layers[0].mlp.down_proj.weight.ne(0), keep)
    assert magnitude.model.layers[0].mlp.down_proj.weight.eq(0).float().mean().item() == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(ValueError, match="needs calibration_ids"):
        prune_weights(model, "wanda")


def test_wanda_on_a_gauge_fixed_map_scores_each_free_entry_by_the_norm_of_its_own_input_feature():
    model = tiny_relational()
    calibration = ids(4, 16)
    pruned = prune_weights(model, "wanda", "unstructured", 0.5, calibration_ids=calibration)
    v_proj = model.model.layers[1].self_attn.v_proj  # GaugeFixedLinear: free entries (out, in - d_h), per-row columns
    seen = []
    handle = v_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=calibration)
    handle.remove()
    norms = torch.cat(seen).norm(dim=0)
    score = v_proj.weight.abs() * torch.gather(norms.expand(v_proj.out_features, -1), 1, v_proj.free_index)
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(score.shape[1] // 2, dim=1).indices, True)
    assert torch.equal(pruned.model.layers[1].self_attn.v_proj.weight, v_proj.weight * keep)


def test_relational_pivot_entries_stay_exact_under_compression():
    model = tiny_relational()
    compressed = compress(model, "int4")
    for dense, quantised in zip(model.model.layers, compressed.model.layers):
        k, k_q = dense.self_attn.k_proj, quantised.self_attn.k_proj
        assert torch.equal(k.fixed_value, k_q.fixed_value) and torch.equal(k.fixed_index, k_q.fixed_index)
        assert not torch.equal(k.weight, k_q.weight)


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
        compress(model, "int2")


def test_analyze_command_writes_report_and_figures(tmp_path, capsys):
    if not SHAKESPEARE.is_file():
        pytest.skip("../shared/data/tinyshakespeare not found; see ../shared/data/README.md")
    model_dir = tmp_path / "model"
    tiny_relational().save_pretrained(model_dir)  # no tokenizer saved: the command falls back to UTF-8 bytes
    text = tmp_path / "text.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:4000])
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


def test_every_listed_setting_compresses_as_its_name_says():
    model = tiny_gpt2()
    calibration = ids(2, 8)
    direct = {"int8": lambda: quantize_weights(model, 8), "int4": lambda: quantize_weights(model, 4)}
    for score in ("magnitude", "wanda"):
        for pattern in ("unstructured", "2:4", "4:8"):
            name = score if pattern == "unstructured" else f"{score}-{pattern}"
            direct[name] = lambda s=score, p=pattern: prune_weights(model, s, p, 0.5, calibration)
    assert sorted(direct) == sorted(COMPRESSION_SETTINGS)
    results = {}
    for setting in COMPRESSION_SETTINGS:
        compressed = compress(model, setting, calibration_ids=calibration)
        rows = [m.rows.detach() for m in weight_matrices(compressed)]
        assert all(torch.equal(a, b.rows) for a, b in zip(rows, weight_matrices(direct[setting]())))
        assert any(not torch.equal(a, b.rows) for a, b in zip(rows, weight_matrices(model)))
        results[setting] = rows
    for pattern in ("", "-2:4", "-4:8"):  # Wanda's activation-aware score picks other weights than magnitude
        assert any(not torch.equal(a, b) for a, b in zip(results[f"wanda{pattern}"], results[f"magnitude{pattern}"]))
