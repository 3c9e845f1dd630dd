"""Old import path of the evaluation metrics: the code lives in `relational_hf.lm.metrics`. Kept so that
`relational_hf.training.metrics.perplexity` and `token_nll` keep working."""

from ..lm.metrics import perplexity, token_nll

__all__ = ["perplexity", "token_nll"]
