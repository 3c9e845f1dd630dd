"""Repair by distillation from the source model (DESIGN.md 2.2a): the text the source writes itself.

Healing a compressed model with the language-model loss on some text also adapts it to that text; the same healing
of the uncompressed model shows how much (on SmolLM2 and WikiText-2 most of the gain was adaptation). Distillation
asks only for the source's function back: the loss is the forward KL divergence KL(p_source || p_compressed) of the
next-token distributions at every position, on text the source model samples from its own distribution, so no
user text is needed and the same healing leaves the source itself where it is (its KL to itself is zero).

- `generate_teacher_text`: token ids (samples, length) sampled at temperature 1 (no top-k / top-p, no stop token:
  an end-of-turn token is sampled like any other and the text runs on) from a seeded generator, each row started
  from a generic prompt in the tokenizer's chat template (share `chat_share`, when the tokenizer has a template)
  or from one random vocabulary token. Deterministic in `seed` (and the batch size) on a given machine.
- `save_teacher_text` / `load_teacher_text`: the ids in a safetensors file with the settings and a fingerprint of the
  source model in its metadata, so a rerun reuses them (`compress` writes `heal_text.safetensors` into OUT).
- `healing_stream`: that text and the calibration windows in one stream, a given share of each (by default half
  and half: the source's text alone repaired its own kind of text and moved the model away from the calibration
  text's, which the compression had fitted).
The loss and its held-out measurement are `lm.metrics.next_token_kl` / `teacher_kl`, the training loop
`training.distillation.DistillationTrainer`; `training.heal.heal(..., loss="kd", teacher=...)` puts them together.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..lm.sampling import sample_categorical
from ..modeling.modeling_relational import weight_cache

#: How `generate_teacher_text` draws a token (`lm.sampling.sample_categorical`); recorded in the text's settings, so a
#: text drawn otherwise (before, `torch.multinomial`) is not taken for the same text.
SAMPLER = "inverse-cdf"

#: File name of the cached teacher text in a `compress` output folder.
TEACHER_TEXT_NAME = "heal_text.safetensors"
_FORMAT = "relational-hf teacher text v1"

#: Generic user requests for an instruction-tuned source (written for this project; none is about the evaluation
#: text). Each chat-seeded row starts from one of them, drawn at random.
GENERIC_PROMPTS: tuple[str, ...] = (
    "Tell me something interesting.",
    "Write a short story about a journey.",
    "Explain how something you know well works.",
    "What should I keep in mind when learning a new skill?",
    "Describe a place in detail.",
    "Write a letter to a friend.",
    "Give me some advice for a busy week.",
    "Explain a scientific idea to a beginner.",
    "Summarise the history of an invention.",
    "What are the pros and cons of working from home?",
    "Write a poem about the sea.",
    "How do I cook a simple dinner?",
    "Describe a famous person's life.",
    "Write a short Python function and explain it.",
    "What happened in an important historical event?",
    "Compare two sports.",
    "Write a news report about a local festival.",
    "Explain why the sky changes colour.",
    "Plan a trip for three days.",
    "What is a good way to save money?",
    "Describe an animal and where it lives.",
    "Write a dialogue between two characters.",
    "Explain a mathematical concept with an example.",
    "Tell me about a book you would recommend.",
)

#: Requests that seed the calibration text a source samples itself (`calibration.sampled_calibration`): spread over
#: the kinds of text a language model is asked for (source code in several languages, verse, dialogue and drama,
#: encyclopedic and technical prose, news, letters, lists, mathematics), so that the steps that fit the calibration
#: windows see each kind. Apart from `GENERIC_PROMPTS`, the healing's prompts and the benchmarks' chat domain, so
#: that the sampled chat text the benchmarks evaluate on is not what the compression was calibrated on. Written for
#: this project.
CALIBRATION_PROMPTS: tuple[str, ...] = (
    "Write a Python module with a class, a few methods and docstrings.",
    "Write a Python script that reads a file, parses it and prints a summary.",
    "Implement a sorting algorithm in Python with comments and tests.",
    "Write a JavaScript function that validates a form.",
    "Write a shell script that backs up a folder.",
    "Write a SQL query with a join and explain it.",
    "Write a C function that reverses a linked list.",
    "Show a configuration file for a web server and explain its settings.",
    "Write a sonnet about winter.",
    "Write a scene from a play in which two old friends argue.",
    "Write a ballad about a sailor, in rhyming verse.",
    "Write a conversation between a teacher and a student.",
    "Write an encyclopedia article about a river and the towns along it.",
    "Write an encyclopedia article about a medieval king.",
    "Describe the history of a city from its founding.",
    "Write the documentation of a command-line tool, with its options.",
    "Explain how a compiler works, step by step.",
    "Write a news article about an election result.",
    "Write a formal letter of complaint to a company.",
    "List the steps to repair a bicycle tyre.",
    "Solve an algebra problem and show every step.",
    "Prove that there are infinitely many prime numbers.",
    "Write a short fairy tale with a moral.",
    "Write a product review of a pair of headphones.",
)


# ---------------------------------------------------------------------------------------------------------------
# the teacher's own text
# ---------------------------------------------------------------------------------------------------------------


def _chat_prompts(tokenizer, prompts: tuple[str, ...] | None = None) -> list[list[int]]:
    """`prompts` (default `GENERIC_PROMPTS`) in the tokenizer's chat template, as token ids (empty when it has no
    template)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return []
    out = []
    for prompt in GENERIC_PROMPTS if prompts is None else prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append([int(i) for i in ids])
    return out


