"""Compress a causal LM in relational coordinates and save it.

    relational-hf compress SRC OUT --remove 0.25 [--calibration FILE ...] [--self-calibration SHARE] [--eval FILE ...]
                                               [--heal-steps N]
                                               [--gauge free|pivot] [--stream | --no-stream] [--dtype D]
                                               [--max-shard-size S]

SRC is a local checkpoint folder, a Hub id or a GGUF file of a causal LM that convert takes (Llama family, Gemma 3,
GPT-2, GPT-NeoX...) or a relational checkpoint. A local safetensors folder or GGUF file of any of them is compressed one
decoder layer in memory at a time (`jobs.compress_checkpoint`: each layer read, converted and compressed from the
shards, a GGUF file's tensors dequantised one at a time, the result written shard by shard, stored in SRC's dtype unless
--dtype (float32 for a quantised GGUF file); the same model as in memory to float tolerance; each layer runs on the GPU
when there is one) unless --no-stream, healing, --method slice or --slice-fraction need the whole model in memory.
The calibration windows (--calibration-windows of --window tokens) mix the user's text (--calibration, a text file or
a .pt tensor of token ids; several texts share the windows evenly, interleaved) with text SRC samples itself (--self-calibration, the share of windows it samples: by
default a third, half as many as the user's added to them; all of them without --calibration), so that the
compressed model stays close to SRC on text unlike the user's; the report's "calibration" says what was mixed, and OUT
keeps the sampled windows as `calibration_sampled.safetensors` (a --calibration text). The result is a relational checkpoint in the free gauge
(every map a plain weight, what inference reads fastest), or with --gauge pivot in the gauge-fixed form; --remove is
counted in the gauge written.
OUT must be new or empty: the model, its tokenizer and `compression_report.json` are
written beside it and moved into place when complete (`relational_hf.outputs`). A SRC without a tokenizer is
compressed when every text comes as a .pt tensor of token ids; OUT then holds no tokenizer either. --eval reports
perplexity before and after, for each text given (with the worst ratio when there are several: give text unlike
the calibration's too); when its windows are calibration windows too (the same file given twice), a warning and the
summary say that the figure is not held out.

--heal-steps N repairs the compressed model with N LoRA steps. By default (--heal-loss kd) it distils from SRC: KL to
SRC's next-token distributions on text SRC samples itself (--heal-samples rows of --heal-length tokens, seed
--heal-seed), written into OUT as `heal_text.safetensors` (give that file as --heal-text to a later run to reuse it),
and on the calibration windows: --heal-calibration-share of the blocks (default 0.5) come from them.
--heal-text FILE.txt distils on that text instead; --heal-loss lm trains on the language-model loss (on --heal-text,
default: the calibration windows), which also adapts the model to that text. --heal-lr sets the LoRA learning rate
and --heal-batch-size the blocks a step takes (the healing's time grows with it); their defaults, which --help
quotes, are `training.heal_settings`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch

from ..compress.budget import KINDS
from ..compress.calibration import AUTO_SELF_MAX_PARAMETERS
from ..errors import UsageError
from ..training.heal_settings import DEFAULT_HEAL_BATCH_SIZE, DEFAULT_HEAL_BLOCK_SIZE, DEFAULT_HEAL_LR
from .checks import check_model_argument, check_token_ids, text_or_ids
from .compress_texts import (
    calibration_summary,
    check_heal_options,
    eval_name,
    eval_summary,
    gauge_note,
    sampled_calibration,
    save_sampled_calibration,
    user_calibration,
    warn_if_fitted,
    windows_of,
)
from .options import (
    CommandArguments,
    Fraction,
    Length,
    ModelSourceOptions,
    NonNegativeInt,
    OneOf,
    OpenFraction,
    PositiveInt,
    Share,
    StreamOptions,
    option,
    positional,
)

#: the maps `--kinds` names (`compress.budget.KINDS`)
Kinds = Annotated[list[str], OneOf(KINDS)]

HELP = "compress a checkpoint in relational coordinates (--remove share of stored parameters)"
REPORT_NAME = "compression_report.json"


@dataclass
class CompressPaths:
    src: str = positional("local checkpoint folder, Hub id or GGUF file of a Llama-family causal LM", "SRC")
    out: str = positional("output folder (must not exist or be empty)", "OUT")


@dataclass
class CompressOptions:
    _argument_group_name = "compression"

    remove: OpenFraction | None = option(None, "share of stored parameters to remove, in (0, 1) (required)")
    method: Literal["relational", "slice"] = option("relational", "compression method")
    calibration: list[str] | None = option(
        None,
        "calibration text file, a .pt tensor of token ids or the calibration_sampled.safetensors an earlier run left "
        "in its OUT (default: text SRC samples itself); several (--calibration "
        "A B, or given again) share the --calibration-windows evenly, interleaved: a mixture of unlike texts (on "
        "SmolLM2 at 25%%, a quarter each of WikiText-2, verse, Python source and SRC's own text took unseen technical "
        "prose from x2.40 of dense to x1.61, WikiText-2 from x1.42 to x1.90; README, 'Across domains')",
        metavar="FILE",
        action="extend",
    )
    eval: list[str] | None = option(
        None,
        "text file (or a .pt tensor of token ids) to report perplexity on, before and after; several (--eval A B, or "
        "--eval given again) report each and the worst ratio: give text unlike the calibration's too (on SmolLM2 at "
        "25%%, calibrated on WikiText-2 alone, held-out WikiText-2 was x1.4 of dense, Python source x6 or more)",
        metavar="FILE",
        action="extend",
    )
    self_calibration: Share | None = option(
        None,
        "share of the calibration windows that SRC samples itself (data-free text: chat answers, stories, code, "
        "explanations; seeded), added to the --calibration-windows of --calibration and interleaved with them; they "
        "keep the compressed model close to SRC on text unlike --calibration's (on SmolLM2 at 25%%, calibrated on "
        "WikiText-2: worst of four unlike domains x2.85 of dense instead of x5.70, held-out WikiText-2 x1.42 either "
        "way; README, 'Across domains'). Default: 1/3 (half as many windows as --calibration gives) with "
        "--calibration and 1 without it, for a SRC of at most "
        f"{AUTO_SELF_MAX_PARAMETERS / 1e9:g}B parameters (sampling needs the whole model in memory, minutes on a CPU); "
        "0 above (the built-in text without --calibration)",
        metavar="SHARE",
    )
    calibration_windows: PositiveInt = option(
        128,
        "calibration windows (on SmolLM2 at 25%%, with the options of the time: held-out perplexity a fifth lower with "
        "64 than with 16, 6.6%% lower again with 128, none lower with 256; the compression keeps a few copies of their "
        "activations, windows x window x hidden size floats each)",
    )
    eval_windows: PositiveInt = option(20, "evaluation windows")
    window: Length = option(512, "tokens per window")
    heal_steps: NonNegativeInt = option(0, "LoRA repair steps after compression")
    heal_loss: Literal["kd", "lm"] | None = option(
        None, "kd: distil from SRC (default); lm: language-model loss on --heal-text (default: the calibration windows)"
    )
    heal_text: str | None = option(
        None,
        "text to heal on: a text file, a .pt tensor of token ids, or the heal_text.safetensors of an earlier run "
        "(default for kd: text SRC "
        "generates; for lm: the calibration windows). Text like the text the model will serve repairs more: on "
        "SmolLM2 at 25%% (one run, earlier defaults), distilling on the calibration text took held-out text of its kind "
        "from x1.51 of dense to x1.37, SRC's own text left it at x1.51",
        metavar="FILE",
    )
    heal_calibration_share: Share | None = option(
        None,
        "kd: share of the distillation's blocks drawn from the calibration windows, the rest from the text SRC "
        "generates (default 0.5; 0 with a text --heal-text). On SmolLM2 at 25%% (one run, 2,048-token refinement "
        "steps), this command's held-out WikiText-2 went from 42.80 to 40.93 with half and half, to 43.82 with SRC's "
        "text alone",
        metavar="SHARE",
    )
    heal_lr: OpenFraction | None = option(
        None,
        f"learning rate of the LoRA repair (default: {DEFAULT_HEAL_LR['kd']:g} for kd, {DEFAULT_HEAL_LR['lm']:g} for lm)",
        metavar="LR",
    )
    heal_batch_size: PositiveInt | None = option(
        None,
        f"blocks of {DEFAULT_HEAL_BLOCK_SIZE} tokens per repair step (default: {DEFAULT_HEAL_BATCH_SIZE}); a step costs "
        "about this many times one block's time",
        metavar="N",
    )
    heal_samples: PositiveInt | None = option(None, "kd: rows of text SRC generates (default: 256)")
    heal_length: Length | None = option(None, "kd: tokens per generated row (default: 256)")
    heal_seed: NonNegativeInt | None = option(None, "kd: seed of the generated text (default: 0)")
    correction: Literal["local", "dense", "none"] = option(
        "dense",
        "MLP down-projection refit target: the dense model's next hidden states (dense; blended with the local target "
        "by --refit-blend), the dense MLP's output on the compressed stream (local: better with few calibration "
        "windows), or none",
    )
    mlp_order: Literal["auto", "score", "greedy"] = option(
        "auto",
        "order in which SwiGLU units are kept: each unit's own score, or forward selection for the refit (one more "
        "d_ff x d_ff matrix and O(d_ff^3) work a layer); auto: greedy for models of at most 4,096 SwiGLU units a "
        "layer, score above (with the automatic --refine-epochs, on SmolLM2 at 25%%: held-out perplexity 50.9 instead of "
        "53.3, 28.0 instead of 28.7 on the reverse split, for 710 s of compression instead of 308 s on 2 cores)",
    )
    refit_holdout: NonNegativeInt = option(
        0,
        "calibration windows (the last ones) held back to choose each layer's MLP refit, its ridge and its blend of "
        "the dense and local targets, by the error on them; the refit then uses every window (0: the fixed refit; on "
        "SmolLM2 at 25%%, 16 of 128 windows: held-out perplexity 52.8 instead of 53.4 with the fixed blend, 28.5 "
        "instead of 29.0 on the reverse split; memory: their activations and two kept-units x kept-units matrices per "
        "layer)",
        metavar="N",
    )
    refit_blend: Share | None = option(
        None,
        "with --correction dense: refit each layer's MLP to this blend of the dense model's next hidden states (1) and "
        "the dense MLP's output on the compressed stream (0) (default 0.5: on SmolLM2 at 25%%, held-out perplexity "
        "53.4 instead of 54.8 with 1, 29.0 instead of 29.5 on the reverse split); --refit-holdout chooses it per layer",
        metavar="B",
    )
    refit_prior: Literal["dense", "zero"] | None = option(
        None,
        "what the MLP refit's ridge pulls W_down towards: the kept units' own W_down columns (dense, the default: on "
        "SmolLM2 at 25%%, held-out perplexity 53.3 instead of 54.0 with zero, 28.7 instead of 29.1 on the reverse "
        "split) or zero (the plain ridge, the default before)",
    )
    refine_epochs: NonNegativeInt | None = option(
        None,
        "after each layer's MLP refit: epochs of Adam on its kept gate/up/down maps against the refit's own target, "
        "the epoch kept by its error on the last eighth of the calibration windows (0: the closed-form refit alone; "
        "on SmolLM2 at 25%%, 4 epochs: held-out perplexity 51.8 instead of 53.4, 28.3 instead of 29.0 on the reverse "
        "split, for about 11 s more a layer on 2 cores and two more copies of the calibration hidden states; default "
        "auto: 4 when those copies take at most 512 MiB, e.g. SmolLM2-135M with 128 windows of 512 tokens, else 0)",
        metavar="N",
    )
    refine_lr: OpenFraction | None = option(None, "learning rate of --refine-epochs (default: 3e-4)", metavar="LR")
    plan_windows: PositiveInt | None = option(
        None,
        "calibration windows the plan measures its error curves on, the first N of them (default 8); the plan's time "
        "grows with N",
        metavar="N",
    )
    plan_error: Literal["fisher", "token"] | None = option(
        None,
        "the error the plan spends the budget by across layers and kinds: fisher (the default: the predicted KL of the "
        "next-token distributions, from sampled Fisher directions) or token (each token's error relative to its "
        "residual energy, the default before: on SmolLM2 at 25%%, worse on each of five held-out domains, the worst "
        "x2.14 of dense against x1.91)",
    )
    width_multiple: PositiveInt | None = option(
        None,
        "every SwiGLU width the plan narrows a multiple of N, the stored budget still met: 256 lets llama.cpp's "
        "K-quants (e.g. Q4_K_M) take the compressed down maps in `export --to gguf --quantize`, 32 its other block "
        "types (QK and value widths are padded to the head width in GGUF, so they need none)",
        metavar="N",
    )
    kinds: Kinds = option(
        list(KINDS),
        "the maps --method relational narrows: qk (query/key widths), vo (value widths), mlp (SwiGLU units); the "
        "budget falls on the ones given. `--kinds mlp` keeps every query, key and value width whole: GGUF pads "
        "narrowed QK and value widths back to the head width, so in llama.cpp only the MLP's narrowing saves file "
        "size and time (docs/running-elsewhere.md)",
        choices=KINDS,
        metavar="KIND",
        nargs="+",
    )
    slice_fraction: Fraction = option(0.0, "global-rotation slice before truncation")
    gauge: Literal["free", "pivot"] | None = option(
        None,
        "gauge of the compressed model, in which --remove is counted: free (default: every map a plain weight, what "
        "inference reads fastest; on SmolLM2 at 25%%, 1.23x the dense model's decoding speed on one CPU thread against "
        "1.18x, for 1.0%% more held-out perplexity) or pivot (the gauge-fixed relational form, which does not store the "
        "pivot entries, so the same size keeps a little more width)",
    )


@dataclass
class CompressArguments(CommandArguments, StreamOptions, ModelSourceOptions, CompressOptions, CompressPaths):
    POSITIONALS = CompressPaths
    PARSER_GROUPS = (CompressOptions, StreamOptions, ModelSourceOptions)

    def local_gguf(self) -> Path | None:
        """The GGUF file SRC names (SRC itself, or --gguf-file inside the folder SRC) when it is on this machine."""
        from ..shards import is_gguf_file

        path = Path(self.src) / self.gguf_file if self.gguf_file is not None else Path(self.src)
        return path if is_gguf_file(path) else None

    def stream_chosen(self) -> bool:
        """Whether this run streams: --stream / --no-stream, else whenever SRC is a local safetensors folder or GGUF
        file and nothing asked for needs the whole model (healing, --method slice, --slice-fraction)."""
        from ..shards import is_safetensors_checkpoint

        whole = [
            flag
            for flag, given in (
                ("--heal-steps", bool(self.heal_steps)),
                ("--method slice", self.method != "relational"),
                ("--slice-fraction", bool(self.slice_fraction)),
            )
            if given
        ]
        streamable = self.local_gguf() is not None or (self.gguf_file is None and is_safetensors_checkpoint(self.src))
        chosen = self.streaming()
        if chosen:
            if not streamable:
                raise UsageError(
                    f"--stream needs a local folder with config.json and safetensors weights, or a GGUF file: {self.src}"
                )
            if whole:
                raise UsageError(f"--stream compresses one layer at a time; {whole[0]} needs the whole model")
            return True
        return chosen is None and streamable and not whole


Arguments = CompressArguments


def check(args: CompressArguments) -> None:
    """Everything that can be checked before a model is loaded."""
    from ..outputs import check_new_output

    if args.remove is None:
        raise UsageError("--remove is required: the share of stored parameters to remove, in (0, 1)")
    args.src = check_model_argument(args.src, "SRC", gguf_file=args.gguf_file)
    check_new_output(args.out, "OUT", source=args.src)
    for flag, path in (*(("--calibration", c) for c in args.calibration or []), *(("--eval", e) for e in args.eval or [])):
        text_or_ids(path, flag)
    names = [Path(c).name for c in args.calibration or []]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"--calibration: two texts are named {twice}; the report names each text by its file name")
    names = [eval_name(e) for e in args.eval or []]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"--eval: two files are named {twice}; the report names each text by its file name")
    check_heal_options(args)
    if args.mlp_order != "auto" and args.method != "relational":
        raise UsageError("--mlp-order applies to --method relational (the slice method keeps every unit)")
    if args.refit_holdout and args.method != "relational":
        raise UsageError("--refit-holdout applies to --method relational (the slice method refits nothing)")
    if args.refit_holdout and args.correction == "none":
        raise UsageError("--refit-holdout chooses the MLP refit: it needs --correction dense or local")
    if args.refit_blend is not None and (args.method != "relational" or args.correction != "dense" or args.refit_holdout):
        raise UsageError(
            "--refit-blend applies to --method relational with --correction dense, and --refit-holdout chooses it itself"
        )
    if args.refit_prior is not None and (args.method != "relational" or args.correction == "none"):
        raise UsageError("--refit-prior sets the MLP refit of --method relational: it needs --correction dense or local")
    if args.refit_holdout >= args.calibration_windows:
        raise UsageError(
            f"--refit-holdout {args.refit_holdout} must leave calibration windows to fit on "
            f"(--calibration-windows {args.calibration_windows})"
        )
    if args.refine_epochs and args.method != "relational":
        raise UsageError("--refine-epochs applies to --method relational (the slice method refits nothing)")
    if args.refine_lr is not None and (args.refine_epochs == 0 or args.method != "relational"):
        raise UsageError("--refine-lr sets the learning rate of --refine-epochs N (N >= 1, or the automatic choice)")
    if args.refine_epochs and args.calibration_windows < 2:
        raise UsageError("--refine-epochs holds calibration windows back to choose its epoch: give --calibration-windows >= 2")
    if args.gauge is not None and args.method != "relational":
        raise UsageError("--gauge applies to --method relational (the slice method writes the pivot gauge)")
    if args.plan_windows is not None and args.method != "relational":
        raise UsageError("--plan-windows applies to --method relational (the slice method plans nothing)")
    if args.plan_error is not None and args.method != "relational":
        raise UsageError("--plan-error sets the plan of --method relational (the slice method plans no widths)")
    if args.width_multiple and args.method != "relational":
        raise UsageError("--width-multiple sets the widths of --method relational (the slice method keeps every unit)")
    if list(args.kinds) != list(KINDS) and args.method != "relational":
        raise UsageError("--kinds chooses the maps --method relational narrows (the slice method narrows the stream)")
    if args.slice_fraction and args.method != "relational":
        raise UsageError("--slice-fraction applies to --method relational (the slice method chooses its own width)")
    args.stream_asked = args.streaming() is True  # --stream given (not chosen by default)
    args.stream = args.stream_chosen()
    if not args.stream and (args.dtype is not None or args.max_shard_size != "5GB"):
        raise UsageError("--dtype and --max-shard-size apply to a streamed compression (--stream)")


#: the end of the summary line when SRC had no tokenizer to copy into OUT
NO_TOKENIZER_NOTE = "; SRC has no tokenizer, so OUT holds none"


def run(args: CompressArguments) -> int:
    """Load SRC, compress it (`compress_model`), evaluate, and write OUT atomically under its lock (a second run
    into the same OUT is refused at once); prints a short summary."""
    from ..outputs import OutputLock

    check(args)
    with OutputLock(args.out) as lock:
        return _run(args, lock)


def _run(args: CompressArguments, lock) -> int:
    from ..compress.calibration import approximate_parameters, resolve_self_share
    from ..compress.distill import TEACHER_TEXT_NAME, load_teacher_text, model_fingerprint, save_teacher_text
    from ..compress.eval import eval_table
    from ..convert.preflight import refuse_without_relational_form, streamed_compression_refusal
    from ..jobs import compress_model
    from ..lm.data import load_texts
    from ..lm.metrics import perplexity
    from ..loading import (
        load_config_from,
        load_model_from,
        load_tokenizer_from,
        resolve_model_source,
        warn_beyond_context,
    )
    from ..outputs import save_tokenizer, write_new_output
    from .main import recheck_cpu_threads

    source = resolve_model_source(args.src, args.gguf_file)
    try:
        tokenizer = load_tokenizer_from(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, TypeError) as err:  # every text then has to come as token ids
        tokenizer = err
    lengths = {"--window": args.window, "--heal-length": args.heal_length}
    config = load_config_from(source, trust_remote_code=args.trust_remote_code)
    refuse_without_relational_form(config, trust_remote_code=args.trust_remote_code)  # before any text
    unstreamed = streamed_compression_refusal(config, trust_remote_code=args.trust_remote_code)
    if args.stream and unstreamed is not None:  # not streamed yet: in memory, unless streaming was asked for
        if args.stream_asked or args.dtype is not None or args.max_shard_size != "5GB":
            raise UsageError(f"--stream: {unstreamed}")
        args.stream = False
    warn_beyond_context(config, lengths, "SRC")  # refuses a length past a learned position table
    vocab = config.get_text_config().vocab_size
    self_share, why = resolve_self_share(
        args.self_calibration, args.calibration is not None, approximate_parameters(config)
    )
    calibration, taken = None, {}
    if self_share < 1.0 and args.calibration is not None:  # the user's windows, all kept: the sampled ones join them
        calibration, taken = user_calibration(args.calibration, tokenizer, args.window, args.calibration_windows, vocab)
    elif self_share < 1.0:
        builtin, _, _ = load_texts(None, None, None, "text")
        calibration = windows_of(builtin, tokenizer, args.window, args.calibration_windows, "--calibration", vocab)
    evaluations = {
        eval_name(e): windows_of(Path(e), tokenizer, args.window, args.eval_windows, "--eval", vocab) for e in args.eval or []
    }
    calibration_info = {
        "text": " + ".join(Path(c).name for c in args.calibration) if args.calibration is not None else "built-in",
        "self_share": self_share,
        "self_share_choice": why,
    }
    if len(taken) > 1:
        calibration_info["texts"] = taken
    mixed = {"self_windows": 0, "user_windows": int(calibration.shape[0])} if calibration is not None else {}
    sampled = None
    if calibration is not None and args.refit_holdout >= calibration.shape[0]:  # a text shorter than --calibration-windows asked for
        raise UsageError(
            f"--refit-holdout {args.refit_holdout} must leave calibration windows to fit on: --calibration holds "
            f"only {calibration.shape[0]} windows of --window {args.window}"
        )
    heal_loss = args.heal_loss or "kd"
    heal_data, text_settings = None, None
    if args.heal_text is not None and Path(args.heal_text).suffix == ".safetensors":
        try:
            heal_data, text_settings = load_teacher_text(args.heal_text)
        except ValueError as err:
            raise UsageError(f"--heal-text: {err}") from None
        check_token_ids(heal_data, vocab, f"--heal-text {args.heal_text}")
    elif args.heal_text is not None:
        heal_data = windows_of(Path(args.heal_text), tokenizer, args.window, 1_000_000, "--heal-text", vocab)
    if args.stream:
        if self_share > 0.0:  # the source samples its share: the whole model in memory for that, then freed
            recheck_cpu_threads("sampling calibration text")
            sampler = load_model_from(source, dtype="float32", trust_remote_code=args.trust_remote_code).eval()
            calibration, mixed, sampled = sampled_calibration(args, sampler, tokenizer, calibration, self_share)
            del sampler
        calibration_info.update(mixed)
        for name, ids in evaluations.items():
            warn_if_fitted(name, ids, calibration)
        return _run_streamed(
            args, lock, calibration, evaluations, calibration_info, not isinstance(tokenizer, Exception), sampled
        )
    if isinstance(tokenizer, Exception):  # every text came as token ids
        tokenizer = None
    model = load_model_from(source, dtype="float32", trust_remote_code=args.trust_remote_code).eval()
    if self_share > 0.0:
        recheck_cpu_threads("sampling calibration text")
        calibration, mixed, sampled = sampled_calibration(args, model, tokenizer, calibration, self_share)
    calibration_info.update(mixed)
    if args.refit_holdout >= calibration.shape[0]:
        raise UsageError(f"--refit-holdout {args.refit_holdout} must leave calibration windows to fit on")
    for name, ids in evaluations.items():
        warn_if_fitted(name, ids, calibration)
    evaluation = next(iter(evaluations.values()), None)
    if text_settings is not None and text_settings.get("source") != model_fingerprint(model):
        raise UsageError(f"--heal-text {args.heal_text} was generated by another model than SRC; generate it anew")
    share = args.heal_calibration_share
    if heal_loss == "kd" and share is None and args.heal_text is not None and text_settings is None:
        share = 0.0  # a text file given to heal on replaces the generated text
    if args.heal_steps and heal_loss == "kd" and heal_data is None and share != 1.0:
        from ..compress.distill import teacher_text

        recheck_cpu_threads("sampling the teacher text")
        chosen = {k: getattr(args, f"heal_{k}") for k in ("samples", "length", "seed")}
        heal_data, text_settings = teacher_text(
            model, tokenizer, progress=True, **{k: v for k, v in chosen.items() if v is not None}
        )
    eval_before = {name: perplexity(model, ids, progress=True) for name, ids in evaluations.items()}
    options = _relational_options(args) | {"slice_fraction": args.slice_fraction} if args.method == "relational" else {}
    if args.heal_lr is not None:
        options["heal_lr"] = args.heal_lr
    if args.heal_batch_size is not None:
        options["heal_batch_size"] = args.heal_batch_size
    if share is not None:
        options["heal_calibration_share"] = share
    compressed, report = compress_model(
        model,
        tokenizer,
        remove=args.remove,
        method=args.method,
        calibration=calibration,
        heal_steps=args.heal_steps,
        heal_loss=heal_loss,
        heal_data=heal_data,
        progress=True,
        evaluation=evaluation if args.heal_steps else None,
        on_phase=recheck_cpu_threads,
        **options,
    )
    report["source"] = str(args.src)
    report["calibration"] = calibration_info
    mixed = (report.get("heal") or {}).get("text")
    mixed = {k: v for k, v in mixed.items() if k != "text"} if isinstance(mixed, dict) else {}
    if "heal" in report and text_settings is not None:
        report["heal"]["text"] = text_settings | {"file": TEACHER_TEXT_NAME} | mixed
    elif "heal" in report and args.heal_text is not None:
        report["heal"]["text"] = {"file": Path(args.heal_text).name, "tokens": int(heal_data.numel())} | mixed
    if evaluations:
        after = {name: perplexity(compressed, ids, progress=True) for name, ids in evaluations.items()}
        first = next(iter(evaluations))
        report["eval_file"] = first
        report["eval_windows"] = list(evaluations[first].shape)
        report["eval_perplexity_before"] = eval_before[first]
        report["eval_perplexity_after"] = after[first]
        report["eval"] = eval_table(eval_before, after, {n: list(ids.shape) for n, ids in evaluations.items()})

    def write(folder: Path) -> None:
        compressed.save_pretrained(folder)
        if tokenizer is not None:
            save_tokenizer(tokenizer, folder)
        if "heal" in report and text_settings is not None:
            save_teacher_text(folder / TEACHER_TEXT_NAME, heal_data, text_settings)
        save_sampled_calibration(folder, sampled, calibration_info)
        (folder / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    write_new_output(args.out, write, command="compress", kind=args.method, lock=lock)
    summary = (
        f"compressed {args.src} with {args.method}: {report['parameters_before']:,} -> {report['parameters_after']:,} "
        f"stored parameters ({report['removed_share']:.1%} fewer{gauge_note(report)}); calibration perplexity "
        f"{report['calibration_perplexity_before']:.2f} -> {report['calibration_perplexity_after']:.2f}"
    )
    summary += calibration_summary(calibration_info)
    if evaluations:
        summary += eval_summary(report["eval"], evaluations, calibration)
    if "heal" in report:
        summary += f" (after {args.heal_steps} {heal_loss} healing steps)"
    if tokenizer is None:
        summary += NO_TOKENIZER_NOTE
    print(summary + f"\nsaved to {args.out} (report: {Path(args.out) / REPORT_NAME})")
    return 0


def _relational_options(args: CompressArguments) -> dict:
    """The `LowRankOptions` fields of --method relational that both paths pass: the optional ones only when given,
    so that the library's defaults hold."""
    kinds = tuple(args.kinds) if list(args.kinds) != list(KINDS) else None
    given = {"gauge": args.gauge, "refit_prior": args.refit_prior, "width_multiple": args.width_multiple,
             "kinds": kinds, "refine_lr": args.refine_lr, "sensitivity": args.plan_error,
             "plan_windows": args.plan_windows}  # fmt: skip
    fixed = {"correction": args.correction, "mlp_order": args.mlp_order, "refit_holdout": args.refit_holdout,
             "refit_blend": args.refit_blend, "refine_epochs": args.refine_epochs}  # fmt: skip
    return fixed | {k: v for k, v in given.items() if v is not None}


