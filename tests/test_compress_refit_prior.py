"""The refit of W_down pulled towards the kept units' own weights instead of zero (`LowRankOptions.refit_prior`,
`compress.truncation.mlp_refit(prior=...)`)."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf.commands.main import main
from relational_hf.compress import LowRankOptions, compress_relational
from relational_hf.compress.truncation import REFIT_BLENDS, REFIT_RIDGES, choose_refit, mlp_refit
from relational_hf.convert import to_relational


def _data(seed: int, tokens: int = 40, k: int = 10, d: int = 6):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, k, generator=g, dtype=torch.float64)
    w0 = torch.randn(d, k, generator=g, dtype=torch.float64)
    return z, w0


def test_a_target_the_prior_explains_exactly_is_refitted_to_the_prior_at_every_ridge():
    """Y = Z W_0^T: the ridge towards W_0 costs nothing, so the refit returns W_0 whatever the ridge, while the plain
    ridge (towards zero) shrinks it, the more the larger the ridge."""
    z, w0 = _data(0)
    gram, cross = z.T @ z, z.T @ (z @ w0.T)
    for ridge in (1e-3, 1e-1, 10.0):
        assert torch.allclose(mlp_refit(gram.clone(), cross, None, ridge, prior=w0), w0, atol=1e-10)
    shrunk = [mlp_refit(gram.clone(), cross, None, ridge).norm() for ridge in (1e-3, 1e-1, 10.0)]
    assert shrunk[0] > shrunk[1] > shrunk[2] and float(shrunk[2]) < 0.5 * float(w0.norm())


def test_the_refit_moves_from_the_least_squares_fit_to_the_prior_as_the_ridge_grows():
    """A target the prior does not explain: a vanishing ridge gives the least-squares fit, a huge one the prior, and
    the solution satisfies the normal equations (G + s I) W^T = C + s W_0^T with s = ridge x mean diag(G)."""
    z, w0 = _data(1)
    y = torch.randn(z.shape[0], w0.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    gram, cross = z.T @ z, z.T @ y
    lstsq = torch.linalg.lstsq(z, y).solution.T
    assert torch.allclose(mlp_refit(gram.clone(), cross, None, 1e-12, prior=w0), lstsq, atol=1e-8)
    assert torch.allclose(mlp_refit(gram.clone(), cross, None, 1e9, prior=w0), w0, atol=1e-6)
    ridge = 0.3
    w = mlp_refit(gram.clone(), cross, None, ridge, prior=w0)
    s = ridge * float(torch.diagonal(gram).mean())
    assert torch.allclose((gram + s * torch.eye(gram.shape[0], dtype=gram.dtype)) @ w.T, cross + s * w0.T, atol=1e-9)


def test_the_prior_of_a_subset_of_units_is_read_through_keep():
    """With `keep`, the Gram and cross term are those of every unit and the prior that of the kept ones: the same
    refit as the kept units' own statistics."""
    z, w0 = _data(3, k=12)
    y = z[:, :7] @ torch.randn(7, 6, dtype=torch.float64)
    keep = torch.tensor([0, 2, 3, 5, 8, 11])
    gram, cross = z.T @ z, z.T @ y
    whole = mlp_refit(gram, cross, keep, 0.05, prior=w0[:, keep])
    own = mlp_refit((z[:, keep].T @ z[:, keep]).clone(), z[:, keep].T @ y, None, 0.05, prior=w0[:, keep])
    assert torch.allclose(whole, own, atol=1e-10)


def test_choose_refit_with_a_prior_minimises_the_held_back_residual_of_the_pulled_refits():
    """With a prior, the chosen (ridge, blend) is the grid point whose refit pulled towards it leaves the smallest
    residual on the held-back windows, computed from the data themselves."""
    g = torch.Generator().manual_seed(5)
    z, z_h = torch.randn(30, 8, generator=g, dtype=torch.float64), torch.randn(90, 8, generator=g, dtype=torch.float64)
    a = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = z @ a + torch.randn(30, 4, generator=g, dtype=torch.float64)
    y_h = z_h @ a + torch.randn(90, 4, generator=g, dtype=torch.float64)
    local, w0 = 0.5 * z @ a, a.T + 0.3 * torch.randn(4, 8, generator=g, dtype=torch.float64)
    chosen = choose_refit((z.T @ z, z.T @ y, z.T @ local), (z_h.T @ z_h, z_h.T @ y_h, float(y_h.pow(2).sum())), prior=w0)
    residuals = {}
    for ridge, b in itertools.product(REFIT_RIDGES, REFIT_BLENDS):
        w = mlp_refit((z.T @ z).clone(), z.T @ (b * y + (1 - b) * local), None, ridge, prior=w0)
        residuals[(ridge, b)] = float((z_h @ w.T - y_h).pow(2).sum())
    assert (chosen["ridge"], chosen["blend"]) == min(residuals, key=residuals.get)