def _vocabulary_seeds(tokenizer, vocab_size: int, n: int, generator: torch.Generator) -> list[list[int]]:
    """n seeds of one random vocabulary token (special tokens excluded), after the tokenizer's own start tokens."""
    prefix: list[int] = []
    special: set[int] = set()
    if tokenizer is not None:
        prefix = [int(i) for i in tokenizer("", add_special_tokens=True)["input_ids"]]
        special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special])
    picks = allowed[torch.randint(0, allowed.numel(), (n,), generator=generator)]
    return [prefix + [int(p)] for p in picks]


@torch.no_grad()
def generate_teacher_text(
    model: nn.Module,
    tokenizer=None,
    *,
    samples: int = 256,
    length: int = 256,
    seed: int = 0,
    batch_size: int = 64,
    chat_share: float = 0.5,
    progress: bool = True,
    prompts: tuple[str, ...] | None = None,
) -> torch.Tensor:
    """Token ids (samples, length) sampled from `model`'s own next-token distribution at temperature 1.

    Rows start from a seed and run on for `length` tokens in all (seed included): a share `chat_share` of them from a
    request of `prompts` (default `GENERIC_PROMPTS`; drawn at random) in the tokenizer's chat template, the others from one random
    vocabulary token (all rows when there is no tokenizer or no chat template). Nothing stops a row early: an
    end-of-turn token is sampled like any other and the model writes on. Batched with left padding and a KV cache;
    one `torch.Generator` seeded with `seed` draws the seeds and the samples, so the result is reproducible."""
    from transformers import DynamicCache

    for name, value, low in (("samples", samples, 1), ("length", length, 2), ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}")
    if not 0.0 <= chat_share <= 1.0:
        raise ValueError(f"`chat_share` must be in [0, 1], got {chat_share}")
    if prompts is not None and (
        isinstance(prompts, str) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts)
    ):
        raise ValueError("`prompts` must be a non-empty sequence of non-empty strings")
    generator = torch.Generator().manual_seed(int(seed))
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    prompts = [p for p in _chat_prompts(tokenizer, prompts) if len(p) < length]  # type: ignore[assignment]
    n_chat = round(samples * chat_share) if prompts else 0
    seeds = [prompts[int(i)] for i in torch.randint(0, len(prompts), (n_chat,), generator=generator)] if n_chat else []
    seeds += _vocabulary_seeds(tokenizer, vocab_size, samples - n_chat, generator)
    order = sorted(range(samples), key=lambda i: len(seeds[i]))  # similar prompt lengths batched together
    rows: list[torch.Tensor | None] = [None] * samples
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    from tqdm.auto import tqdm

    bar = tqdm(total=samples * length, desc="sampling teacher text", unit="tok", disable=not progress)
    try:
        with weight_cache(model):
            for start in range(0, samples, batch_size):
                batch = order[start : start + batch_size]
                longest, shortest = max(len(seeds[i]) for i in batch), min(len(seeds[i]) for i in batch)
                ids = torch.zeros(len(batch), longest, dtype=torch.long)
                mask = torch.zeros(len(batch), longest, dtype=torch.long)
                for row, i in enumerate(batch):
                    ids[row, longest - len(seeds[i]) :] = torch.tensor(seeds[i])
                    mask[row, longest - len(seeds[i]) :] = 1
                new = length - shortest
                out = torch.empty(len(batch), new, dtype=torch.long)
                cache = DynamicCache(config=model.config)
                position = (mask.cumsum(-1) - 1).clamp_min(0)
                step_ids = ids
                for step in range(new):
                    logits = model(
                        input_ids=step_ids.to(device), attention_mask=mask.to(device), position_ids=position.to(device),
                        cache=cache, use_cache=True,
                    ).logits[:, -1].float().cpu()  # fmt: skip
                    probs = torch.softmax(logits, dim=-1)
                    token = sample_categorical(probs, generator).unsqueeze(-1)
                    out[:, step] = token[:, 0]
                    step_ids = token
                    mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=1)
                    position = position[:, -1:] + 1
                    bar.update(len(batch))
                for row, i in enumerate(batch):
                    full = torch.cat([ids[row, longest - len(seeds[i]) :], out[row]])
                    rows[i] = full[:length]
                bar.update(len(batch) * (length - new))
    finally:
        bar.close()
        model.train(was_training)
    return torch.stack(rows)  # type: ignore[arg-type]


