"""The refit of W_down chosen on held-back calibration windows (`LowRankOptions.refit_holdout`,
`compress.truncation.choose_refit`), and refitted to a fixed blend of its two targets (`LowRankOptions.refit_blend`)."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf.commands.main import main
from relational_hf.compress import LowRankOptions, compress_relational, lowrank
from relational_hf.compress.options import DEFAULT_REFIT_BLEND
from relational_hf.compress.truncation import REFIT_BLENDS, REFIT_RIDGES, choose_refit, mlp_refit
from relational_hf.convert import to_relational
from relational_hf.jobs import compress_model


def _stats(z, y):
    return z.T @ z, z.T @ y, float(y.pow(2).sum())


def _problem(seed: int, tokens: int = 60, k: int = 12, d: int = 5, noise: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(k, d, generator=g, dtype=torch.float64)
    z, z_h = (torch.randn(n, k, generator=g, dtype=torch.float64) for n in (tokens, 3 * tokens))
    clean = z @ a
    y = clean + noise * torch.randn(tokens, d, generator=g, dtype=torch.float64)  # noise only these windows have
    y_h = z_h @ a + noise * torch.randn(3 * tokens, d, generator=g, dtype=torch.float64)
    return z, y, clean, z_h, y_h


def test_choose_refit_minimises_the_held_back_residual_computed_directly():
    """The chosen (ridge, blend) is the grid point whose refit, fitted on the fitting windows, leaves the smallest
    residual on the held-back windows, and its reported error is that residual relative to ||Y_h||^2: the
    statistics-only formula equals the residual computed from the data themselves."""
    z, y, clean, z_h, y_h = _problem(0, noise=0.3)
    local = 0.7 * clean + 0.1  # a second target of the same shape
    gram, cross, _ = _stats(z, y)
    chosen = choose_refit((gram, cross, z.T @ local), _stats(z_h, y_h))
    residuals = {}
    for ridge, b in itertools.product(REFIT_RIDGES, REFIT_BLENDS):
        w = mlp_refit(gram, z.T @ (b * y + (1 - b) * local), torch.arange(12), ridge)  # (d, k)
        residuals[(ridge, b)] = float((z_h @ w.T - y_h).pow(2).sum())
    best = min(residuals, key=residuals.get)
    assert (chosen["ridge"], chosen["blend"]) == best
    assert chosen["held_error"] == pytest.approx(residuals[best] / float(y_h.pow(2).sum()), rel=1e-9)


def test_choose_refit_in_sample_takes_the_target_and_the_smallest_ridge():
    """Held-back statistics equal to the fitting ones: the least-squares fit of the target itself, with the least
    shrinkage, is the best (the in-sample error only grows with the ridge and away from the target)."""
    z, y, clean, _, _ = _problem(1)
    stats = _stats(z, y)
    chosen = choose_refit((stats[0], stats[1], z.T @ (clean + 1.0)), stats)
    assert chosen == {"ridge": min(REFIT_RIDGES), "blend": 1.0, "held_error": pytest.approx(chosen["held_error"])}


def test_choose_refit_blends_down_a_target_that_carries_the_fitting_windows_own_noise():
    """When the target Y holds noise that only the fitting windows have and a second target is its clean part, the
    held-back windows prefer the clean one (blend < 1) and its error there is lower than the plain refit's."""
    z, y, clean, z_h, y_h = _problem(2, tokens=30, noise=1.0)
    gram, cross, _ = _stats(z, y)
    held = _stats(z_h, y_h)
    chosen = choose_refit((gram, cross, z.T @ clean), held)
    plain = choose_refit((gram, cross, None), held, ridges=(min(REFIT_RIDGES),))
    assert chosen["blend"] < 1.0 and plain["blend"] == 1.0
    assert chosen["held_error"] < plain["held_error"]


def test_choose_refit_refuses_statistics_of_other_units():
    z, y, _, z_h, y_h = _problem(3)
    with pytest.raises(ValueError, match="same kept units"):
        choose_refit((*_stats(z, y)[:2], None), _stats(z_h[:, :5], y_h))


