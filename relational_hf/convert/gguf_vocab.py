"""A Transformers byte-level BPE tokenizer as GGUF vocabulary metadata (llama.cpp's `gpt2` tokenizer model).

`gguf_vocabulary(tokenizer, vocab_size)` returns the values of the `tokenizer.ggml.*` keys: the token strings in id
order (in the byte-to-unicode alphabet the tokenizer stores them in), their types (normal; control for special
tokens; user-defined for other added tokens; unused for embedding rows past the tokenizer), the merges as "left
right" strings by rank, the pre-tokenizer llama.cpp must apply, the special ids, whether a BOS/EOS is added, and the
chat template. Two tokenizer kinds have an exact llama.cpp form and are taken:

- GPT-2-style byte-level BPE (SmolLM2's): a `ByteLevel` pre-tokenizer with the GPT-2 split (llama.cpp pre `gpt-2`),
  or individual digits split off first (`Digits` then `ByteLevel`: llama.cpp pre `smollm`);
- the byte-level tokenizer of `relational-hf train` (`relational_hf.lm.data.byte_level_tokenizer`): one token per
  byte and no merges, so no split of the text changes its ids (pre `smollm`: llama.cpp's `gpt-2` would also remove
  the space before "'s", "'ve" ... when it turns ids back into text, which Transformers does not do for this
  tokenizer; `smollm` does not). GGUF cannot store an empty array and
  llama.cpp needs the merges key, so one merge that can never apply is written: its left part is two symbols long,
  which only an earlier merge could make.

Anything else (a normaliser, a prefix space, another model or split) is refused in one line (`GGUFExportError`):
llama.cpp would tokenize differently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .gguf_layout import GGUFExportError

#: llama.cpp token types (`llama_token_type`)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: the merge written for a tokenizer without merges: two symbols on the left, so it never applies
NEVER_MERGE = "\u0120\u0120 \u0120"


@dataclass
class GGUFVocabulary:
    """The `tokenizer.ggml.*` values of one tokenizer (see the module docstring)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    notes: list[str] = field(default_factory=list)

    def write(self, writer) -> None:
        """Add the metadata to a `gguf.GGUFWriter`."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        adders = {
            "bos": writer.add_bos_token_id,
            "eos": writer.add_eos_token_id,
            "unk": writer.add_unk_token_id,
            "pad": writer.add_pad_token_id,
        }
        for name, value in self.special_ids.items():
            adders[name](value)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)


def _pre_tokenizer(spec: dict | None, has_merges: bool) -> str:
    """llama.cpp's pre-tokenizer name for a tokenizers `pre_tokenizer` spec (GGUFExportError when none matches)."""

    def byte_level(p: dict) -> bool:
        if p.get("type") != "ByteLevel":
            return False
        if p.get("add_prefix_space"):
            raise GGUFExportError(
                "the tokenizer's ByteLevel pre-tokenizer adds a prefix space, which llama.cpp's gpt2 tokenizer does not"
            )
        return True

    if spec is not None and byte_level(spec):
        if spec.get("use_regex", True) or not has_merges:
            return "gpt-2"
    if spec is not None and spec.get("type") == "Sequence":
        parts = spec.get("pretokenizers") or []
        if (
            len(parts) == 2
            and parts[0].get("type") == "Digits"
            and parts[0].get("individual_digits")
            and byte_level(parts[1])
            and parts[1].get("use_regex", True)
        ):
            return "smollm"
    raise GGUFExportError(
        f"the tokenizer's pre-tokenizer {json.dumps(spec)[:120]} has no llama.cpp equivalent (GGUF export takes "
        "GPT-2-style byte-level BPE tokenizers and the byte-level tokenizer of `relational-hf train`)"
    )


def _merges(raw: list) -> list[str]:
    out = []
    for m in raw:
        out.append(m if isinstance(m, str) else f"{m[0]} {m[1]}")
    return out


def _adds(tokenizer, token_id: int | None, first: bool) -> bool:
    """Whether the tokenizer puts `token_id` at the start (first) or end of an encoded text by itself."""
    if token_id is None:
        return False
    plain = tokenizer("a b", add_special_tokens=False)["input_ids"]
    full = tokenizer("a b")["input_ids"]
    if len(full) <= len(plain):
        return False
    return (full[0] if first else full[-1]) == token_id


def gguf_vocabulary(tokenizer, vocab_size: int) -> GGUFVocabulary:
    """The GGUF vocabulary of a Transformers fast tokenizer for a model with `vocab_size` embedding rows (rows past
    the tokenizer's tokens become unused placeholder tokens). `GGUFExportError` in one line when llama.cpp's `gpt2`
    tokenizer would tokenize differently (module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError(
            f"the tokenizer ({type(tokenizer).__name__}) is not a fast tokenizer: GGUF export needs its tokenizer.json"
        )
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFExportError(f"the tokenizer's model is {model.get('type')!r}, not byte-level BPE: no GGUF vocabulary")
    if spec.get("normalizer") is not None:
        raise GGUFExportError(
            f"the tokenizer has a normalizer ({spec['normalizer'].get('type')}), which llama.cpp's gpt2 tokenizer "
            "does not apply"
        )
    merges = _merges(model.get("merges") or [])
    pre = _pre_tokenizer(spec.get("pre_tokenizer"), bool(merges))
    cleans = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    if pre == "gpt-2" and not merges:
        pre = "smollm"  # one token a byte: any split gives the same ids, and smollm's detokenizer cleans no spaces
    vocab = dict(model.get("vocab") or {})
    added = {t["id"]: t for t in spec.get("added_tokens") or []}
    size = max([vocab_size, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
    if size > vocab_size:
        raise GGUFExportError(f"the tokenizer has {size} token ids, the model's vocab_size is {vocab_size}")
    tokens: list[str | None] = [None] * vocab_size
    types = [NORMAL] * vocab_size
    for text, i in vocab.items():
        tokens[i] = text
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = CONTROL if t.get("special") else USER_DEFINED
    unused = 0
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
            unused += 1
    special = {}
    for name in ("bos", "eos", "unk", "pad"):
        value = getattr(tokenizer, f"{name}_token_id", None)
        if isinstance(value, int):
            special[name] = value
    template = getattr(tokenizer, "chat_template", None)
    out = GGUFVocabulary(
        tokens=tokens,
        token_types=types,
        merges=merges or [NEVER_MERGE],
        pre=pre,
        special_ids=special,
        add_bos=_adds(tokenizer, special.get("bos"), True),
        add_eos=_adds(tokenizer, special.get("eos"), False),
        chat_template=template if isinstance(template, str) else None,
    )
    if pre == "gpt-2" and not cleans:
        out.notes.append(
            "llama.cpp's gpt-2 detokenizer removes the space before \"'s\", \"'ve\" ... where this tokenizer keeps it "
            "(clean_up_tokenization_spaces=False); the token ids are the same"
        )
    if unused:
        out.notes.append(f"{unused} embedding rows past the tokenizer's tokens written as unused tokens [PADi]")
    return out


__all__ = ["GGUFVocabulary", "gguf_vocabulary"]
