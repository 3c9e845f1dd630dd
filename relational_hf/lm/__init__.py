"""Language-modelling data and metrics shared by training, analysis, conversion and the Hub cards.

- `data`: the built-in corpus, text and WikiText document splits, tokenizers, token blocks and block datasets;
- `metrics`: token NLL and perplexity of a causal LM, the next-token KL between two of them, the device to feed a
  model its inputs on (`model_device`).
- `sampling`: drawing tokens from a next-token distribution (`sample_categorical`, one uniform number a row);
- `offload`: Accelerate's big-model loading with disk offload, device-map summaries and peak memory.

The package sits below `compress`, `directional`, `convert`, `hub` and `training` and imports none of them (no Trainer,
no PEFT).
"""

from .data import (
    BlockDataset,
    RandomBlockDataset,
    byte_level_tokenizer,
    check_text_file,
    document_split,
    encode,
    generate_corpus,
    lm_blocks,
    load_texts,
    split_text,
    train_bpe_tokenizer,
    unigram_perplexity,
    wikitext_documents,
)
from .metrics import next_token_kl, perplexity, teacher_kl, token_nll
from .sampling import sample_categorical

__all__ = [
    "BlockDataset",
    "RandomBlockDataset",
    "byte_level_tokenizer",
    "check_text_file",
    "document_split",
    "encode",
    "generate_corpus",
    "lm_blocks",
    "load_texts",
    "next_token_kl",
    "perplexity",
    "sample_categorical",
    "split_text",
    "teacher_kl",
    "token_nll",
    "train_bpe_tokenizer",
    "unigram_perplexity",
    "wikitext_documents",
]