def _llama_relational(seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return to_relational(LlamaForCausalLM(config)).eval()


def _unit_products(mlp) -> dict[tuple, torch.Tensor]:
    """Each SwiGLU unit's gate row (which no gauge moves) -> its W_down column times the norm of its W_up row (the
    product the scale gauge leaves invariant)."""
    w = {k: v.detach() for k, v in mlp.full_weights().items()}
    return {tuple(w["gate"][j].tolist()): w["down"][:, j] * w["up"][j].norm() for j in range(w["gate"].shape[0])}


@pytest.mark.parametrize("prior", ["dense", "zero"])
def test_a_huge_ridge_keeps_the_source_columns_with_the_prior_and_zeroes_them_without(prior):
    """Compressing a tiny Llama with a ridge that swamps the data: with the prior every kept unit keeps its own W_down
    column (the refit returns the prior), with the plain ridge the columns shrink to nothing."""
    rel = _llama_relational(0)
    ids = torch.randint(0, 64, (6, 16))
    budget = int(sum(p.numel() for p in rel.parameters()) * 0.75)
    out, _ = compress_relational(
        copy.deepcopy(rel), ids, budget, LowRankOptions(refit_prior=prior, ridge=1e9, kinds=("mlp",), mlp_step=16, min_mlp_units=16, refine_epochs=0), progress=False
    )
    for dense_layer, layer in zip(rel.model.layers, out.model.layers, strict=True):
        source, kept = _unit_products(dense_layer.mlp), _unit_products(layer.mlp)
        assert 0 < len(kept) < len(source)
        for gate, column in kept.items():
            if prior == "dense":
                torch.testing.assert_close(column, source[gate], rtol=1e-4, atol=1e-6)
            else:
                assert float(column.norm()) < 1e-3 * float(source[gate].norm())


def test_a_prior_of_the_wrong_shape_and_an_unknown_prior_are_refused():
    z, w0 = _data(4)
    with pytest.raises(ValueError, match="prior must be"):
        mlp_refit(z.T @ z, z.T @ z[:, :6], None, 1e-2, prior=w0.T)
    with pytest.raises(ValueError, match="refit_prior"):
        compress_relational(_llama_relational(1), torch.randint(0, 64, (2, 16)), 10_000, LowRankOptions(refit_prior="source"))


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_cli_refit_prior_reaches_the_compression_and_bad_combinations_are_refused(
    tmp_path, capsys, stream, byte_llama_checkpoint
):
    """`compress --refit-prior zero` reaches the compression on both paths (recorded in the report; the default is
    dense) and writes other MLP weights than the default; a prior where no refit happens (--correction none, the slice
    method) or an unknown one is refused in one line naming the flag, and OUT is not written."""
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    base = ["compress", str(byte_llama_checkpoint), "--remove", "0.1", "--calibration", str(text), "--window", "32",
            "--calibration-windows", "4", stream]  # fmt: skip
    weights, reports = {}, {}
    for prior in ("default", "zero"):
        out = tmp_path / prior
        extra = [] if prior == "default" else ["--refit-prior", prior]
        assert main([*base[:2], str(out), *base[2:], *extra]) == 0, capsys.readouterr().err
        reports[prior] = json.loads((out / "compression_report.json").read_text())
        weights[prior] = load_file(out / "model.safetensors")
    assert reports["default"]["options"]["refit_prior"] == "dense" and reports["zero"]["options"]["refit_prior"] == "zero"
    assert reports["default"]["widths"] == reports["zero"]["widths"]  # the plan does not depend on it
    downs = [k for k in weights["zero"] if "down_proj" in k]
    assert downs and any(not torch.equal(weights["zero"][k], weights["default"][k]) for k in downs)
    for i, extra in enumerate((["zero", "--correction", "none"], ["zero", "--method", "slice"], ["source"])):
        out = tmp_path / f"bad{i}"
        assert main([*base[:2], str(out), *base[2:], "--refit-prior", *extra]) == 2
        err = capsys.readouterr().err
        assert "--refit-prior" in err and "Traceback" not in err and not out.exists()
