"""Training: data and tokenizers, the main pre-training job, metrics, and the relational Trainer."""

from .data import byte_level_tokenizer, generate_corpus, load_texts, train_bpe_tokenizer
from .metrics import perplexity, token_nll

__all__ = [
    "byte_level_tokenizer",
    "generate_corpus",
    "load_texts",
    "train_bpe_tokenizer",
    "perplexity",
    "token_nll",
]
