"""Text, tokenizers and language-modelling blocks for training and evaluation (below both `training` and
`directional`: the one home of the corpus, the tokenizers, the text splits and the block datasets).

The built-in default corpus is generated here (a small probabilistic grammar with consistent facts and arithmetic),
so the main job needs no download and carries no copied text.
"""

from __future__ import annotations

import codecs
import logging
import math
import os
import random
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import UsageError

logger = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
_TEXT_CHUNK = 1 << 20

# ---------------------------------------------------------------------------------------------------------------
# Text files
# ---------------------------------------------------------------------------------------------------------------


def check_text_file(path: str | os.PathLike, flag: str | None = None) -> Path:
    """Raise `UsageError` unless `path` is a readable, non-empty UTF-8 text file without NUL bytes; returns it.

    The whole file is decoded incrementally, so an invalid byte anywhere is found, with its offset."""
    path = Path(path)
    where = f"{flag} {path}" if flag else str(path)
    if not path.exists():
        raise UsageError(f"{where}: no such file or directory")
    if not path.is_file():
        raise UsageError(f"{where}: not a regular file")
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, empty = 0, True
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(_TEXT_CHUNK):
                empty = False
                nul = chunk.find(b"\0")
                if nul >= 0:
                    raise UsageError(
                        f"{where}: binary file (NUL byte at offset {offset + nul}); a UTF-8 text file is needed"
                    )
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    raise UsageError(
                        f"{where}: not valid UTF-8 (byte 0x{chunk[err.start]:02x} at offset {offset + err.start}); "
                        "convert it to UTF-8 text"
                    ) from None
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UsageError(
            f"{where}: not valid UTF-8 (truncated sequence at the end); convert it to UTF-8 text"
        ) from None
    except PermissionError:
        raise UsageError(f"{where}: permission denied") from None
    if empty:
        raise UsageError(f"{where}: the file is empty")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Built-in corpus
# ---------------------------------------------------------------------------------------------------------------

_NAMES = [
    "ada",
    "bruno",
    "chiara",
    "dmitri",
    "elena",
    "farid",
    "greta",
    "hiro",
    "ines",
    "jonas",
    "kemal",
    "lena",
    "marta",
    "nils",
    "olga",
    "pavel",
    "quinn",
    "rosa",
    "sami",
    "tomas",
    "ulla",
    "vera",
    "wim",
    "yara",
    "zeno",
]
_ANIMALS = ["cat", "dog", "fox", "owl", "crow", "goat", "horse", "otter", "mouse", "heron", "badger", "rabbit"]
_PLACES = ["river", "forest", "market", "harbour", "library", "garden", "station", "bridge", "valley", "tower"]
_COLOURS = ["red", "blue", "green", "yellow", "black", "white", "grey", "orange", "purple", "brown"]
_OBJECTS = ["lamp", "book", "key", "map", "coat", "boat", "bell", "cup", "kite", "drum", "rope", "clock"]
_VERBS = [
    ("sees", "saw"),
    ("finds", "found"),
    ("follows", "followed"),
    ("paints", "painted"),
    ("carries", "carried"),
    ("watches", "watched"),
    ("draws", "drew"),
    ("loses", "lost"),
]
_ADVERBS = ["quietly", "slowly", "often", "never", "always", "happily", "carefully", "early", "late"]
_NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]


