"""`benchmarks/embedding_rank.py`: the rank-r projections of the hidden space it puts under a tied embedding are what
it says they are, and the measurement changes only the embedding and restores it.

Properties: each projection is idempotent of rank r and the identity at full rank; "svd" has the least squares error
on E of all rank-r choices, "hidden" the least expected squared logit error under the covariance it is given;
`hidden_covariance` is the second moment of the vectors the head multiplies; `measure` at full rank gives every
domain the unchanged model's perplexity, a smaller rank changes it, and the weights are restored afterwards."""

from __future__ import annotations

import pytest
import torch
from conftest import benchmark_modules
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def embedding_rank():
    with benchmark_modules("embedding_rank") as (module,):
        yield module


def _spd(d: int, seed: int) -> torch.Tensor:
    a = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return a @ a.T / d + 0.05 * torch.eye(d, dtype=torch.float64)


def _logit_error(e: torch.Tensor, p: torch.Tensor, cov: torch.Tensor) -> float:
    """E ||h E^T - h (E P)^T||^2 for h with second moment cov."""
    diff = e - e @ p
    return float(torch.trace(diff @ cov @ diff.T))


@pytest.mark.parametrize("choice", ["svd", "hidden"])
def test_each_projection_is_idempotent_of_its_rank_and_the_identity_at_full_rank(embedding_rank, choice):
    e, cov = torch.randn(40, 12, dtype=torch.float64), _spd(12, 1)
    for rank in (3, 7):
        p = embedding_rank.projection(e, rank, choice, cov)
        assert torch.allclose(p @ p, p, atol=1e-9)
        assert int(torch.linalg.matrix_rank(p)) == rank
    assert torch.allclose(embedding_rank.projection(e, 12, choice, cov), torch.eye(12, dtype=torch.float64), atol=1e-8)


def test_svd_has_the_least_squares_error_and_hidden_the_least_logit_error(embedding_rank):
    g = torch.Generator().manual_seed(4)
    e = torch.randn(60, 10, generator=g, dtype=torch.float64) * torch.linspace(2, 0.2, 10, dtype=torch.float64)
    cov = _spd(10, 2)
    rank = 5
    svd = embedding_rank.projection(e, rank, "svd", cov)
    hidden = embedding_rank.projection(e, rank, "hidden", cov)
    others = []
    for _ in range(20):  # random rank-5 projections, orthogonal and oblique
        q = torch.linalg.qr(torch.randn(10, rank, generator=g, dtype=torch.float64)).Q
        b = torch.randn(10, rank, generator=g, dtype=torch.float64)
        others += [q @ q.T, b @ torch.linalg.pinv(q.T @ b) @ q.T]
    for p in [hidden, *others]:
        assert torch.linalg.norm(e - e @ svd) <= torch.linalg.norm(e - e @ p) + 1e-9
    for p in [svd, *others]:
        assert _logit_error(e, hidden, cov) <= _logit_error(e, p, cov) + 1e-9
    assert _logit_error(e, hidden, cov) < _logit_error(e, svd, cov)  # the choices differ for a non-isotropic cov


def test_bad_ranks_and_choices_are_refused(embedding_rank):
    e = torch.randn(20, 6)
    for rank in (0, 7, 2.5):
        with pytest.raises(ValueError, match="rank must be an integer"):
            embedding_rank.projection(e, rank, "svd")
    with pytest.raises(ValueError, match="unknown choice"):
        embedding_rank.projection(e, 3, "pca")
    with pytest.raises(ValueError, match="covariance"):
        embedding_rank.projection(e, 3, "hidden")
    assert embedding_rank.factorised_parameters(100, 8, 8) == 800  # full rank keeps the dense matrix
    assert embedding_rank.factorised_parameters(100, 8, 4) == 100 * 4 + 4 * 8


