"""Calibration text that generalises: the user's windows mixed with text the source model samples itself.

Every step of the relational compression that fits data (the activation covariances of the VO and QK truncation, the
SwiGLU units kept, the refit of W_down and its refinement, the Fisher plan) fits the calibration windows. Calibrated
on one corpus alone, the compressed model keeps what that corpus uses and loses the rest: on SmolLM2-135M at 25%,
calibrated on WikiText-2 alone, held-out WikiText-2 is x1.42 of dense and Python source x5.70, Tiny Shakespeare
x3.64 (`benchmarks/results/compress_domains.json`). The source's own samples cover what the source itself writes
(chat, stories, code, explanations): added to the user's windows (a third of the whole, the default) they halve the
worst domain's ratio (x2.85) at no cost on the user's own kind of text (x1.42).

- `sampled_calibration`: windows (n, window) of text the source samples at temperature 1
  (`distill.generate_teacher_text`: half the rows from the requests of `distill.CALIBRATION_PROMPTS` when the
  tokenizer has a chat template, the rest from one random vocabulary token), seeded; with their settings. What the
  rows are seeded from decides the worst domain: from the healing's generic prompts (one of 24 about code) the
  command line's 25% SmolLM2 was x2.44 of dense on Python source and x2.34 on technical prose; from the calibration
  prompts (code in several languages, verse, drama, encyclopedic and technical prose, ...) x1.65 and x1.91, for
  +0.01 on WikiText-2 (`benchmarks/results/cli_domains.json`).
- `interleave`: several sets of windows in one (N, T) tensor whose every prefix holds each set in its share, so the
  steps that read the first windows (the plan's `plan_windows`) or hold the last ones back (the refinement's epoch
  choice, `refit_holdout`) see the mixture too; `deinterleave` takes such a tensor apart again.
- `mixed_calibration`: the user's windows and sampled ones at a given share, the job's and the command's one entry.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Default share of the calibration windows sampled from the source itself (`mixed_calibration`): a third, i.e. every
#: user window kept and half as many sampled ones added. Measured on SmolLM2-135M at 25% with 128 WikiText-2 windows
#: (`benchmarks/results/compress_domains.json`): the worst of four unlike domains went from x5.70 of dense (Python
#: source; WikiText-2 alone) to x2.85, and held-out WikiText-2 from x1.42 to x1.42 (50.39 -> 50.12); half the 128
#: windows replaced by sampled ones gave x2.74 and x1.55, the sampled text alone x2.23 and x2.23. Through the command
#: line with samples seeded by `distill.CALIBRATION_PROMPTS` (`cli_domains.json`, `cli_domains_selfhalf.json`), as many
#: sampled windows as the user's (128 + 128, share 1/2) gave WikiText-2 x1.52 instead of x1.44 and the worst of four
#: x1.94 instead of x1.91 (Shakespeare and prose 0.05 better, Python and chat 0.03 worse; one run each).
DEFAULT_SELF_SHARE = 1 / 3
#: Seed of the sampled calibration text (apart from the healing text's seed, so the two are different samples).
DEFAULT_SELF_SEED = 1
#: Above this many parameters the automatic share is 0: sampling needs the whole model in memory (a streamed
#: compression holds one layer) and its minutes on a CPU grow with the model (SmolLM2-135M: 64 windows of 512
#: tokens in about 3 minutes on 2 cores).
AUTO_SELF_MAX_PARAMETERS = 1_500_000_000


def approximate_parameters(config) -> int:
    """A decoder-only causal LM's parameter count from its config (embedding, attention and gated MLP of every layer;
    enough to compare with `AUTO_SELF_MAX_PARAMETERS`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d = int(getattr(text, "hidden_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    ff = int(getattr(text, "intermediate_size", 0) or 4 * d)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 1)
    kv = int(getattr(text, "num_key_value_heads", 0) or heads)
    hd = int(getattr(text, "head_dim", 0) or d // heads)
    return vocab * d + layers * (2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ff)


def resolve_self_share(share: float | None, has_user_text: bool, parameters: int) -> tuple[float, str]:
    """(share, why): a given share as it is; the automatic one (None) `DEFAULT_SELF_SHARE` with the user's text and 1
    without it (the source's samples replace the built-in text), 0 for a model of more than
    `AUTO_SELF_MAX_PARAMETERS` parameters."""
    if share is not None:
        return check_share(share), "given"
    if parameters > AUTO_SELF_MAX_PARAMETERS:
        return 0.0, f"automatic: 0 for a model of more than {AUTO_SELF_MAX_PARAMETERS:,} parameters"
    return (DEFAULT_SELF_SHARE, "automatic") if has_user_text else (1.0, "automatic: no calibration text given")


def check_share(share: Any, name: str = "`self_share`") -> float:
    """`share` as a float in [0, 1]; ValueError naming `name` otherwise."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= float(share) <= 1.0:
        raise ValueError(f"{name} must be a share in [0, 1], got {share!r}")
    return float(share)


def self_windows_count(n: int, share: float) -> int:
    """How many of `n` calibration windows come from the source's samples at `share` (at least one when share > 0,
    at least one left to the user's text when share < 1 and n > 1)."""
    k = round(n * share)
    if share > 0.0:
        k = max(k, 1)
    if share < 1.0 and n > 1:
        k = min(k, n - 1)
    return min(k, n)


def added_self_windows(n_user: int, share: float) -> int:
    """How many sampled windows join `n_user` windows of the user's text so that they are `share` of the whole (the
    user's windows all kept): round(n_user x share / (1 - share)), at least one when share > 0."""
    share = check_share(share)
    if share >= 1.0:
        raise ValueError("a self share of 1 leaves no room for the user's windows: sample n windows instead")
    return 0 if share == 0.0 else max(1, round(n_user * share / (1.0 - share)))


def _interleave_order(sizes: list[int], shares: list[float] | None = None) -> list[int]:
    """Which part gives each row of `interleave`: at each position the part furthest behind its share (of its size
    by default) gives its next row, the first such part on a tie."""
    total = sum(sizes)
    weights = [n / total for n in sizes] if shares is None else [float(s) for s in shares]
    taken = [0] * len(sizes)
    order = []
    for k in range(total):
        behind = [
            (weights[i] * (k + 1) - taken[i], -i) if taken[i] < sizes[i] else (float("-inf"), -i)
            for i in range(len(sizes))
        ]
        i = -max(behind)[1]
        order.append(i)
        taken[i] += 1
    return order


def interleave(parts: list[torch.Tensor], shares: list[float] | None = None) -> torch.Tensor:
    """The rows of `parts` (each (n_i, T), the same T) in one tensor (sum n_i, T), in order within each part, spread so
    that every prefix holds each part in proportion to its size (or to `shares`): at each position the part furthest
    behind its share gives its next row. Deterministic; `deinterleave` takes it apart."""
    parts = [p for p in parts if p.shape[0] > 0]
    if not parts:
        raise ValueError("interleave needs at least one non-empty set of windows")
    widths = {p.shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(f"windows to interleave must have one length, got {sorted(widths)}")
    taken = [0] * len(parts)
    rows = []
    for i in _interleave_order([p.shape[0] for p in parts], shares):
        rows.append(parts[i][taken[i]])
        taken[i] += 1
    return torch.stack(rows)


def deinterleave(windows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The parts (each (sizes[i], T), empty for a size of 0) that `interleave` put into `windows` (sum sizes, T), in
    their own order: `deinterleave(interleave(parts), [len(p) for p in parts])` gives `parts` back."""
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes) or sum(sizes) != windows.shape[0]:
        raise ValueError(f"sizes {sizes} must be counts adding up to the {windows.shape[0]} windows")
    kept = [i for i, n in enumerate(sizes) if n]
    rows: list[list[torch.Tensor]] = [[] for _ in sizes]
    for row, j in zip(windows, _interleave_order([sizes[i] for i in kept])):
        rows[kept[j]].append(row)
    return [torch.stack(r) if r else windows.new_empty((0, windows.shape[1])) for r in rows]


def sampled_calibration(
    model: nn.Module,
    tokenizer=None,
    *,
    n: int,
    window: int,
    seed: int = DEFAULT_SELF_SEED,
    chat_share: float = 0.5,
    progress: bool = True,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """(ids (n, window), settings): text `model` samples itself (`distill.teacher_text`), one row per window; the
    chat-seeded rows start from `distill.CALIBRATION_PROMPTS` (code, verse, drama, encyclopedic and technical prose,
    ...), not from the healing's generic prompts."""
    from .distill import CALIBRATION_PROMPTS, teacher_text

    return teacher_text(
        model, tokenizer, samples=n, length=window, seed=seed, chat_share=chat_share, progress=progress,
        prompts=CALIBRATION_PROMPTS,
    )  # fmt: skip


def mixed_calibration(
    user: torch.Tensor | None,
    share: float,
    model: nn.Module | None = None,
    tokenizer=None,
    *,
    n: int | None = None,
    window: int | None = None,
    sampled: torch.Tensor | None = None,
    seed: int = DEFAULT_SELF_SEED,
    progress: bool = True,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Calibration windows (n, window): `share` of them sampled from `model` itself, the rest the first of `user`'s
    windows (N, T), interleaved (`interleave`). n defaults to every user window and as many sampled ones again as
    make `share` of the whole (`added_self_windows`: the user's text loses no window to the mixture); a smaller n
    replaces user windows by sampled ones. window defaults to user's length (n and window are needed without `user`,
    i.e. share 1). `sampled` gives already sampled rows (at least the count needed, `window` long)
    instead of sampling. Returns (windows, settings): the share, each side's count and the sampling settings."""
    share = check_share(share)
    if user is not None and (not isinstance(user, torch.Tensor) or user.dim() != 2 or user.dtype != torch.long):
        raise ValueError("`user` must be token ids (N, T) as a LongTensor")
    if user is None and share < 1.0:
        raise ValueError("a self share below 1 needs the user's calibration windows")
    if n is None and user is not None:
        n = user.shape[0] + (added_self_windows(user.shape[0], share) if share < 1.0 else 0)
    window = window if window is not None else (user.shape[1] if user is not None else None)
    if not n or not window:
        raise ValueError("give `n` and `window` (the sampled windows' count and length) without user windows")
    if user is not None and user.shape[1] != window:
        raise ValueError(f"the user's windows are {user.shape[1]} tokens long, not `window` {window}")
    k = self_windows_count(n, share) if share > 0.0 else 0
    settings: dict[str, Any] = {"self_share": share, "self_windows": k, "user_windows": n - k}
    if user is not None and n - k > user.shape[0]:
        n = user.shape[0] + k  # the user's text holds fewer windows: keep them all, and the sampled ones
        settings["user_windows"] = user.shape[0]
    own = None
    if k:
        if sampled is None:
            if model is None:
                raise ValueError("sampling calibration text needs the source model")
            own, text_settings = sampled_calibration(model, tokenizer, n=k, window=window, seed=seed, progress=progress)
            settings["sampling"] = text_settings
        else:
            if sampled.dim() != 2 or sampled.shape[0] < k or sampled.shape[1] != window:
                raise ValueError(f"`sampled` must hold at least {k} rows of {window} tokens, got {tuple(sampled.shape)}")
            own = sampled[:k].long()
    mine = user[: n - k] if user is not None and n - k > 0 else None
    parts = [p for p in (mine, own) if p is not None]
    return interleave(parts), settings


__all__ = [
    "AUTO_SELF_MAX_PARAMETERS",
    "DEFAULT_SELF_SEED",
    "DEFAULT_SELF_SHARE",
    "added_self_windows",
    "check_share",
    "deinterleave",
    "interleave",
    "approximate_parameters",
    "mixed_calibration",
    "resolve_self_share",
    "sampled_calibration",
    "self_windows_count",
]