def generate_corpus(num_sentences: int = 40000, seed: int = 1234) -> str:
    """A synthetic English-like corpus: sentences from a small grammar, facts that stay consistent across the text
    (each name has one home, pet and favourite colour), counting and two-digit addition. Deterministic in `seed`.

    The structure is learnable at character level (a small model gets far below the unigram perplexity), which
    makes it a useful smoke-test corpus; it is not natural language and says nothing about quality on real text."""
    rng = random.Random(seed)
    home = {n: rng.choice(_PLACES) for n in _NAMES}
    pet = {n: rng.choice(_ANIMALS) for n in _NAMES}
    colour = {n: rng.choice(_COLOURS) for n in _NAMES}
    lines = []
    for _ in range(num_sentences):
        kind = rng.random()
        a, b = rng.sample(_NAMES, 2)
        if kind < 0.25:
            present, past = rng.choice(_VERBS)
            obj = f"the {rng.choice(_COLOURS)} {rng.choice(_OBJECTS)}"
            verb = present if rng.random() < 0.5 else past
            lines.append(f"{a} {rng.choice(_ADVERBS)} {verb} {obj} near the {rng.choice(_PLACES)}.")
        elif kind < 0.45:
            fact = rng.randrange(3)
            if fact == 0:
                lines.append(f"{a} lives by the {home[a]}, and {b} lives by the {home[b]}.")
            elif fact == 1:
                lines.append(f"the {pet[a]} of {a} sleeps by the {home[a]}.")
            else:
                lines.append(f"{a} likes {colour[a]} things, so {a} has a {colour[a]} {rng.choice(_OBJECTS)}.")
        elif kind < 0.6:
            x, y = rng.randrange(10, 90), rng.randrange(10, 90)
            lines.append(f"{x} plus {y} is {x + y}.")
        elif kind < 0.75:
            start = rng.randrange(0, 9)
            seq = " ".join(_NUMBER_WORDS[start : start + rng.randrange(3, 5)])
            lines.append(f"{a} counts {seq}.")
        elif kind < 0.9:
            n = rng.randrange(2, 13)
            lines.append(
                f"{b} has {_NUMBER_WORDS[n]} {rng.choice(_OBJECTS)}s and gives one to {a}; "
                f"{b} keeps {_NUMBER_WORDS[n - 1]}."
            )
        else:
            lines.append(f"when the {pet[a]} of {a} sees the {pet[b]} of {b}, it runs to the {home[a]}.")
    return "\n".join(lines) + "\n"


def split_text(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """Split at a line boundary: the first (1 - val_fraction) of the text trains, the rest validates."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", cut)
    cut = newline + 1 if 0 <= newline < len(text) - 1 else cut
    return text[:cut], text[cut:]


#: A WikiText top-level heading line ` = Title = ` (not ` = = Section = = `).
_WIKITEXT_TITLE = re.compile(r"^ = [^=\n].* = \s*$", flags=re.MULTILINE)


def wikitext_documents(text: str) -> list[str]:
    """Split WikiText text into its articles at the top-level headings ` = Title = ` (section headings
    ` = = Section = = ` stay inside their article). Any text before the first heading stays with the first article;
    the pieces concatenate back to `text`."""
    starts = [m.start() for m in _WIKITEXT_TITLE.finditer(text)]
    bounds = [0, *starts[1:], len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def document_split(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """Split WikiText at the article boundary (`wikitext_documents`) closest to the (1 - val_fraction) mark of the
    characters: whole articles train, whole articles validate. Text with fewer than two articles falls back to
    `split_text` (a line boundary)."""
    docs = wikitext_documents(text)
    if len(docs) < 2:
        return split_text(text, val_fraction)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    offsets, position = [], 0
    for doc in docs[:-1]:
        position += len(doc)
        offsets.append(position)  # start of the next article
    mark = (1.0 - val_fraction) * len(text)
    cut = min(offsets, key=lambda s: abs(s - mark))
    return text[:cut], text[cut:]


def load_texts(
    train_file: str | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    text_column: str = "text",
    val_fraction: float = 0.1,
    num_sentences: int = 40000,
    seed: int = 1234,
) -> tuple[str, str, str]:
    """(train_text, val_text, source description) from a text file, a `datasets` name, or the built-in corpus.

    A dataset that cannot be loaded (offline, unknown name) raises a RuntimeError saying so, not a traceback from
    deep inside `datasets`; a missing, binary or non-UTF-8 `train_file` raises `UsageError` naming it."""
    if train_file and dataset:
        raise UsageError("give either --train-file or --dataset, not both")
    if train_file:
        path = check_text_file(train_file, "--train-file")  # exists, UTF-8, not binary: named errors
        text = path.read_text(encoding="utf-8")
        if len(text) < 1000:
            raise UsageError(
                f"--train-file {path} holds only {len(text)} characters; need at least 1000 to train and validate"
            )
        train, val = split_text(text, val_fraction)
        return train, val, f"file {path.name}"
    if dataset:
        train, val = _load_dataset_texts(dataset, dataset_config, text_column, val_fraction)
        return train, val, f"dataset {dataset}" + (f" ({dataset_config})" if dataset_config else "")
    train, val = split_text(generate_corpus(num_sentences, seed), val_fraction)
    return train, val, f"built-in generated corpus ({num_sentences} sentences, seed {seed})"


def _load_dataset_texts(name: str, config: str | None, column: str, val_fraction: float) -> tuple[str, str]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config)
    except Exception as err:  # offline, unknown name, missing config: all reported the same clear way
        raise RuntimeError(
            f"could not load dataset {name!r}{f' ({config})' if config else ''}: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}. Without network access use --train-file with a local "
            "text file, or a local dataset directory."
        ) from None
    if "train" not in ds:
        raise RuntimeError(f"dataset {name!r} has no 'train' split (splits: {list(ds)})")
    if column not in ds["train"].column_names:
        raise RuntimeError(f"dataset {name!r} has no column {column!r} (columns: {ds['train'].column_names})")
    train = "\n".join(t for t in ds["train"][column] if t)
    val_split = next((s for s in ("validation", "valid", "test") if s in ds), None)
    if val_split is None:
        return split_text(train, val_fraction)
    return train, "\n".join(t for t in ds[val_split][column] if t)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------


def byte_to_unicode() -> dict[int, str]:
    """A reversible map from the 256 byte values to printable unicode characters (the byte-level BPE alphabet):
    printable Latin-1 bytes map to themselves, the others to code points from 256 upwards in byte order."""
    keep = [b for b in range(256) if (33 <= b <= 126) or (161 <= b <= 172) or (174 <= b <= 255)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_level_tokenizer():
    """A byte-level tokenizer (ids 0-2: <pad>, <s>, </s>; id 3 + b: byte b) that needs no download and saves
    as a `tokenizer.json` that `AutoTokenizer` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for b, ch in byte_to_unicode().items():
        vocab[ch] = 3 + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer trained with the `tokenizers` library on `texts` (special tokens as above)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)


