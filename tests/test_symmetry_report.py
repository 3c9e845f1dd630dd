"""Redundancy report: totals, serialisation, invariant descriptors (ranks, similarities), plots and the CLI hook."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_symmetry_zoo import (
    build,
    perturb,
)

from relational_hf.commands.main import main
from relational_hf.symmetry import (
    apply_random_symmetry,
    head_descriptors,
    plot_head_similarity,
    plot_redundancy_by_layer,
    redundancy_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_report_totals_percentages_and_serialisation():
    model = build("llama")
    report = redundancy_report(model)
    total = sum(p.numel() for p in model.parameters())
    assert report.total_parameters == total == 26_784  # 2 x 128 x 32 embeddings/head + 2 x 9_280 per layer + 32
    assert report.redundant_dimensions == 1_072
    assert report.redundant_percent == pytest.approx(100 * 1_072 / 26_784)
    assert report.by_layer == {0: 272, 1: 272}  # 16 QK + 128 VO + 64 MLP + 2 x 32 gains per layer
    assert report.model_wide == {"norm_gain": 32, "residual_rotation": 496}
    data = json.loads(json.dumps(report.to_dict()))
    assert data["quotient_dimension"] == 26_784 - 1_072 and data["by_group"]["vo_gauge"] == 256
    text = report.to_markdown()
    assert "26,784" in text and "| vo_gauge | 256 |" in text and "Effective ranks" in text


def test_effective_rank_counts_singular_values_above_the_stated_tolerance():
    model = build("relational_free_none_vpr")
    with torch.no_grad():
        q = model.model.layers[0].self_attn.q_proj.weight  # head 0 = rows 0..7 hold W_Q^T
        q[3:8] = 1e-6 * q[3:8]  # 5 of 8 directions nearly gone: below 1e-3 x largest
    layer0 = head_descriptors(model, rank_tol=1e-3)[0]
    assert layer0.qk_rank == [3, 8, 8, 8]
    assert head_descriptors(model, rank_tol=1e-8)[0].qk_rank[0] == 8
    assert layer0.vo_rank == [8, 8, 8, 8]


def test_head_similarities_are_invariant_under_every_symmetry():
    model = perturb(build("llama")).double()
    moved = apply_random_symmetry(copy.deepcopy(model), torch.Generator().manual_seed(4), scale=0.5)
    for a, b in zip(head_descriptors(model), head_descriptors(moved), strict=True):
        assert torch.allclose(a.qk_similarity, b.qk_similarity, atol=1e-6)
        assert torch.allclose(a.vo_similarity, b.vo_similarity, atol=1e-6)
        assert torch.allclose(a.qk_similarity.diagonal(), torch.ones(4))
        assert torch.allclose(a.qk_similarity, a.qk_similarity.T, atol=1e-6)


def test_plots_write_png_files(tmp_path):
    report = redundancy_report(build("gpt2"))
    bar = plot_redundancy_by_layer(report, tmp_path / "bars.png")
    heatmaps = plot_head_similarity(report, tmp_path / "heat")
    assert bar.read_bytes()[:8] == PNG_MAGIC
    assert len(heatmaps) == 2 and all(p.read_bytes()[:8] == PNG_MAGIC for p in heatmaps)


def test_redundancy_command_on_a_saved_checkpoint(tmp_path, capsys):
    build("relational_free").save_pretrained(tmp_path / "ckpt")
    args = [
            "redundancy",
            str(tmp_path / "ckpt"),
            "--png",
            str(tmp_path / "r.png"),
            "--json",
            str(tmp_path / "r.json"),
            "--heatmap-dir",
            str(tmp_path / "maps"),
    ]
    assert main(args) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["redundant_dimensions"] == 912  # 32 QK + 256 VO + 128 MLP + 496 residual
    assert (tmp_path / "r.png").exists() and len(list((tmp_path / "maps").glob("*.png"))) == 2
    assert "Redundancy of `RelationalForCausalLM`" in capsys.readouterr().out
    assert main(["redundancy", str(tmp_path / "ckpt"), "--meta"]) == 0
    out = capsys.readouterr().out  # config alone: the residual rotation (tied head, final gain) is listed apart
    assert "redundant (gauge) dimensions: 416" in out and "at most 496 more" in out
