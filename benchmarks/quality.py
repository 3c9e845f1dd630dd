"""Quality per parameter: validation loss against stored parameter count, relational variants against a
Transformers Llama family, at equal tokens and equal optimiser settings.

Every contender trains the same sizes with the same seeds (seed = model init and batch order), the same tokens and
the same AdamW + warmup/cosine schedule, whose peak learning rate is chosen once by a small sweep on one Llama size
(the smallest, or --sweep-size) and then frozen. For each relational point the Llama-equivalent parameter count is the Llama curve (mean
validation loss against log parameters, piecewise linear) inverted at that point's loss; the parameter-efficiency
ratio is Llama-equivalent / stored parameters. The goal chased in issue 7: a relational family for which Llama
needs >= 1.3x the parameters for the same loss.

    python benchmarks/quality.py                       # both corpora, default budget (~30 min per corpus, 2 cores)
    python benchmarks/quality.py --corpus shakespeare  # one corpus
    python benchmarks/quality.py --quick               # tiny sizes, few steps (< 3 minutes)
    python benchmarks/quality.py --long                # 5x the tokens (GPU or overnight CPU)
    python benchmarks/quality.py --seeds 2 --contenders llama,relational_pivot   # a reduced grid
    python benchmarks/quality.py --corpus wikitext2 --sweep-size d96   # LR swept on the largest default Llama

Corpora (read from ../shared/data; skipped with a message where absent):
- shakespeare: Tiny Shakespeare, character level (the byte-level tokenizer, ids compacted to the characters that
  occur: 65), first 90% of the text (cut at a line boundary) trains, last 10% validates (nanoGPT's split);
- wikitext2: WikiText-2 *validation* text (the train split is not available here) split by documents (`= Title =`
  headings), first 90% of documents train, last 10% validate, byte-level BPE (vocabulary 1024) trained on the
  train part only.

Writes benchmarks/results/quality_<corpus>[_quick|_long].json and .png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context

import common
import torch

logger = logging.getLogger("quality")

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
    schedule="linear warmup, then cosine decay to min_lr_fraction x peak at the last step",
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
    from relational_hf.training.data import byte_level_tokenizer, encode, split_text

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


def wikitext_documents(text: str) -> list[str]:
    """Split WikiText text into articles at the top-level headings ` = Title = ` (not ` = = Section = = `)."""
    starts = [m.start() for m in re.finditer(r"^ = [^=].* = $", text, flags=re.MULTILINE)]
    bounds = [0, *starts[1:], len(text)]  # any text before the first heading stays with the first article
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def load_wikitext2() -> dict:
    """WikiText-2 validation text split by documents 90/10; BPE trained on the train documents only."""
    from relational_hf.training.data import encode, train_bpe_tokenizer

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


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup to `peak`, then cosine decay to min_lr_fraction x peak at the last step."""
    warmup = max(1, round(OPTIMIZER["warmup_fraction"] * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    floor = OPTIMIZER["min_lr_fraction"] * peak
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


_DATA: dict = {}


def _set_data(train_ids: torch.Tensor, val_blocks: torch.Tensor, threads: int) -> None:
    """Worker initializer: the token streams each run reads, and the torch thread count."""
    _DATA["train_ids"], _DATA["val_blocks"] = train_ids, val_blocks
    torch.set_num_threads(threads)


def train_one(job: dict) -> dict:
    """Train one contender at one size and seed for job["steps"] steps; return its validation loss (nats/token)."""
    from relational_hf.training.data import RandomBlockDataset
    from relational_hf.training.metrics import token_nll

    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    torch.manual_seed(job["seed"])
    model = build_model(job["contender"], job["dims"], job["vocab_size"]).to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIMIZER["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=job["lr"],
        betas=OPTIMIZER["betas"],
        eps=OPTIMIZER["eps"],
    )
    stepper = opt
    if job["contender"] in PROJECTED:
        from relational_hf.symmetry import ProjectedOptimizer

        stepper = ProjectedOptimizer(opt, model)
    steps, batch = job["steps"], job["batch_size"]
    windows = RandomBlockDataset(_DATA["train_ids"], job["context"], steps * batch, seed=job["seed"])
    train_losses, diverged = [], False
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, job["lr"])
        ids = torch.stack([windows[i]["input_ids"] for i in range(step * batch, (step + 1) * batch)]).to(device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        if not torch.isfinite(loss):
            diverged = True
            break
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER["grad_clip_norm"])
        stepper.step()
        stepper.zero_grad(set_to_none=True)
        train_losses.append(loss.item())
    if diverged:
        val_loss = float("nan")
    else:
        total, count = token_nll(model, _DATA["val_blocks"], batch_size=64)
        val_loss = total / count
    tail = train_losses[-max(1, steps // 20) :]
    return {
        "contender": job["contender"],
        "size": job["size"],
        "seed": job["seed"],
        "lr": job["lr"],
        "parameters": params,
        "formula_parameters": formula_parameters(job["contender"], model.config),
        "model_signature": model_signature(job["contender"], job["dims"], job["vocab_size"]),
        "val_loss": val_loss,
        "train_loss_last_5pct": statistics.fmean(tail) if tail else float("nan"),
        "diverged": diverged,
        "steps": steps,
        "tokens": steps * batch * job["context"],
        "seconds": time.perf_counter() - start,
    }


class Runner:
    """Runs training jobs in this process (workers=1) or in a pool of worker processes that each hold the corpus
    (started once per corpus, used by the LR sweep and the grid)."""

    def __init__(self, workers: int, threads: int, train_ids: torch.Tensor, val_blocks: torch.Tensor) -> None:
        self.workers, self.threads, self.data = workers, threads, (train_ids, val_blocks)
        self.pool, self.threads_before = None, None

    def __enter__(self) -> Runner:
        if self.workers > 1:
            self.pool = ProcessPoolExecutor(
                self.workers,
                mp_context=get_context("spawn"),
                initializer=_set_data,
                initargs=(*self.data, self.threads),
            )
        else:
            self.threads_before = torch.get_num_threads()
            _set_data(*self.data, self.threads)
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        else:
            torch.set_num_threads(self.threads_before)
        _DATA.clear()

    def run(
        self, jobs: list[dict], on_done: Callable[[list[dict]], None] | None = None, deadline: float | None = None
    ) -> list[dict]:
        """Results of `jobs` (started in the given order, at most `workers` at a time) in completion order;
        `on_done(results so far)` after each one. No job starts after `deadline` (time.monotonic()); the ones left
        are simply not run."""
        results: list[dict] = []
        queue = list(jobs)

        def more() -> bool:
            return bool(queue) and (deadline is None or time.monotonic() < deadline)

        if self.pool is None:
            while more():
                self._finish(train_one(queue.pop(0)), results, len(jobs), on_done)
            return results
        running = set()
        while running or more():
            while more() and len(running) < self.workers:
                running.add(self.pool.submit(train_one, queue.pop(0)))
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                self._finish(future.result(), results, len(jobs), on_done)
        return results

    @staticmethod
    def _finish(result: dict, results: list[dict], total: int, on_done) -> None:
        results.append(result)
        logger.info(
            "[%d/%d] %-26s %-3s seed %d lr %.0e: %9d params, val loss %.4f (%.0f s)",
            len(results),
            total,
            result["contender"],
            result["size"],
            result["seed"],
            result["lr"],
            result["parameters"],
            result["val_loss"],
            result["seconds"],
        )
        if on_done is not None:
            on_done(results)


# ---------------------------------------------------------------------------------------------------------------
# Analysis: the Llama curve and Llama-equivalent parameter counts
# ---------------------------------------------------------------------------------------------------------------


def isotonic_decreasing(values: list[float]) -> list[float]:
    """Least-squares non-increasing fit to `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(int(n))]


def _curve(params: list[float], losses: list[float]) -> tuple[list[float], list[float]]:
    """(log parameters, non-increasing loss) of a curve, sorted by parameters."""
    order = sorted(range(len(params)), key=lambda i: params[i])
    x = [math.log(params[i]) for i in order]
    return x, isotonic_decreasing([losses[i] for i in order])


def llama_equivalent(
    params: list[float], losses: list[float], loss: float, limit: float = 2.0
) -> tuple[float | None, str]:
    """Parameters a model on the Llama curve needs to reach `loss`: the curve (mean loss against log parameters,
    made non-increasing by isotonic regression) interpolated piecewise linearly and inverted. Outside the measured
    loss range the first or last strictly decreasing segment is extended, at most a factor `limit` beyond the
    measured parameter range.

    Returns (parameters or None, status), status one of
    "interpolated";
    "extrapolated_above_largest" / "extrapolated_below_smallest": the loss is lower than the largest Llama's / higher
    than the smallest Llama's, and the extended end segment reaches it within `limit`;
    "beyond_largest" / "beyond_smallest": it does not (None: only the bound "more than the largest" / "fewer than
    the smallest" Llama holds);
    "undefined": under two points, a flat curve, or a non-finite loss."""
    if len(params) < 2 or not math.isfinite(loss):
        return None, "undefined"
    x, y = _curve(params, losses)
    segments = [(i, i + 1) for i in range(len(x) - 1) if y[i] > y[i + 1]]
    if not segments:
        return None, "undefined"
    if loss > y[0]:
        (a, b), status = segments[0], "extrapolated_below_smallest"
    elif loss < y[-1]:
        (a, b), status = segments[-1], "extrapolated_above_largest"
    else:
        a, b = next((a, b) for a, b in segments if y[a] >= loss >= y[b])
        status = "interpolated"
    u = x[a] + (y[a] - loss) / (y[a] - y[b]) * (x[b] - x[a])
    if u > x[-1] + math.log(limit):
        return None, "beyond_largest"
    if u < x[0] - math.log(limit):
        return None, "beyond_smallest"
    return math.exp(u), status


def llama_loss_at(params: list[float], losses: list[float], n: float) -> float:
    """The Llama curve's loss at `n` parameters (same curve as llama_equivalent; end segments extended)."""
    x, y = _curve(params, losses)
    u = math.log(n)
    i = 0 if u <= x[0] else len(x) - 2 if u >= x[-1] else max(j for j in range(len(x) - 1) if x[j] <= u)
    return y[i] + (u - x[i]) * (y[i + 1] - y[i]) / (x[i + 1] - x[i])


def _stats(values: list[float]) -> dict:
    finite = [v for v in values if math.isfinite(v)]
    std = statistics.stdev(finite) if len(finite) > 1 else None
    return {
        "mean": statistics.fmean(finite) if finite else float("nan"),
        "std": std,
        "se": std / math.sqrt(len(finite)) if std is not None else None,
        "n": len(finite),
        "diverged": len(values) - len(finite),
        "values": values,
    }


def analyse(runs: list[dict], sizes: dict) -> dict:
    """Per contender and size: parameters and val loss mean ± std; for relational points the Llama-equivalent
    parameter count, the efficiency ratio, and whether the difference from Llama lies inside the seed noise."""
    known = list(CONTENDERS)

    def order(r: dict) -> tuple:  # contenders in CONTENDERS order (others after, by name), sizes small to large, seeds
        c = r["contender"]
        return (known.index(c) if c in known else len(known), c, list(sizes).index(r["size"]), r["seed"])

    table: dict = {}
    for r in sorted(runs, key=order):
        entry = table.setdefault(r["contender"], {}).setdefault(
            r["size"], {"parameters": r["parameters"], "losses": []}
        )
        entry["losses"].append(r["val_loss"])
        entry["formula_parameters"] = r["formula_parameters"]
    results = {
        c: {
            s: {
                "parameters": e["parameters"],
                "formula_parameters": e["formula_parameters"],
                "val_loss": _stats(e["losses"]),
            }
            for s, e in by_size.items()
        }
        for c, by_size in table.items()
    }
    out: dict = {"results": results, "comparisons": {}, "goal": {"ratio": GOAL_RATIO, "met_by": []}}
    llama = results.get("llama", {})
    points = [(e["parameters"], e["val_loss"]["mean"], e["val_loss"]["se"]) for e in llama.values()]
    points = [p for p in points if math.isfinite(p[1])]
    if len(points) < 2:
        out["llama_curve"] = {"points": len(points), "note": "under two Llama sizes: no Llama-equivalent counts"}
        return out
    lp, ll = [p[0] for p in points], [p[1] for p in points]
    ses = [p[2] for p in points if p[2] is not None]
    llama_se = statistics.fmean(ses) if ses else None
    order = sorted(range(len(lp)), key=lambda i: lp[i])
    _, y_iso = _curve(lp, ll)
    out["llama_curve"] = {
        "parameters": [lp[i] for i in order],
        "mean_loss": [ll[i] for i in order],
        "isotonic_loss": y_iso,
        "monotone": y_iso == [ll[i] for i in order],
        "mean_standard_error": llama_se,
        "interpolation": "piecewise linear in (log parameters, mean loss) after isotonic (non-increasing) regression",
    }
    for contender, by_size in results.items():
        if contender == "llama":
            continue
        comp = {}
        for size, e in by_size.items():
            mean, se, n = e["val_loss"]["mean"], e["val_loss"]["se"], e["parameters"]
            eq, status = llama_equivalent(lp, ll, mean)
            row = {
                "parameters": n,
                "val_loss_mean": mean,
                "val_loss_std": e["val_loss"]["std"],
                "llama_equivalent_parameters": round(eq) if eq else None,
                "efficiency_ratio": eq / n if eq else None,
                "status": status,
            }
            if status == "beyond_largest":
                row["efficiency_ratio_at_least"] = max(lp) / n
            elif status == "beyond_smallest":
                row["efficiency_ratio_at_most"] = min(lp) / n
            if se is not None:
                lo, _ = llama_equivalent(lp, ll, mean + se)
                hi, _ = llama_equivalent(lp, ll, mean - se)
                row["efficiency_ratio_range_1se"] = [lo / n if lo else None, hi / n if hi else None]
            diff = mean - llama_loss_at(lp, ll, n)
            row["loss_minus_llama_curve"] = diff
            if se is None or llama_se is None:
                row["verdict"] = "no seed-noise estimate (one seed)"
            else:
                noise = NOISE_SE * math.sqrt(se**2 + llama_se**2)
                row["noise_threshold"] = noise
                row["verdict"] = (
                    "within seed noise"
                    if abs(diff) <= noise
                    else ("below the Llama curve (better)" if diff < 0 else "above the Llama curve (worse)")
                )
            same = llama.get(size)
            if same is not None:
                d = mean - same["val_loss"]["mean"]
                row["loss_minus_llama_same_size"] = d
                if se is not None and same["val_loss"]["se"] is not None:
                    row["same_size_within_noise"] = abs(d) <= NOISE_SE * math.sqrt(se**2 + same["val_loss"]["se"] ** 2)
                row["parameters_vs_llama_same_size"] = n / same["parameters"]
            comp[size] = row
        out["comparisons"][contender] = comp
        met = bool(comp) and all(
            (r["efficiency_ratio"] or r.get("efficiency_ratio_at_least") or 0.0) >= GOAL_RATIO
            and "better" in r["verdict"]
            for r in comp.values()
        )
        if met:
            out["goal"]["met_by"].append(contender)
    out["goal"]["rule"] = (
        f"a family meets the goal when at every size its Llama-equivalent / stored parameters >= {GOAL_RATIO} and the "
        f"point lies below the Llama curve by more than {NOISE_SE:g} standard errors of the difference"
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# Plot and driver
# ---------------------------------------------------------------------------------------------------------------


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for contender, by_size in payload["results"].items():
        xs = [e["parameters"] for e in by_size.values()]
        ys = [e["val_loss"]["mean"] for e in by_size.values()]
        es = [e["val_loss"]["std"] or 0.0 for e in by_size.values()]
        style = dict(color="k", lw=2.2, marker="s", zorder=5) if contender == "llama" else dict(marker="o", lw=1.2)
        if contender in CONTROLS:
            style.update(ls="--", marker="x")
        ax.errorbar(xs, ys, yerr=es, capsize=3, label=contender, **style)
    ax.set_xscale("log")
    ax.set_xlabel("stored parameters")
    ax.set_ylabel("validation loss (nats/token), mean ± std over seeds")
    budget = payload["budget"]
    ax.set_title(
        f"{payload['corpus']['name']} ({budget['name']} budget): {budget['tokens_per_run']:,} training tokens per run,"
        f"\n{len(budget['seeds'])} seeds, peak LR {payload['optimizer']['peak_lr']:g}",
        fontsize=10,
    )
    ax.legend(fontsize=7)
    for contender, comp in payload.get("comparisons", {}).items():
        line = None
        for marker, key in (
            ("o", "efficiency_ratio"),
            ("^", "efficiency_ratio_at_least"),
            ("v", "efficiency_ratio_at_most"),
        ):
            pts = [(r["parameters"], r[key], r["status"]) for r in comp.values() if r.get(key)]
            if not pts:
                continue
            kwargs = dict(color=line.get_color()) if line is not None else dict(label=contender)
            drawn = bx.plot(
                [q[0] for q in pts],
                [q[1] for q in pts],
                marker=marker,
                lw=1.2 if key == "efficiency_ratio" else 0,
                **kwargs,
            )[0]
            line = line or drawn
            extra = [q for q in pts if q[2] != "interpolated"]
            bx.scatter(
                [q[0] for q in extra], [q[1] for q in extra], s=110, facecolors="none", edgecolors=line.get_color()
            )
    bx.axhline(1.0, color="k", lw=0.8)
    bx.axhline(GOAL_RATIO, color="r", lw=0.8, ls="--", label=f"goal {GOAL_RATIO}x")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.yaxis.set_major_locator(ticker.FixedLocator([0.25, 0.35, 0.5, 0.7, 1.0, 1.3, 2.0, 3.0]))
    bx.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    bx.yaxis.set_minor_formatter(ticker.NullFormatter())
    bx.set_xlabel("stored parameters")
    bx.set_ylabel("Llama-equivalent / stored parameters")
    bx.set_title(
        "parameter efficiency against the Llama curve\n(circled: extrapolated; triangles: bounds, beyond 2x its range)",
        fontsize=10,
    )
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_previous(name: str, steps: int, vocab_size: int, sizes: dict) -> dict:
    """Runs (and the LR sweep) of an earlier, possibly interrupted, invocation writing results/<name>.json that are
    valid for this one: same steps, batch, context, vocabulary and size dimensions."""
    path = common.RESULTS / f"{name}.json"
    if not path.is_file():
        return {"runs": [], "lr_sweep": None}
    old = json.loads(path.read_text())
    same = (
        old.get("budget", {}).get("steps") == steps
        and old["budget"].get("batch_size") == BATCH_SIZE
        and old["budget"].get("context") == CONTEXT
        and old.get("corpus", {}).get("vocab_size") == vocab_size
    )
    if not same:
        logger.warning("--resume: %s was made with other settings; starting afresh", path)
        return {"runs": [], "lr_sweep": None}
    runs = [
        r
        for r in old.get("runs", [])
        if old["sizes"].get(r["size"]) == sizes.get(r["size"])
        and r["steps"] == steps
        and _same_model(r, sizes[r["size"]], vocab_size)
    ]
    stale = len(old.get("runs", [])) - len(runs)
    if stale:
        logger.info("--resume: %d earlier runs are for other sizes, steps or model configs; they run again", stale)
    return {"runs": runs, "lr_sweep": old.get("lr_sweep")}


def _same_model(run: dict, dims: dict, vocab_size: int) -> bool:
    """The run was made with today's model config. Runs written before signatures were recorded are kept only for
    Transformers' Llama (its config did not change); relational runs from then predate `final_norm_gain`."""
    if run["contender"] not in CONTENDERS:
        return False
    if "model_signature" not in run:
        return CONTENDERS[run["contender"]][1] is None
    return run["model_signature"] == model_signature(run["contender"], dims, vocab_size)


def lr_sweep(runner: Runner, job: dict, size: str, dims: dict, lrs: list[float]) -> tuple[dict, list[dict]]:
    """Train one Llama size (seed 0) at each peak LR; the one with the lowest validation loss is frozen for the
    whole grid. Returns (the sweep's record, its runs)."""
    logger.info("LR sweep on llama/%s, seed 0: %s", size, lrs)
    runs = runner.run([dict(job, contender="llama", size=size, dims=dims, seed=0, lr=v) for v in lrs])
    runs.sort(key=lambda r: r["lr"])
    best = min(runs, key=lambda r: r["val_loss"] if math.isfinite(r["val_loss"]) else float("inf"))
    logger.info("chosen peak LR %.0e", best["lr"])
    record = {
        "model": f"llama/{size}",
        "seed": 0,
        "steps": job["steps"],
        "candidates": [{"lr": r["lr"], "val_loss": r["val_loss"]} for r in runs],
        "chosen_lr": best["lr"],
        "at_edge_of_sweep": best["lr"] in (min(lrs), max(lrs)),
        "how": "lowest validation loss; then frozen for every contender, size and seed",
    }
    return record, runs


def run_corpus(corpus: str, args: argparse.Namespace, budget_name: str) -> dict | None:
    """Load one corpus, sweep the LR on one Llama size (unless --lr), train the grid, analyse, write JSON/PNG."""
    from relational_hf.training.data import lm_blocks

    relpath, loader = CORPORA[corpus]
    if not (common.SHARED_DATA / relpath).is_file():
        logger.warning("skipping %s: %s not found under %s", corpus, relpath, common.SHARED_DATA)
        return None
    started = time.monotonic()
    budget = BUDGETS[budget_name]
    steps = args.steps or budget["steps"]
    seeds = list(range(args.seeds or budget["seeds"]))
    sizes = {k: v for k, v in budget["sizes"].items() if not args.sizes or k in args.sizes}
    data = loader()
    train_ids, val_ids = data.pop("train_ids"), data.pop("val_ids")
    if budget["eval_tokens"]:
        val_ids = val_ids[: budget["eval_tokens"]]
    val_blocks = lm_blocks(val_ids, CONTEXT)
    data.update(train_tokens=train_ids.numel(), val_tokens=val_blocks.numel())
    data["val_tokens_per_char"] = None if budget["eval_tokens"] else val_ids.numel() / data["val_chars"]
    logger.info(
        "%s: %d train / %d validation tokens, vocabulary %d",
        corpus,
        train_ids.numel(),
        val_blocks.numel(),
        data["vocab_size"],
    )
    contenders, skipped = list(args.contenders or DEFAULT_CONTENDERS), {}
    reason = projected_optimizer_status() if PROJECTED & set(contenders) else None
    for c in [c for c in contenders if c in PROJECTED and reason]:
        logger.warning("skipping %s: %s", c, reason)
        skipped[c] = reason
        contenders.remove(c)
    job = dict(vocab_size=data["vocab_size"], batch_size=BATCH_SIZE, context=CONTEXT, steps=steps)
    sweep_size = args.sweep_size or min(sizes, key=lambda s: sum(sizes[s].values()))
    if sweep_size not in sizes:
        raise ValueError(f"--sweep-size {sweep_size!r} is not among the sizes run: {list(sizes)}")
    name = f"quality_{corpus}" + ("" if budget_name == "default" else f"_{budget_name}")
    previous = load_previous(name, steps, data["vocab_size"], sizes) if args.resume else {"runs": [], "lr_sweep": None}
    deadline = started + 60 * args.max_minutes if args.max_minutes else None
    with Runner(args.workers, args.threads, train_ids, val_blocks) as runner:
        sweep_runs: list[dict] = []
        if args.lr:
            sweep = {"chosen_lr": args.lr, "how": "given with --lr (no sweep)"}
        elif previous["lr_sweep"] and previous["lr_sweep"].get("model") == f"llama/{sweep_size}":
            sweep = previous["lr_sweep"]
            logger.info("LR sweep taken from the previous results: peak LR %.0e", sweep["chosen_lr"])
        else:
            sweep, sweep_runs = lr_sweep(runner, job, sweep_size, sizes[sweep_size], budget["sweep_lrs"])
        lr = sweep["chosen_lr"]
        wanted = {(c, s, seed) for c in contenders for s in sizes for seed in seeds}
        # the sweep's winning run is the grid's llama/<sweep size>/seed 0 (same job, same numbers)
        reuse = [
            r
            for r in previous["runs"] + sweep_runs
            if r["lr"] == lr and (r["contender"], r["size"], r["seed"]) in wanted
        ]
        reuse = list({(r["contender"], r["size"], r["seed"]): r for r in reuse}.values())
        have = {(r["contender"], r["size"], r["seed"]) for r in reuse}
        largest_first = sorted(sizes, key=lambda s: -sum(sizes[s].values()))
        jobs = [
            dict(job, contender=c, size=s, dims=sizes[s], seed=seed, lr=lr)
            for c in contenders  # in priority order: a run cut short by --max-minutes has whole curves
            for s in largest_first
            for seed in seeds
            if (c, s, seed) not in have
        ]
        if previous["runs"]:
            logger.info("reusing %d runs from the previous results; %d to run", len(reuse), len(jobs))
        payload = {
            "corpus": data,
            "budget": {
                "name": budget_name,
                "steps": steps,
                "batch_size": BATCH_SIZE,
                "context": CONTEXT,
                "tokens_per_run": steps * BATCH_SIZE * CONTEXT,
                "epochs_per_run": steps * BATCH_SIZE * CONTEXT / train_ids.numel(),
                "seeds": seeds,
                "seed_meaning": "torch.manual_seed before model init, and the order of training windows",
            },
            "optimizer": dict(OPTIMIZER, peak_lr=lr),
            "lr_sweep": sweep,
            "sizes": sizes,
            "contenders": {c: CONTENDERS[c][0] for c in contenders},
            "skipped": skipped,
            "parameter_count": "trainable parameters stored (tied embedding counted once); the pivot gauge's index "
            "buffers are not learned and not counted; formula_parameters is relational_hf.params' closed form",
            "workers": args.workers,
            "threads_per_worker": args.threads,
            "reused_runs": len(reuse),
        }

        def checkpoint(runs: list[dict]) -> None:  # partial results survive an interrupted run
            common.write_json(name, {**payload, "partial": True, "runs": reuse + runs})

        new_runs = runner.run(jobs, on_done=checkpoint, deadline=deadline)
    runs = reuse + new_runs
    done = {(r["contender"], r["size"], r["seed"]) for r in runs}
    payload["not_run"] = [f"{c}/{s}/seed {seed}" for c, s, seed in sorted(wanted - done)]
    if payload["not_run"]:
        logger.warning(
            "%d runs not started within --max-minutes %g (finish them with --resume): %s",
            len(payload["not_run"]),
            args.max_minutes,
            ", ".join(payload["not_run"]),
        )
    for r in runs:
        if r["parameters"] != r["formula_parameters"]:
            logger.warning(
                "%s/%s: stored %d parameters, formula says %d",
                r["contender"],
                r["size"],
                r["parameters"],
                r["formula_parameters"],
            )
    payload.update(analyse(runs, sizes))
    payload["runs"] = sorted(runs, key=lambda r: (r["contender"], list(sizes).index(r["size"]), r["seed"]))
    payload["wall_seconds"] = time.monotonic() - started  # this invocation (not reused runs)
    payload["run_seconds_total"] = sum(r["seconds"] for r in runs)  # every run, reused ones included
    path = common.write_json(name, payload)
    plot(payload, common.RESULTS / f"{name}.png")
    logger.info("wrote %s (%.0f s)", path, payload["wall_seconds"])
    print_table(payload)
    return payload


_VERDICT_MARK = {"below the Llama curve (better)": "better", "above the Llama curve (worse)": "worse"}


def markdown_table(payload: dict) -> str:
    """The README's table for one results JSON: a row per contender, a column per size; each cell is the mean
    validation loss ± std over seeds and, for relational points, the Llama-equivalent parameter ratio with the
    verdict (n = inside seed noise, E = extrapolated beyond the Llama curve's sizes)."""
    sizes = list(payload["sizes"])
    lines = ["| contender | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for contender, by_size in payload["results"].items():
        cells = []
        for size in sizes:
            e = by_size.get(size)
            if e is None:
                cells.append("–")
                continue
            v = e["val_loss"]
            cell = f"{e['parameters']:,}: {v['mean']:.3f}" + (f" ± {v['std']:.3f}" if v["std"] is not None else "")
            row = payload.get("comparisons", {}).get(contender, {}).get(size)
            if row:
                if row["efficiency_ratio"]:
                    ratio = f"×{row['efficiency_ratio']:.2f}"
                elif "efficiency_ratio_at_least" in row:
                    ratio = f"×>{row['efficiency_ratio_at_least']:.2f}"
                elif "efficiency_ratio_at_most" in row:
                    ratio = f"×<{row['efficiency_ratio_at_most']:.2f}"
                else:
                    ratio = ""
                marks = [_VERDICT_MARK.get(row["verdict"], "n")]
                if row["status"].startswith("extrapolated") or row["status"].startswith("beyond"):
                    marks.append("E")
                cell += f" ({', '.join(m for m in [ratio, *marks] if m)})"
                if row["verdict"] == "below the Llama curve (better)":
                    cell = f"**{cell}**"
            cells.append(cell)
        lines.append(f"| {contender} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(payload: dict) -> None:
    print(
        f"\n{payload['corpus']['name']} ({payload['budget']['name']}, {payload['budget']['tokens_per_run']:,} tokens/run, "
        f"peak LR {payload['optimizer']['peak_lr']:g})"
    )
    print(f"{'contender':27s} {'size':4s} {'params':>9s} {'val loss':>17s} {'Llama-eq':>10s} {'ratio':>6s}  verdict")
    for contender, by_size in payload["results"].items():
        for size, e in by_size.items():
            v = e["val_loss"]
            std = f"{v['std']:.4f}" if v["std"] is not None else "   -  "
            row = payload.get("comparisons", {}).get(contender, {}).get(size)
            eq = (
                f"{row['llama_equivalent_parameters']:>10,d}"
                if row and row["llama_equivalent_parameters"]
                else " " * 10
            )
            ratio = " " * 6
            if row and row["efficiency_ratio"]:
                ratio = f"{row['efficiency_ratio']:6.2f}"
            elif row and "efficiency_ratio_at_least" in row:
                ratio = f">{row['efficiency_ratio_at_least']:5.2f}"
            elif row and "efficiency_ratio_at_most" in row:
                ratio = f"<{row['efficiency_ratio_at_most']:5.2f}"
            note = f"{row['verdict']}; {row['status']}" if row else ""
            print(f"{contender:27s} {size:4s} {e['parameters']:9,d} {v['mean']:.4f} ± {std:6s} {eq} {ratio}  {note}")
    for c in payload["skipped"]:
        print(f"{c}: skipped ({payload['skipped'][c]})")
    print(f"goal (Llama needs >= {GOAL_RATIO}x parameters): met by {payload['goal']['met_by'] or 'no family'}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--quick", action="store_true", help="tiny sizes, 50 steps, 2 seeds (under 3 minutes)")
    budget.add_argument("--long", action="store_true", help="5x the default tokens per run")
    parser.add_argument("--corpus", choices=[*CORPORA, "all"], default="all")
    parser.add_argument(
        "--contenders",
        type=lambda s: s.split(","),
        help=f"comma-separated subset of {','.join(CONTENDERS)}, or 'all' (default: all but the controls "
        f"{', '.join(sorted(CONTROLS))})",
    )
    parser.add_argument("--sizes", type=lambda s: s.split(","), help="comma-separated subset of the budget's sizes")
    parser.add_argument("--seeds", type=int, help="number of seeds (default: the budget's, 3; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the budget's)")
    parser.add_argument("--lr", type=float, help="peak learning rate; skips the sweep")
    parser.add_argument(
        "--sweep-size",
        help="the Llama size the LR sweep trains (default: the smallest). On WikiText-2 the smallest picks an LR at "
        "which larger Llamas train worse than smaller ones; the largest size is the safer choice there",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1 if torch.cuda.is_available() else min(os.cpu_count() or 1, 8),
        help="runs in parallel processes (default: one per CPU core, at most 8; 1 on CUDA)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: 1)")
    parser.add_argument(
        "--max-minutes",
        type=float,
        help="start no run after this many minutes per corpus; the analysis covers what finished (contenders run in "
        "the order given, so the first ones have whole curves)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="reuse the runs (and LR sweep) already in the results JSON made with the same settings; run the rest",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the README table of the existing results JSON of each corpus (and budget) and exit; trains nothing",
    )
    args = parser.parse_args(argv)
    if args.contenders == ["all"]:
        args.contenders = list(CONTENDERS)
    if args.markdown:
        budget_name = "quick" if args.quick else "long" if args.long else "default"
        for corpus in list(CORPORA) if args.corpus == "all" else [args.corpus]:
            name = f"quality_{corpus}" + ("" if budget_name == "default" else f"_{budget_name}")
            path = common.RESULTS / f"{name}.json"
            if path.is_file():
                print(f"{name}\n\n{markdown_table(json.loads(path.read_text()))}\n")
        return []
    unknown = set(args.contenders or []) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contender(s) {sorted(unknown)}; choose from {list(CONTENDERS)}")
    budget_name = "quick" if args.quick else "long" if args.long else "default"
    unknown = set(args.sizes or []) - set(BUDGETS[budget_name]["sizes"])
    if unknown:
        parser.error(
            f"unknown size(s) {sorted(unknown)} for the {budget_name} budget; choose from {list(BUDGETS[budget_name]['sizes'])}"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    corpora = list(CORPORA) if args.corpus == "all" else [args.corpus]
    payloads = [p for c in corpora if (p := run_corpus(c, args, budget_name)) is not None]
    if not payloads:
        logger.warning("no corpus found under %s: nothing measured", common.SHARED_DATA)
    return payloads


if __name__ == "__main__":
    main()
