"""Training: the relational Trainer and its arguments, the pre-training and fine-tuning jobs, PEFT support and the
reference checkpoints.

The data, tokenizers and metrics live in `relational_hf.lm` and parallel suppression in
`relational_hf.directional.suppression`; the names below are re-exported for the old import paths.
"""

from ..directional.suppression import ParallelSuppression, parallel_energy
from ..lm.data import byte_level_tokenizer, generate_corpus, load_texts, train_bpe_tokenizer
from ..lm.metrics import perplexity, token_nll
from .arguments import RelationalTrainingArguments
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
