"""Quality benchmark, setup: the sizes, contenders, budgets and optimiser settings compared, the corpora, and the
models (configs, signatures, parameter counts)."""

from __future__ import annotations

import hashlib
import json

import common
import torch

# ---------------------------------------------------------------------------------------------------------------
# What is compared
# ---------------------------------------------------------------------------------------------------------------


def _dims(width: int, layers: int, heads: int, kv_heads: int, mlp: int) -> dict:
    return dict(
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
    )


#: The Llama families: width, depth, heads, MLP ratio and GQA all vary. head_dim is a multiple of 8 so that
#: qk_rank = head_dim/4 stays even (rotary pairs). "d128" is nanoGPT's CPU shakespeare_char size (4 layers, 4 heads,
#: d=128) with a SwiGLU of width 3d. It is in the --long family only: at the default budget it is past the point where
#: more parameters help (measured on Tiny Shakespeare at 600 steps: d128 1.989 ± 0.020 against d96 1.933 ± 0.012
#: nats), and it would cost half the default's time. Stored parameters span ~11x (default) and ~15x (long) on Tiny
#: Shakespeare (the exact counts depend on the vocabulary).
#: _dims(width, layers, heads, kv heads, SwiGLU width)
SIZES = {
    "d32": _dims(32, 2, 2, 2, 96),
    "d48": _dims(48, 2, 2, 2, 128),
    "d64": _dims(64, 2, 4, 4, 192),
    "d96": _dims(96, 3, 4, 2, 256),
    "d128": _dims(128, 4, 4, 4, 384),
}
DEFAULT_SIZES = {k: SIZES[k] for k in ("d32", "d48", "d64", "d96")}
LONG_SIZES = {k: SIZES[k] for k in ("d48", "d64", "d96", "d128")}
QUICK_SIZES = {"q16": _dims(16, 1, 2, 2, 48), "q32": _dims(32, 1, 2, 2, 96)}

#: Contenders, in the order they run (a run cut short by --max-minutes keeps the first ones whole): name ->
#: (description, RelationalConfig overrides). qk_rank=k means head_dim / k; "half" kv heads means
#: min(the size's kv heads, H / 2).
CONTENDERS = {
    "llama": ("Transformers LlamaForCausalLM (RMSNorm gains, tied embeddings)", None),
    "relational_pivot": ("relational, pivot gauge, RoPE", dict(gauge="pivot")),
    "relational_pivot_vpr": (
        "relational, pivot gauge, value-space parallel removal (VO left free)",
        dict(gauge="pivot", value_parallel_removal=True),
    ),
    "relational_thin2_gqa_vpr": (
        "combination: pivot gauge, qk_rank = head_dim/2, GQA (H/2 kv heads), value-space parallel removal",
        dict(gauge="pivot", qk_rank=2, num_key_value_heads="half", value_parallel_removal=True),
    ),
    "relational_thin2_gqa": (
        "relational, pivot gauge, qk_rank = head_dim/2, GQA (H/2 kv heads)",
        dict(gauge="pivot", qk_rank=2, num_key_value_heads="half"),
    ),
    "relational_thin4_gqa": (
        "relational, pivot gauge, qk_rank = head_dim/4, GQA (H/2 kv heads)",
        dict(gauge="pivot", qk_rank=4, num_key_value_heads="half"),
    ),
    "relational_free_projected": (
        "relational, free gauge, AdamW wrapped in relational_hf.symmetry.ProjectedOptimizer (horizontal updates)",
        dict(gauge="free"),
    ),
    "relational_free": ("control: relational, free gauge, plain AdamW (not in the default grid)", dict(gauge="free")),
    "relational_free_vpr": (
        "control: relational, free gauge, plain AdamW, value-space parallel removal (not in the default grid)",
        dict(gauge="free", value_parallel_removal=True),
    ),
    "relational_pivot_c1": (
        "control: relational, pivot gauge at the first default pivot value c = initializer_range (now 5x that), "
        "which leaves W_Q about ten times larger than W_K at initialisation (not in the default grid)",
        dict(gauge="pivot", pivot_scale="initializer_range"),
    ),
    "llama_fixed_gains": (
        "control: Llama with every RMSNorm gain frozen at 1, like the relational model's gain-free norms (not in the "
        "default grid; its frozen gains are still counted)",
        None,
    ),
}
CONTROLS = {"relational_free", "relational_free_vpr", "relational_pivot_c1", "llama_fixed_gains"}
DEFAULT_CONTENDERS = [c for c in CONTENDERS if c not in CONTROLS]
PROJECTED = {"relational_free_projected"}