def _tiny_tied() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_hidden_covariance_is_the_second_moment_of_what_the_head_multiplies(embedding_rank):
    model = _tiny_tied()
    windows = torch.randint(0, 50, (5, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = model.model(input_ids=windows).last_hidden_state.reshape(-1, 16).double()
    got = embedding_rank.hidden_covariance(model, windows, batch_size=2)
    assert torch.allclose(got, h.T @ h / h.shape[0], atol=1e-6)


def test_measure_is_exact_at_full_rank_changes_the_model_below_and_restores_it(embedding_rank):
    model = _tiny_tied()
    g = torch.Generator().manual_seed(2)
    texts = {"a": torch.randint(0, 50, (3, 12), generator=g), "b": torch.randint(0, 50, (3, 12), generator=g)}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = embedding_rank.measure(model, texts, [16, 6], torch.randint(0, 50, (4, 12), generator=g))
    for choice in ("svd", "hidden"):
        full, low = result["cells"][f"{choice}@16"], result["cells"][f"{choice}@6"]
        assert all(abs(full["ratio"][k] - 1) < 1e-5 for k in texts)
        assert full["saved_share"] == 0 and low["saved_share"] > 0
        assert all(abs(low["ratio"][k] - 1) > 1e-4 for k in texts)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_untied_head_is_refused(embedding_rank):
    model = _tiny_tied()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(SystemExit, match="untied"):
        embedding_rank.measure(model, {"a": torch.randint(0, 50, (2, 8))}, [4], torch.randint(0, 50, (2, 8)))


def test_a_compressed_checkpoint_is_measured_against_its_source(tmp_path, embedding_rank):
    """With the source's figures (as `--model` reads them from the compression report), each cell also holds its
    ratios to the source and the share removed in all: the compression's and the factorisation's; both kinds of
    payload plot."""
    import json

    model = _tiny_tied()
    g = torch.Generator().manual_seed(5)
    texts = {d: torch.randint(0, 50, (2, 10), generator=g) for d in ("wikitext", "shakespeare", "python", "chat", "prose")}
    from relational_hf.compress.eval import perplexity_on_windows, stored_parameters

    own = {d: perplexity_on_windows(model, ids) for d, ids in texts.items()}
    total = stored_parameters(model)["total"]
    source = {"perplexity": {d: 2 * p for d, p in own.items()}, "stored_parameters": 2 * total}
    result = embedding_rank.measure(model, texts, [16, 8], texts["wikitext"], source, ("hidden",))
    full, low = result["cells"]["hidden@16"], result["cells"]["hidden@8"]
    assert set(result["cells"]) == {"hidden@16", "hidden@8"}
    assert all(abs(full["ratio_to_source"][d] - 0.5) < 1e-5 for d in texts)
    assert full["removed_share_total"] == 0.5  # the source stored twice as many
    saved = 50 * 16 - (50 * 8 + 8 * 16)
    assert low["saved_share"] == saved / (2 * total)
    assert abs(low["removed_share_total"] - (1 - (total - saved) / (2 * total))) < 1e-12
    embedding_rank.plot({"protocol": {"model": "tiny; compressed"}, **result}, tmp_path / "compressed.png")
    dense = embedding_rank.measure(model, texts, [8], texts["wikitext"])
    embedding_rank.plot({"protocol": {"model": "tiny; dense"}, **dense}, tmp_path / "dense.png")
    assert (tmp_path / "compressed.png").stat().st_size > 0 and (tmp_path / "dense.png").stat().st_size > 0
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with pytest.raises(SystemExit, match="no compression_report.json"):
        embedding_rank.source_figures(folder)
    rows = {f"{d}.pt": {"perplexity_before": 3.0, "perplexity_after": 4.0} for d in texts}
    (folder / "compression_report.json").write_text(json.dumps({"eval": {"texts": rows}, "parameters_before": 99}))
    assert embedding_rank.source_figures(folder) == {"perplexity": dict.fromkeys(texts, 3.0), "stored_parameters": 99}
    del rows["chat.pt"]
    (folder / "compression_report.json").write_text(json.dumps({"eval": {"texts": rows}, "parameters_before": 99}))
    with pytest.raises(SystemExit, match="chat"):
        embedding_rank.source_figures(folder)
