"""The texts of `relational-hf compress`: calibration and evaluation windows of files or token-id tensors, the
calibration mixed with text SRC samples itself, and how the summary and warnings name them."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import UsageError
from .checks import check_token_ids, read_token_ids, text_or_ids


def eval_name(path: str) -> str:
    """How the report and the summary name an --eval text: its file name."""
    return Path(path).name


def windows_of(
    source: Path | str, tokenizer, window: int, n: int, flag: str, vocab: int, short_ok: bool = False
) -> torch.Tensor:
    """Consecutive windows (n', window) of token ids of a text file or string, of a .pt tensor of token ids (each a
    row of the model's `vocab` embedding rows), or of a sampled-text .safetensors file that `compress` or its healing
    wrote (its rows read in order) (n' <= n). `tokenizer` is the tokenizer of SRC, or the
    error that kept it from loading (a UsageError for a text, which needs one). A text with fewer than n windows is
    warned about unless `short_ok` (`compress.eval.id_windows`)."""
    from ..compress.eval import id_windows, text_windows

    ids = None
    if isinstance(source, Path) and source.suffix == ".pt":
        ids = check_token_ids(read_token_ids(source, lambda: None, flag), vocab, flag)  # a .pt needs no tokenizer
    elif isinstance(source, Path) and source.suffix == ".safetensors":  # text a model sampled, as `compress` saves it
        from ..compress.distill import load_teacher_text

        try:
            sampled = load_teacher_text(source)[0].reshape(-1)
        except ValueError as err:
            raise UsageError(f"{flag}: {err}") from None
        ids = check_token_ids(sampled, vocab, f"{flag} {source}")
    elif isinstance(tokenizer, Exception):
        what = f"{flag} {source}" if isinstance(source, Path) else f"{flag} (not given: the built-in text)"
        raise UsageError(f"{what}: SRC has no tokenizer ({tokenizer}); pass a .pt tensor of token ids")
    try:
        if ids is not None:
            return id_windows(ids, window, n, short_ok=short_ok)
        return text_windows(str(source), tokenizer, window=window, n=n, short_ok=short_ok)
    except ValueError as err:
        raise UsageError(f"{flag}: {err} (--window {window})") from None


def user_calibration(
    paths: list[str], tokenizer, window: int, n: int, vocab: int
) -> tuple[torch.Tensor, dict[str, int]]:
    """The user's calibration windows: one text's first `n` windows, or, for several --calibration texts (a mixture
    of domains), `n` shared among them as evenly as they allow (a shorter text gives all it holds, the others make up
    for it) and interleaved (`compress.calibration.interleave`: every prefix of the windows holds each text in its
    share, so the plan's first windows and the refit's held-back last ones see the mixture too). Returns (windows,
    {text name: windows taken})."""
    from ..compress.calibration import interleave

    several = len(paths) > 1  # a short text is then warned about only if the others cannot make up for it
    full = [windows_of(Path(p), tokenizer, window, n, "--calibration", vocab, short_ok=several) for p in paths]
    if not several:
        return full[0], {Path(paths[0]).name: int(full[0].shape[0])}
    counts = [0] * len(full)
    left = n
    while left > 0:  # round-robin over the texts that still have windows
        open_ = [i for i, w in enumerate(full) if counts[i] < w.shape[0]]
        if not open_:
            break
        for i in open_:
            if left == 0:
                break
            counts[i] += 1
            left -= 1
    if left:
        logging.getLogger(__name__).warning(
            "asked for %d calibration windows of %d tokens, the %d texts hold only %d", n, window, len(paths), n - left
        )
    parts = [w[:c] for w, c in zip(full, counts)]
    return interleave(parts), {Path(p).name: c for p, c in zip(paths, counts)}


#: The file in OUT that holds the calibration windows SRC sampled itself (not the user's windows, which OUT never
#: holds: a published compression carries no private calibration text).
SAMPLED_CALIBRATION_NAME = "calibration_sampled.safetensors"


def sampled_calibration(
    args, model, tokenizer, user: torch.Tensor | None, share: float
) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    """The calibration windows with text `model` samples itself (`compress.calibration.mixed_calibration`): the
    user's windows all kept and sampled ones added to make `share` of the whole, or --calibration-windows sampled
    windows without user windows; what was mixed (counts and the sampling's settings, the source's fingerprint
    included); and the sampled windows alone (None when none were sampled), which `save_sampled_calibration` keeps."""
    from ..compress.calibration import deinterleave, mixed_calibration

    tokenizer = None if isinstance(tokenizer, Exception) else tokenizer
    n = args.calibration_windows if user is None else None
    windows, info = mixed_calibration(user, share, model, tokenizer, n=n, window=args.window, progress=True)
    sampled = deinterleave(windows, [info["user_windows"], info["self_windows"]])[1] if info["self_windows"] else None
    if sampled is not None:
        info["sampling"]["file"] = SAMPLED_CALIBRATION_NAME
    return windows, {k: v for k, v in info.items() if k != "self_share"}, sampled


def save_sampled_calibration(folder: Path, sampled: torch.Tensor | None, info: dict) -> None:
    """Write the sampled calibration windows into the output folder being staged, with their sampling settings (what
    --calibration reads back: the very tokens the compression fitted, not only the recipe that made them)."""
    if sampled is not None:
        from ..compress.distill import save_teacher_text

        settings = {k: v for k, v in info["sampling"].items() if k != "file"}
        save_teacher_text(folder / SAMPLED_CALIBRATION_NAME, sampled, settings)


def calibration_summary(info: dict) -> str:
    """The summary's calibration part: the text and the share SRC sampled."""
    if not info.get("self_windows"):
        return f"; calibration: {info['text']}"
    if not info.get("user_windows"):
        return f"; calibration: {info['self_windows']} windows SRC sampled itself"
    return f"; calibration: {info['user_windows']} windows of {info['text']} and {info['self_windows']} SRC sampled itself"


def gauge_note(report: dict) -> str:
    """The summary's note of the gauge the compressed model was written in (empty when the report names none)."""
    gauge = (report.get("options") or {}).get("gauge")
    return f", {gauge} gauge" if gauge else ""


def warn_if_fitted(name: str, evaluation: torch.Tensor, calibration: torch.Tensor) -> None:
    """One warning when an --eval text's windows are calibration windows too (the same file given twice, say)."""
    from ..compress.eval import shared_windows

    shared = shared_windows(evaluation, calibration)
    if shared:
        logging.getLogger(__name__).warning(
            "--eval %s: %d of its %d windows are --calibration windows too; the compression fits them, so their "
            "perplexity is not a held-out figure (give text the calibration does not hold)", name, shared, len(evaluation)
        )


def eval_summary(table: dict, evaluations: dict[str, torch.Tensor], calibration: torch.Tensor) -> str:
    """The summary's --eval part: each text's perplexities (and whether its windows were held out from the
    calibration), then the worst ratio when there are several."""
    from ..compress.eval import shared_windows

    parts = []
    for name, row in table["texts"].items():
        shared = shared_windows(evaluations[name], calibration)
        fitted = f" (not held out: {shared} of {len(evaluations[name])} windows are calibration windows)" if shared else ""
        parts.append(f"{name} perplexity {row['perplexity_before']:.2f} -> {row['perplexity_after']:.2f}{fitted}")
    worst = f"; worst x{table['worst_ratio']:.2f} of SRC ({table['worst_text']})" if len(parts) > 1 else ""
    return "; " + "; ".join(parts) + worst


def check_heal_options(args) -> None:
    """The compress command's checks of its healing options (--heal-*), before a model is loaded."""
    if args.heal_text is not None:
        if Path(args.heal_text).suffix == ".safetensors":
            if not Path(args.heal_text).is_file():
                raise UsageError(f"--heal-text {args.heal_text}: no such file")
        else:
            text_or_ids(args.heal_text, "--heal-text")
    generation = [f for f in ("heal_samples", "heal_length", "heal_seed") if getattr(args, f) is not None]
    if not args.heal_steps:
        given = ["heal_loss", "heal_text", "heal_lr", "heal_batch_size", "heal_calibration_share", *generation]
        given = [f for f in given if getattr(args, f) is not None]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} needs --heal-steps N (N >= 1)")
    share = args.heal_calibration_share
    if share is not None and args.heal_loss == "lm":
        raise UsageError("--heal-calibration-share mixes calibration windows into distillation: not with --heal-loss lm")
    if generation and share == 1.0:
        flag = generation[0].replace("_", "-")
        raise UsageError(f"--{flag} sets the text SRC generates; --heal-calibration-share 1 uses none")
    if generation and (args.heal_loss == "lm" or args.heal_text is not None):
        reason = "--heal-text gives the text" if args.heal_text is not None else "--heal-loss lm generates none"
        raise UsageError(f"--{generation[0].replace('_', '-')} sets the text SRC generates for --heal-loss kd; {reason}")
