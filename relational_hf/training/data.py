"""Old import path of the language-modelling data: the code lives in `relational_hf.lm.data` (below both
`training` and `directional`). Kept so that `relational_hf.training.data.<name>` keeps working."""

from ..lm.data import (  # noqa: F401  (re-exports)
    BOS,
    EOS,
    PAD,
    BlockDataset,
    RandomBlockDataset,
    byte_level_tokenizer,
    byte_to_unicode,
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
