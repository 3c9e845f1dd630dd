"""Training: data and tokenizers, the main pre-training job, metrics, and the relational Trainer."""

from .arguments import RelationalTrainingArguments
from .data import byte_level_tokenizer, generate_corpus, load_texts, train_bpe_tokenizer
from .metrics import perplexity, token_nll
from .suppression import ParallelSuppression, parallel_energy
from .trainer import RelationalTrainer

__all__ = [
    "ParallelSuppression",
    "RelationalTrainer",
    "RelationalTrainingArguments",
    "byte_level_tokenizer",
    "generate_corpus",
    "load_texts",
    "parallel_energy",
    "train_bpe_tokenizer",
    "perplexity",
    "token_nll",
]
