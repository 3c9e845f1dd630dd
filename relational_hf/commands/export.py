"""Write a relational checkpoint as a plain Transformers Llama checkpoint, which loads without the plugin and without
remote code.

    relational-hf export SRC OUT --to llama
    relational-hf export SRC OUT --to free
    relational-hf export SRC OUT --to qwen3 | smollm3 | phi3 | gpt2 | gpt_neox | gemma3
    relational-hf export SRC OUT.gguf --to gguf [--outtype f32|f16|bf16|q8_0] [--quantize Q4_K_M] [--pad-mlp]

The gauge-fixed factors are multiplied back out (`relational_hf.convert.export.to_llama`) and the result is checked
against the relational model's logits in fp32 before anything is written. `--to free` keeps the relational
architecture and writes every map as its full weight (the free gauge, `to_free_gauge`): a checkpoint for inference,
which reads the weights as stored (no gauge-fixed weight assembled), at the cost of the pivot entries stored again.
OUT must be new or empty; it is written beside and moved into place when complete. `--to gguf` writes one GGUF file
for llama.cpp instead (`relational_hf.convert.gguf_export`: architecture llama, or deci for per-layer widths; qwen3,
smollm3 and gemma3 for those families' conversions, `convert.gguf_families`; a checkpoint folder is read a layer at a
time), replaced atomically.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from .checks import check_model_argument
from .options import CommandArguments, PositiveFloat, option, positional

HELP = (
    "write a relational checkpoint as a plain Llama checkpoint (no plugin needed to load it), in the free gauge, or "
    "as a GGUF file for llama.cpp"
)


@dataclass
class ExportPaths:
    src: str = positional("a relational checkpoint: local folder or Hub id", "SRC")
    out: str = positional("new (or empty) output folder; with --to gguf the .gguf file to write", "OUT")


@dataclass
class ExportOptions:
    _argument_group_name = "export"

    to: Literal["llama", "free", "gguf", "qwen3", "smollm3", "phi3", "gpt2", "gpt_neox", "gemma3"] = option(
        "llama",
        "llama: a plain Llama checkpoint; free: the relational model with full maps, for inference; gguf: one GGUF "
        "file for llama.cpp; qwen3, smollm3, phi3: that family's Transformers class (uniform widths); gpt2, "
        "gpt_neox, gemma3: that class, for conversions of GPT-2, GPT-NeoX and Gemma 3 (narrower layers padded with "
        "zeros)",
    )
    outtype: Literal["f32", "f16", "bf16", "q8_0"] = option(
        "f16", "with --to gguf: the type of the weight matrices (q8_0: rows not a multiple of 32 long stay f16)"
    )
    quantize: str | None = option(
        None,
        "with --to gguf: quantise the file with llama.cpp's own quantiser to this type (e.g. Q4_K_M, Q8_0; needs the "
        "gguf extra); written from --outtype f16, or f32/bf16 when given",
        metavar="TYPE",
    )
    pad_mlp: bool = option(
        False,
        "with --to gguf: a compressed Qwen3, SmolLM3 or Gemma 3 conversion, whose layers keep different SwiGLU "
        "widths, written at the widest layer's width, the narrower layers padded with zero units (llama.cpp's qwen3, "
        "smollm3 and gemma3 hold one width; exact, but the padded units are stored again); llama and deci need none",
    )
    tolerance: PositiveFloat = option(1e-4, "max |logit difference| accepted (fp32)")
    trust_remote_code: bool = option(False, "passed to from_pretrained")


@dataclass
class ExportArguments(CommandArguments, ExportOptions, ExportPaths):
    POSITIONALS = ExportPaths
    PARSER_GROUPS = (ExportOptions,)


Arguments = ExportArguments


def run(args: ExportArguments) -> int:
    from ..loading import resolve_model_source
    from ..outputs import OutputLock, check_new_output

    args.src = check_model_argument(args.src, "SRC")
    for flag, given in (("--quantize", args.quantize is not None), ("--pad-mlp", args.pad_mlp)):
        if given and args.to != "gguf":
            from ..errors import UsageError

            raise UsageError(f"{flag} applies to --to gguf only (nothing was written)")
    if args.to == "gguf":
        from .export_gguf import run_gguf

        return run_gguf(args)
    check_new_output(args.out, "OUT", source=args.src)  # before loading anything
    with OutputLock(args.out) as lock:
        return _run(args, lock, resolve_model_source(args.src))


def _run(args: ExportArguments, lock, source) -> int:
    from ..convert.export import export_checkpoint
    from ..loading import load_model_from, load_tokenizer_from

    model = load_model_from(source, dtype="float32", trust_remote_code=args.trust_remote_code)
    try:
        tokenizer = load_tokenizer_from(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, TypeError):
        tokenizer = None
        sys.stderr.write(f"no tokenizer found at {args.src}; {args.out} has none\n")
    report = export_checkpoint(model, args.out, to=args.to, tokenizer=tokenizer, tolerance=args.tolerance, lock=lock)
    sys.stdout.write(report.to_markdown())
    if args.to != "free":
        sys.stdout.write(f"saved {args.out} (loads with AutoModelForCausalLM, no plugin, no remote code)\n")
    else:
        sys.stdout.write(f"saved {args.out} (a relational checkpoint in the free gauge: loads with AutoModelForCausalLM)\n")
    return 0