def _llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _compress(rel, ids, **options):
    budget = sum(p.numel() for p in rel.parameters()) - 40 * 3 * 48 * 2
    # the unit order and the refinement pinned (the automatic choices would refine the refit, and forward selection
    # picks units by the target, which the blend changes)
    opts = LowRankOptions(**{"sensitivity": "uniform", "plan_windows": 4, "refine_epochs": 0, "mlp_order": "score", **options})
    return compress_relational(copy.deepcopy(rel), ids, budget, opts, progress=False)


@pytest.mark.parametrize(("correction", "mlp_order"), [("dense", "score"), ("local", "score"), ("dense", "greedy")])
def test_holdout_only_chooses_the_refit_which_then_fits_every_window(monkeypatch, correction, mlp_order):
    """With the choice pinned to the default ridge and the target itself, holding windows back changes nothing: the
    units are ranked and the refit is fitted on every calibration window, the held-back ones included. Unpinned, one
    choice per layer is recorded, from the grid, with the same widths."""
    torch.manual_seed(0)
    rel = to_relational(_llama())
    ids = torch.randint(0, 64, (8, 16))
    plain = {"refit_blend": 1.0} if correction == "dense" else {}  # the target itself, as the pinned choice below
    reference, ref_result = _compress(rel, ids, correction=correction, mlp_order=mlp_order, **plain)
    real = lowrank.choose_refit
    monkeypatch.setattr(lowrank, "choose_refit", lambda fit, held, **kw: real(fit, held, ridges=(1e-2,), blends=(1.0,), **kw))
    pinned, result = _compress(rel, ids, correction=correction, mlp_order=mlp_order, refit_holdout=3)
    assert [r["ridge"] for r in result.refits] == [1e-2, 1e-2] and not ref_result.refits
    for a, b in zip(reference.state_dict().values(), pinned.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(lowrank, "choose_refit", real)
    _, chosen = _compress(rel, ids, correction=correction, mlp_order=mlp_order, refit_holdout=3)
    assert chosen.widths == ref_result.widths and len(chosen.refits) == 2
    blends = REFIT_BLENDS if correction == "dense" else (1.0,)
    assert all(r["ridge"] in REFIT_RIDGES and r["blend"] in blends for r in chosen.refits)


def test_fixed_blend_interpolates_the_two_targets_refits_and_its_ends_are_the_two_corrections():
    """`refit_blend` b refits W_down to b x the dense trajectory's step + (1 - b) x the dense MLP's output: b = 0 is
    the local correction (whole models equal), the default is DEFAULT_REFIT_BLEND, and as the refit is linear in its
    target, the first layer's W_down (fitted on the same stream whatever b) is b W(1) + (1 - b) W(0). Widths never
    change."""
    torch.manual_seed(2)
    rel = to_relational(_llama())
    ids = torch.randint(0, 64, (8, 16))
    dense, r_dense = _compress(rel, ids, correction="dense", refit_blend=1.0)
    local, r_local = _compress(rel, ids, correction="local")
    half, r_half = _compress(rel, ids, correction="dense", refit_blend=0.25)
    pairs = [(local, _compress(rel, ids, correction="dense", refit_blend=0.0)[0])]
    pairs.append((_compress(rel, ids, correction="dense", refit_blend=DEFAULT_REFIT_BLEND)[0], _compress(rel, ids)[0]))
    assert r_dense.widths == r_local.widths == r_half.widths
    for reference, model in pairs:
        for a, b in zip(reference.state_dict().values(), model.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    down = [m.model.layers[0].mlp.down_proj.weight.detach() for m in (local, dense, half)]
    torch.testing.assert_close(down[2], 0.75 * down[0] + 0.25 * down[1], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(down[0], down[1], atol=1e-4)  # the two targets do differ here
    second = [m.model.layers[1].mlp.down_proj.weight.detach() for m in (local, dense, half)]
    assert not torch.allclose(second[2], 0.75 * second[0] + 0.25 * second[1], atol=1e-6)  # later layers: other streams


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"refit_blend": 1.5}, "refit_blend"),
        ({"refit_blend": -0.1}, "refit_blend"),
        ({"refit_blend": True}, "refit_blend"),
        ({"refit_blend": "0.5"}, "refit_blend"),
        ({"refit_blend": 0.5, "refit_holdout": 2}, "no `refit_holdout`"),
        ({"refit_blend": 1.0, "correction": "local"}, "needs correction 'dense'"),
        ({"refit_blend": 0.5, "correction": "none"}, "needs correction 'dense'"),
    ],
)
def test_bad_refit_blends_are_refused_in_one_line(options, match):
    model = _llama()
    ids = torch.randint(0, 64, (6, 16))
    with pytest.raises(ValueError, match=match):
        compress_model(model, None, remove=0.1, calibration=ids, **options)