def _run_streamed(
    args: CompressArguments,
    lock,
    calibration: torch.Tensor,
    evaluations: dict[str, torch.Tensor],
    calibration_info: dict,
    has_tokenizer: bool,
    sampled: torch.Tensor | None,
) -> int:
    """The layer-streamed compression (`jobs.compress_checkpoint`, --eval perplexities one layer at a time too)."""
    from ..jobs.compress import compress_checkpoint
    from .main import recheck_cpu_threads

    recheck_cpu_threads("compress")
    report = compress_checkpoint(
        args.local_gguf() or args.src, args.out, remove=args.remove, calibration=calibration, evaluations=evaluations,
        dtype=args.dtype,
        device="cuda" if torch.cuda.is_available() else None, max_shard_size=args.max_shard_size,
        trust_remote_code=args.trust_remote_code, lock=lock, **_relational_options(args),
        report_extra={"source": str(args.src), "calibration": calibration_info}
        | ({"eval_file": next(iter(evaluations))} if evaluations else {}),
        write_extra=lambda folder: save_sampled_calibration(folder, sampled, calibration_info),
    )
    summary = (
        f"compressed {args.src} one layer at a time: {report['parameters_before']:,} -> {report['parameters_after']:,} "
        f"stored parameters ({report['removed_share']:.1%} fewer{gauge_note(report)}); calibration perplexity "
        f"{report['calibration_perplexity_before']:.2f} -> {report['calibration_perplexity_after']:.2f}; peak memory "
        f"{report['peak_rss_mib']:,.0f} MiB"
    )
    summary += calibration_summary(calibration_info)
    if evaluations:
        summary += eval_summary(report["eval"], evaluations, calibration)
    if not has_tokenizer:
        summary += NO_TOKENIZER_NOTE
    print(summary + f"\nsaved to {args.out} (report: {Path(args.out) / REPORT_NAME})")
    return 0
