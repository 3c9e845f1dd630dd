"""`compress --width-multiple N` (`LowRankOptions.width_multiple`): every SwiGLU width the plan narrows is a
multiple of N (what llama.cpp's quantisers need of the compressed down maps' rows), the stored budget is still met,
and the option is refused in one line where it does not apply."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf.commands.main import main
from relational_hf.compress import LowRankOptions
from relational_hf.compress.budget import mlp_width_grid, width_grid
from relational_hf.jobs import compress_model


@pytest.mark.parametrize("width,multiple,step", [(1536, 256, 64), (96, 32, 64), (100, 32, 8), (96, 16, 8)])
def test_grid_holds_multiples_below_the_width(width, multiple, step):
    grid = mlp_width_grid(width, LowRankOptions(width_multiple=multiple, mlp_step=step, min_mlp_units=8))
    assert grid, "a width above the multiple has narrower candidates"
    assert all(w % multiple == 0 and 0 < w < width for w in grid)
    assert grid == sorted(grid, reverse=True) and len(set(grid)) == len(grid)
    assert min(grid) >= multiple and max(grid) == (width - 1) // multiple * multiple


def test_grid_without_a_multiple_is_the_plain_grid():
    opts = LowRankOptions()
    assert mlp_width_grid(1536, opts) == list(width_grid(1536, opts.mlp_step, opts.min_mlp_units))


@pytest.mark.parametrize("multiple", [8, 32, 64])
def test_a_multiple_the_plain_grid_already_honours_changes_nothing(multiple):
    """SmolLM2's 1536 units in the default steps of 64 are multiples of 64 already: --width-multiple 32 or 64 must
    plan the very model the defaults plan (measured: the same widths and perplexities at 64), not an offset grid."""
    plain = mlp_width_grid(1536, LowRankOptions())
    assert mlp_width_grid(1536, LowRankOptions(width_multiple=multiple)) == plain
    assert mlp_width_grid(1536, LowRankOptions(width_multiple=128)) != plain  # a coarser multiple does change it


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        model.model.layers[1].mlp.down_proj.weight.mul_(4)  # uneven layers: the plan narrows them differently
    return model


def test_compressed_widths_are_multiples_and_the_budget_holds():
    llama = _llama()
    source = sum(p.numel() for p in llama.parameters())
    ids = torch.randint(0, 64, (6, 24))
    model, report = compress_model(
        llama, remove=0.3, method="relational", calibration=ids, progress=False, plan_windows=3, width_multiple=32
    )
    widths = [model.config.layer_intermediate_size(i) for i in range(3)]
    assert any(w < 128 for w in widths), widths
    assert all(w % 32 == 0 for w in widths), widths
    assert report["parameters_after"] <= int(0.7 * source)


def test_width_multiple_is_refused_where_it_does_not_apply(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["compress", "src", str(out), "--remove", "0.2", "--method", "slice", "--width-multiple", "32"]) == 2
    err = capsys.readouterr().err
    assert "--width-multiple" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    assert main(["compress", "src", str(out), "--remove", "0.2", "--width-multiple", "0"]) == 2
    assert "--width-multiple" in capsys.readouterr().err


def test_kinds_mlp_keeps_every_attention_width_whole_through_the_command(tmp_path, capsys):
    """`compress --kinds mlp` (what llama.cpp runs without padding): the budget falls on the MLP alone, every query,
    key and value width of the written model is the source's, the stored budget still holds."""
    from transformers import AutoModelForCausalLM

    llama = _llama()
    source = sum(p.numel() for p in llama.parameters())
    llama.save_pretrained(tmp_path / "src")
    torch.save(torch.randint(0, 64, (8, 24)), tmp_path / "cal.pt")
    out = tmp_path / "out"
    argv = ["compress", str(tmp_path / "src"), str(out), "--remove", "0.25", "--calibration", str(tmp_path / "cal.pt"),
            "--calibration-windows", "8", "--window", "24", "--self-calibration", "0", "--eval-windows", "2"]  # fmt: skip
    assert main([*argv, "--kinds", "mlp"]) == 0, capsys.readouterr().err
    model = AutoModelForCausalLM.from_pretrained(out)
    report = __import__("json").loads((out / "compression_report.json").read_text())
    assert report["options"]["kinds"] == ["mlp"]
    assert sum(p.numel() for p in model.parameters()) <= int(0.75 * source)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert attn.q_proj.weight.shape == llama.model.layers[i].self_attn.q_proj.weight.shape
        assert attn.k_proj.weight.shape == llama.model.layers[i].self_attn.k_proj.weight.shape
        assert attn.v_proj.weight.shape == llama.model.layers[i].self_attn.v_proj.weight.shape
        assert attn.o_proj.weight.shape == llama.model.layers[i].self_attn.o_proj.weight.shape
    assert any(model.config.layer_intermediate_size(i) < 128 for i in range(3))
    assert main([*argv[:2], str(tmp_path / "o2"), *argv[3:], "--kinds", "attn"]) == 2
    assert "--kinds" in capsys.readouterr().err and not (tmp_path / "o2").exists()