#: Budgets: optimizer steps per run (tokens = steps x batch x context), seeds, LR sweep, validation tokens.
BUDGETS = {
    "quick": dict(steps=50, seeds=2, sweep_lrs=[3e-3, 1e-2], eval_tokens=4096, sizes=QUICK_SIZES),
    "default": dict(
        steps=600, seeds=3, sweep_lrs=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2], eval_tokens=None, sizes=DEFAULT_SIZES
    ),
    "long": dict(steps=3000, seeds=3, sweep_lrs=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2], eval_tokens=None, sizes=LONG_SIZES),
}
#: nanoGPT's CPU shakespeare_char batch and context, used for both corpora.
BATCH_SIZE, CONTEXT = 12, 64
OPTIMIZER = dict(
    name="AdamW",
    betas=(0.9, 0.99),
    eps=1e-8,
    weight_decay=0.1,
    weight_decay_on="parameters with ndim >= 2 (matrices, embedding); none on vectors (norm gains, biases)",
    grad_clip_norm=1.0,
    warmup_fraction=0.05,
    min_lr_fraction=0.1,
    schedule="transformers get_cosine_with_min_lr_schedule_with_warmup: linear warmup from 0 over warmup_fraction x "
    "steps, then cosine decay to min_lr_fraction x peak (the old hand-written schedule, in the stored JSON of runs "
    "made before it, started warmup at peak/warmup steps and reached the floor one step earlier)",
)
#: A relational point is "within seed noise" of the Llama curve when |difference| <= NOISE_SE standard errors of
#: the difference (rough: 3 seeds give a poor estimate of the spread).
NOISE_SE = 2.0
GOAL_RATIO = 1.3
WIKITEXT_BPE_VOCAB = 1024


# ---------------------------------------------------------------------------------------------------------------
# Corpora
# ---------------------------------------------------------------------------------------------------------------


def load_shakespeare() -> dict:
    """Tiny Shakespeare at character level: the project's byte-level tokenizer (the text is ASCII, so a byte is a
    character), ids compacted to the distinct characters of the whole text as nanoGPT does; 90/10 line split."""
    from relational_hf.lm.data import byte_level_tokenizer, encode, split_text

    path = common.SHARED_DATA / "tinyshakespeare" / "input.txt"
    text = path.read_text(encoding="utf-8")
    train_text, val_text = split_text(text, 0.1)
    tok = byte_level_tokenizer()
    train_bytes, val_bytes = encode(tok, train_text), encode(tok, val_text)
    alphabet = torch.unique(torch.cat([train_bytes, val_bytes]))
    lookup = torch.full((int(alphabet.max()) + 1,), -1, dtype=torch.long)
    lookup[alphabet] = torch.arange(alphabet.numel())
    return {
        "name": "shakespeare",
        "source": str(path.relative_to(common.SHARED_DATA.parent)),
        "tokenizer": "character level: byte_level_tokenizer ids compacted to the characters that occur",
        "split": "first 90% of the text (cut at a line boundary) trains, last 10% validates",
        "vocab_size": alphabet.numel(),
        "train_ids": lookup[train_bytes],
        "val_ids": lookup[val_bytes],
        "val_chars": len(val_text),
    }


