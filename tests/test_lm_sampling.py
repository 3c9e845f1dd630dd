"""`lm.sampling.sample_categorical`: draws follow the given distribution, zero entries are never drawn, a seed
reproduces the draws, and bad distributions are one-line errors."""

from __future__ import annotations

import pytest
import torch

from relational_hf.lm.sampling import sample_categorical


def test_draws_follow_the_distribution_of_each_row():
    """Over 40,000 draws per row the frequencies match each row's probabilities (unnormalised weights allowed) within
    five standard errors, rows independent of one another."""
    torch.manual_seed(0)
    weights = torch.rand(3, 7) ** 3 * 5.0  # skewed, not normalised
    n = 40_000
    generator = torch.Generator().manual_seed(1)
    draws = sample_categorical(weights.repeat(n, 1), generator).view(n, 3)
    for row in range(3):
        p = weights[row].double() / weights[row].double().sum()
        freq = torch.bincount(draws[:, row], minlength=7).double() / n
        tolerance = 5 * (p * (1 - p) / n).sqrt() + 1e-4
        assert ((freq - p).abs() <= tolerance).all(), (row, freq, p)


def test_zero_entries_are_never_drawn_and_shapes_are_kept(monkeypatch):
    """Entries of zero (first, middle and last: where the inverse CDF's edges lie) are never drawn, also when every
    uniform number is at either end of its range; the result has probs' leading shape."""
    probs = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.7, 0.0]).expand(2, 500, 6)
    draws = sample_categorical(probs, torch.Generator().manual_seed(0))
    assert draws.shape == (2, 500) and draws.dtype == torch.long
    assert set(draws.unique().tolist()) == {1, 4}

    # uniform numbers at the ends of their range [0, 1): the first and the last positive entry, not a zero beside it
    for u, expected in ((0.0, 1), (1.0 - 2.0**-53, 2)):
        monkeypatch.setattr(torch, "rand", lambda *shape, u=u, **kw: torch.full(shape, u, dtype=kw["dtype"]))
        for total in (1.0, 3.0, 1.0 + 2.0**-51, 0.7):
            draw = sample_categorical(torch.tensor([[0.0, 0.25, total - 0.25, 0.0, 0.0]], dtype=torch.float64))
            assert int(draw) == expected, (u, total)


def test_a_seed_reproduces_the_draws():
    """The same generator seed gives the same draws; another seed other draws."""
    probs = torch.softmax(torch.randn(64, 1000), -1)
    a = sample_categorical(probs, torch.Generator().manual_seed(5))
    b = sample_categorical(probs, torch.Generator().manual_seed(5))
    c = sample_categorical(probs, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "probs",
    [torch.zeros(2, 4), torch.tensor([[0.5, -0.1, 0.6]]), torch.tensor([[float("nan"), 1.0]]), torch.ones(3, 0)],
)
def test_bad_distributions_are_one_line_errors(probs):
    with pytest.raises(ValueError, match="probs"):
        sample_categorical(probs)