def encode(tokenizer, text: str, chunk_chars: int = 200_000) -> torch.Tensor:
    """Token ids of a long text as one 1-D long tensor (encoded in line-aligned chunks)."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        ids.extend(tokenizer(text[start:end], add_special_tokens=False)["input_ids"])
        start = end
    return torch.tensor(ids, dtype=torch.long)


def lm_blocks(ids: torch.Tensor, block_size: int, max_tokens: int | None = None) -> torch.Tensor:
    """Non-overlapping (N, block_size) blocks of a 1-D token stream, from at most `max_tokens` tokens (tail dropped)."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = ids.numel() // block_size
    if n == 0:
        raise ValueError(
            f"text of {ids.numel()} tokens is shorter than one block of {block_size} tokens (the sequence length: "
            "--block-size / --seq-len)"
        )
    return ids[: n * block_size].view(n, block_size)


class BlockDataset(torch.utils.data.Dataset):
    """Causal-LM examples {input_ids, labels} over fixed blocks (labels = inputs; the model shifts them)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class RandomBlockDataset(torch.utils.data.Dataset):
    """Random windows of a token stream (nanoGPT-style sampling), `length` examples, deterministic in `seed`."""

    def __init__(self, ids: torch.Tensor, block_size: int, length: int, seed: int = 0) -> None:
        if ids.numel() <= block_size:
            raise ValueError(f"text of {ids.numel()} tokens is shorter than one block of {block_size}")
        gen = torch.Generator().manual_seed(seed)
        self.ids, self.block_size = ids, block_size
        self.starts = torch.randint(0, ids.numel() - block_size, (length,), generator=gen)

    def __len__(self) -> int:
        return self.starts.numel()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = int(self.starts[i])
        block = self.ids[s : s + self.block_size]
        return {"input_ids": block, "labels": block}


def unigram_perplexity(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of the validation tokens under the training unigram distribution (add-one smoothing):
    exp(-mean log p(token)). The baseline a language model must beat."""
    counts = Counter(train_ids.tolist())
    total = train_ids.numel() + vocab_size
    nll = 0.0
    for tok, n in Counter(val_ids.tolist()).items():
        nll -= n * math.log((counts.get(tok, 0) + 1) / total)
    return math.exp(nll / max(1, val_ids.numel()))