#: Options of `teacher_text` that `jobs.compress_model` and the `compress` command take as heal_samples, heal_length, ...
TEXT_OPTIONS: tuple[str, ...] = ("samples", "length", "chat_share")
#: Their defaults (those of `teacher_text`).
TEXT_DEFAULTS: dict[str, Any] = {"samples": 256, "length": 256, "chat_share": 0.5}


def prompt_set_name(prompts: tuple[str, ...] | None) -> str:
    """The name a teacher text's settings give its prompt set: "generic", "calibration" or a digest of others (what a
    rerun compares before reusing a cached text)."""
    if prompts is None or tuple(prompts) == GENERIC_PROMPTS:
        return "generic"
    if tuple(prompts) == CALIBRATION_PROMPTS:
        return "calibration"
    import hashlib

    return "custom-" + hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:12]


def teacher_text(
    model: nn.Module,
    tokenizer=None,
    *,
    samples: int = 256,
    length: int = 256,
    seed: int = 0,
    chat_share: float = 0.5,
    batch_size: int = 64,
    progress: bool = True,
    prompts: tuple[str, ...] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """`generate_teacher_text` with its settings: returns (ids (samples, length), settings) where settings hold the
    arguments, the source's `model_fingerprint`, the token count and the seconds it took (what `save_teacher_text`
    stores and what a rerun compares before reusing the text)."""
    start = time.perf_counter()
    ids = generate_teacher_text(
        model, tokenizer, samples=samples, length=length, seed=seed, batch_size=batch_size, chat_share=chat_share,
        progress=progress, prompts=prompts,
    )  # fmt: skip
    settings = {
        "samples": samples,
        "length": length,
        "seed": seed,
        "chat_share": chat_share,
        "batch_size": batch_size,
        "temperature": 1.0,
        "sampler": SAMPLER,
        "prompts": prompt_set_name(prompts),
        "chat_template": any(len(p) < length for p in _chat_prompts(tokenizer, prompts)),  # prompts that fit in a row
        "source": model_fingerprint(model),
        "tokens": int(ids.numel()),
        "seconds": round(time.perf_counter() - start, 1),
    }
    return ids, settings


#: Default share of the distillation's blocks drawn from the calibration windows, the rest from the source's own
#: text. On SmolLM2 at 25% (the automatic choices; 200 steps at 3e-4; `benchmarks/results/heal_kd_auto_*.json`), the
#: source's text alone took held-out WikiText-2 from 50.85 to 51.42 and the KL to the source on its own unseen text
#: from 1.402 to 0.808 nats/token; the calibration side alone to 46.98 and 1.296; half and half to 48.44 and 0.844.
DEFAULT_CALIBRATION_SHARE = 0.5


def calibration_share(share: float | None, name: str = "the calibration share") -> float:
    """`share` checked to be a number in [0, 1] (ValueError naming `name` otherwise); None gives
    `DEFAULT_CALIBRATION_SHARE`."""
    if share is None:
        return DEFAULT_CALIBRATION_SHARE
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {share!r}")
    return float(share)


def healing_stream(
    text: torch.Tensor | None, calibration: torch.Tensor, share: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One stream of token ids (1, n) to distil on, with a `share` of its tokens from the calibration windows
    (N, T) and the rest from `text` (the source's own text, rows (S, L)). Nothing is dropped: the side that falls
    short of its share is repeated (whole, then a prefix) until the stream holds the two in that proportion, so a
    block drawn at random comes from the calibration windows with probability `share`. share 0: `text` alone;
    share 1: the calibration windows alone (`text` may then be None). Returns (ids, settings) with the share and
    each side's own token count."""
    if share is None:
        raise ValueError("the calibration share must be a number in [0, 1], got None")
    share = calibration_share(share)
    for name, ids in (("text", text), ("calibration", calibration)):
        if ids is not None and (not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or ids.numel() < 2):
            raise ValueError(f"`{name}` must be token ids (a LongTensor of at least 2 tokens)")
    if text is None and share < 1.0:
        raise ValueError("a calibration share below 1 needs the source's text")
    calib = calibration.reshape(-1)
    own = text.reshape(-1) if text is not None else calib[:0]
    if share == 0.0:
        stream = own
    elif share == 1.0:
        stream = calib
    else:
        if calib.numel() / (calib.numel() + own.numel()) < share:  # the calibration side is the short one
            own_n, calib_n = own.numel(), round(own.numel() * share / (1.0 - share))
        else:
            calib_n, own_n = calib.numel(), round(calib.numel() * (1.0 - share) / share)
        stream = torch.cat([_repeat_to(own, own_n), _repeat_to(calib, calib_n)])
    settings = {"calibration_share": float(share), "text_tokens": own.numel(), "calibration_tokens": calib.numel()}
    return stream.view(1, -1), settings


def _repeat_to(ids: torch.Tensor, n: int) -> torch.Tensor:
    """`ids` (n0,) repeated whole and then cut to n tokens (n >= n0)."""
    return ids.repeat(-(-n // ids.numel()))[:n]


def model_fingerprint(model: nn.Module) -> str:
    """A short digest of a model's function-defining identity: vocabulary size, layer count and the bytes of its
    input embedding (enough to tell one source checkpoint from another; not a hash of every weight)."""
    emb = model.get_input_embeddings().weight.detach().float().cpu().contiguous()
    digest = hashlib.sha256()
    digest.update(f"{tuple(emb.shape)}|{getattr(model.config, 'num_hidden_layers', '?')}".encode())
    digest.update(emb.numpy().tobytes())
    return digest.hexdigest()[:16]


def save_teacher_text(path: str | os.PathLike, ids: torch.Tensor, settings: dict[str, Any]) -> None:
    """Write the ids (N, T) and their settings (JSON-able, e.g. seed, samples, length, source fingerprint) to a
    safetensors file at `path`, atomically and with the umask's mode (`outputs.atomic_write_bytes`)."""
    from safetensors.torch import save

    from ..outputs.files import atomic_write_bytes

    meta = {"format": _FORMAT, "settings": json.dumps(settings, sort_keys=True)}
    atomic_write_bytes(path, save({"input_ids": ids.to(torch.int64).contiguous()}, metadata=meta))


def load_teacher_text(path: str | os.PathLike) -> tuple[torch.Tensor, dict[str, Any]]:
    """(ids (N, T) int64, settings) of a file written by `save_teacher_text`; ValueError for any other file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _FORMAT or "input_ids" not in f.keys():
                raise ValueError(
                    f"{path} is not a teacher-text file written by relational-hf (the heal_text.safetensors or "
                    "calibration_sampled.safetensors that `compress` leaves in its output)"
                )
            ids = f.get_tensor("input_ids")
    except (OSError, RuntimeError, SafetensorError) as err:  # not a safetensors file
        raise ValueError(f"{path} is not a readable teacher-text file ({err})") from None
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"{path}: teacher text must be ids (N, T >= 2), got shape {tuple(ids.shape)}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{path}: teacher text must be integer token ids, got {str(ids.dtype).replace('torch.', '')}")
    try:
        settings = json.loads(meta["settings"])
    except (KeyError, TypeError, ValueError):
        settings = None
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: its metadata holds no readable sampling settings (a forged or damaged file)")
    return ids.long(), settings


__all__ = [
    "DEFAULT_CALIBRATION_SHARE",
    "CALIBRATION_PROMPTS",
    "GENERIC_PROMPTS",
    "TEACHER_TEXT_NAME",
    "TEXT_DEFAULTS",
    "TEXT_OPTIONS",
    "calibration_share",
    "generate_teacher_text",
    "healing_stream",
    "load_teacher_text",
    "model_fingerprint",
    "save_teacher_text",
    "teacher_text",
]