def load_wikitext2() -> dict:
    """WikiText-2 validation text split by documents 90/10; BPE trained on the train documents only."""
    from relational_hf.lm.data import encode, train_bpe_tokenizer, wikitext_documents

    path = common.SHARED_DATA / "wikitext-2" / "valid.txt"
    docs = wikitext_documents(path.read_text(encoding="utf-8"))
    cut = round(0.9 * len(docs))
    train_text, val_text = "".join(docs[:cut]), "".join(docs[cut:])
    tok = train_bpe_tokenizer(train_text.splitlines(), vocab_size=WIKITEXT_BPE_VOCAB)
    return {
        "name": "wikitext2",
        "source": str(path.relative_to(common.SHARED_DATA.parent)),
        "tokenizer": f"byte-level BPE (train_bpe_tokenizer, vocabulary {len(tok)}) trained on the train documents",
        "split": (
            f"WikiText-2 validation split (the train split is not available here) cut by documents at ' = Title = ' "
            f"headings: first {cut} of {len(docs)} documents train, last {len(docs) - cut} validate"
        ),
        "vocab_size": len(tok),
        "train_ids": encode(tok, train_text),
        "val_ids": encode(tok, val_text),
        "val_chars": len(val_text),
    }


CORPORA = {
    "shakespeare": ("tinyshakespeare/input.txt", load_shakespeare),
    "wikitext2": ("wikitext-2/valid.txt", load_wikitext2),
}


# ---------------------------------------------------------------------------------------------------------------
# Models and training
# ---------------------------------------------------------------------------------------------------------------


def model_config(contender: str, dims: dict, vocab_size: int):
    """The Transformers config of one contender at one size (Llama, or relational with the contender's options)."""
    from transformers import LlamaConfig

    from relational_hf import RelationalConfig

    base = dict(dims, vocab_size=vocab_size, max_position_embeddings=CONTEXT, tie_word_embeddings=True)
    overrides = CONTENDERS[contender][1]
    if overrides is None:
        return LlamaConfig(**base)
    over = dict(overrides)
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    if "qk_rank" in over:
        over["qk_rank"] = head_dim // over["qk_rank"]
    if over.get("num_key_value_heads") == "half":
        over["num_key_value_heads"] = min(dims["num_key_value_heads"], dims["num_attention_heads"] // 2)
    if over.get("pivot_scale") == "initializer_range":
        over["pivot_scale"] = RelationalConfig().initializer_range
    return RelationalConfig(**{**base, **over})


def model_signature(contender: str, dims: dict, vocab_size: int) -> str:
    """A short hash of the contender's full model config at this size: --resume reuses a run only when it matches,
    so runs made before a change to the architecture's defaults are trained again."""
    config = model_config(contender, dims, vocab_size).to_dict()
    for key in ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"):
        config.pop(key, None)
    if config.get("gauge") == "free":
        config.pop("pivot_scale", None)  # unused by the free gauge
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha1(f"{contender}:{text}".encode()).hexdigest()[:12]


def build_model(contender: str, dims: dict, vocab_size: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from relational_hf import RelationalForCausalLM

    config = model_config(contender, dims, vocab_size)
    model = LlamaForCausalLM(config) if CONTENDERS[contender][1] is None else RelationalForCausalLM(config)
    model.set_attn_implementation("sdpa")
    if contender == "llama_fixed_gains":
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.requires_grad_(False)
    return model


def formula_parameters(contender: str, config) -> int:
    """The closed-form count of relational_hf.params (a check that the stored count is the documented one)."""
    from relational_hf import RelationalConfig
    from relational_hf.params import llama_parameter_count, relational_parameter_count

    if CONTENDERS[contender][1] is None:
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        same = RelationalConfig(
            **{k: getattr(config, k) for k in keys},
            num_key_value_heads=config.num_key_value_heads,
            tie_word_embeddings=config.tie_word_embeddings,
        )
        return llama_parameter_count(same)
    return relational_parameter_count(config)


def projected_optimizer_status() -> str | None:
    """None when relational_hf.symmetry.ProjectedOptimizer can be imported and steps a free-gauge model; otherwise
    the reason the projected contender is skipped."""
    try:
        from relational_hf.symmetry import ProjectedOptimizer
    except Exception as err:  # missing module or name, or an import-time failure inside it
        return f"relational_hf.symmetry.ProjectedOptimizer is not available ({type(err).__name__}: {err})"
    try:
        model = build_model("relational_free_projected", QUICK_SIZES["q16"], 16)
        opt = ProjectedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
        ids = torch.randint(0, 16, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    except Exception as err:
        return f"relational_hf.symmetry.ProjectedOptimizer failed a trial step ({type(err).__name__}: {err})"
    return None