def test_holdout_reaches_the_report_and_bad_values_are_refused():
    torch.manual_seed(1)
    model = _llama()
    ids = torch.randint(0, 64, (6, 16))
    _, report = compress_model(model, None, remove=0.1, calibration=ids, refit_holdout=2, plan_windows=4)
    assert len(report["refits"]) == 2 and report["options"]["refit_holdout"] == 2
    for bad, match in ((-1, ">= 0"), (True, ">= 0"), (1.5, ">= 0"), (6, "leave windows")):
        with pytest.raises(ValueError, match=match):
            compress_model(model, None, remove=0.1, calibration=ids, refit_holdout=bad)
    with pytest.raises(ValueError, match="needs correction"):
        compress_model(model, None, remove=0.1, calibration=ids, refit_holdout=2, correction="none")


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_cli_refit_holdout_is_recorded_and_bad_values_are_refused(tmp_path, capsys, stream, byte_llama_checkpoint):
    """`compress --refit-holdout N` records the refit chosen for every layer in the report, on both paths; a value
    that leaves no window to fit on (too few windows asked, or too short a text for them), no refit to choose, or
    another method is refused in one line naming the flag, and OUT is not written."""
    src = byte_llama_checkpoint
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    base = ["compress", str(src), str(tmp_path / "out"), "--remove", "0.1", "--calibration", str(text),
            "--window", "32", "--calibration-windows", "4", stream]  # fmt: skip
    assert main([*base, "--refit-holdout", "1"]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "compression_report.json").read_text())
    assert len(report["refits"]) == 2 and report["options"]["refit_holdout"] == 1
    short = tmp_path / "short.txt"
    short.write_text("the quick brown fox jumps over the lazy dog. " * 2)  # about 2 windows of 32 bytes
    for n, extra in ((4, []), (1, ["--correction", "none"]), (1, ["--method", "slice"])):
        out = tmp_path / f"bad{n}{len(extra)}"
        assert main([*base[:2], str(out), *base[3:], "--refit-holdout", str(n), *extra]) == 2
        err = capsys.readouterr().err
        assert "--refit-holdout" in err and "Traceback" not in err and not out.exists()
    out = tmp_path / "short_out"
    args = ["compress", str(src), str(out), "--remove", "0.1", "--calibration", str(short), "--window", "32",
            "--calibration-windows", "4", "--refit-holdout", "3", stream]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--refit-holdout 3 must leave calibration windows to fit on: --calibration holds only" in err
    assert "Traceback" not in err and not out.exists()


def test_cli_refit_blend_reaches_the_options_and_bad_combinations_are_refused(tmp_path, capsys, byte_llama_checkpoint):
    """`compress --refit-blend B` reaches the compression's options (recorded in the report); a value outside [0, 1],
    or a blend where no blended refit happens (another correction, a held-back choice, the slice method), is refused
    in one line naming the flag, and OUT is not written."""
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    base = ["compress", str(byte_llama_checkpoint), "--remove", "0.1", "--calibration", str(text), "--window", "32",
            "--calibration-windows", "4", "--no-stream"]  # fmt: skip
    assert main([*base[:2], str(tmp_path / "out"), *base[2:], "--refit-blend", "0.25"]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "compression_report.json").read_text())
    assert report["options"]["refit_blend"] == report["options"]["refit_target_blend"] == 0.25
    bad = (["1.5"], ["-0.5"], ["0.5", "--correction", "local"], ["0.5", "--refit-holdout", "1"],
           ["0.5", "--method", "slice"])  # fmt: skip
    for i, extra in enumerate(bad):
        out = tmp_path / f"bad{i}"
        assert main([*base[:2], str(out), *base[2:], "--refit-blend", *extra]) == 2
        err = capsys.readouterr().err
        assert "--refit-blend" in err and "Traceback" not in err and not out.exists()
