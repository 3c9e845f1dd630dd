"""`relational-hf export SRC OUT.gguf --to gguf`: the GGUF branch of the export command (`commands.export`).

Order: SRC resolved and its config read; everything GGUF cannot hold refused in one line (a SRC that is not
relational: convert it first; a config field with no llama.cpp form: named) before OUT is touched; OUT classified
by the rule of `relational_hf.outputs.paths` and locked against a second writer; the file written a tensor at a time
(a local safetensors folder a decoder layer at a time) and renamed into place (`relational_hf.convert.gguf_export`).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from ..convert import gguf_runtime


def run_gguf(args) -> int:
    from ..convert.gguf_export import export_gguf, require_gguf
    from ..convert.gguf_layout import GGUFExportError, gguf_refusal
    from ..errors import UsageError
    from ..loading import load_config_from, load_model_from, load_tokenizer_from, resolve_model_source
    from ..outputs import OutputLock
    from ..outputs.paths import file_target
    from ..shards import is_safetensors_checkpoint

    require_gguf()
    quantize_type = _check_quantize(args)
    source = resolve_model_source(args.src)
    if source.gguf_file is not None:
        raise GGUFExportError(
            f"SRC {args.src} is a GGUF file already; export takes a relational checkpoint (`relational-hf convert` a "
            "Llama-family model first)"
        )
    config = load_config_from(source, trust_remote_code=args.trust_remote_code)
    reason = gguf_refusal(config, args.pad_mlp)
    if reason is not None:
        raise GGUFExportError(reason)
    target = file_target(args.out, "OUT")
    if target.is_stream:
        raise UsageError(
            f"OUT {args.out}: a GGUF file is written to a file path, not to a stream (nothing was written)"
        )
    try:
        tokenizer = load_tokenizer_from(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, TypeError):
        tokenizer = None
        sys.stderr.write(f"no tokenizer found at {args.src}; {args.out} holds no vocabulary (token ids only)\n")
    with OutputLock(target.path):
        if source.local and is_safetensors_checkpoint(source.location):
            model = source.location  # read a decoder layer at a time
        else:
            model = load_model_from(source, dtype="float32", trust_remote_code=args.trust_remote_code)
        export = dict(
            outtype=args.outtype, tokenizer=tokenizer, config=config, trust_remote_code=args.trust_remote_code,
            pad_mlp=args.pad_mlp,
        )
        if quantize_type is None:
            report = export_gguf(model, target.path, **export)
        else:
            report = _export_quantized(model, target.path, quantize_type, export)
    sys.stdout.write(report.to_markdown())
    sys.stdout.write(f"saved {report.path} (runs in llama.cpp: llama-cli -m {report.path})\n")
    if not gguf_runtime.available():
        sys.stdout.write(
            f"llama.cpp is not installed here, so the file was not run: {gguf_runtime.INSTALL_HINT} runs it from "
            "Python (relational_hf.convert.gguf_runtime) and the checks of tests/test_gguf_llama_cpp.py\n"
        )
    return 0


def _check_quantize(args) -> str | None:
    """The llama.cpp type of --quantize, upper-cased; refused in one line before any work when it is unknown, when
    llama.cpp is not installed, or when --outtype is already quantised."""
    from ..convert.gguf_layout import GGUFExportError

    if args.quantize is None:
        return None
    name = args.quantize.upper()
    if name not in gguf_runtime.FILE_TYPES:
        raise GGUFExportError(
            f"--quantize {args.quantize}: unknown llama.cpp type; choose one of {', '.join(gguf_runtime.FILE_TYPES)}"
        )
    if args.outtype == "q8_0":
        raise GGUFExportError("--quantize quantises from --outtype f32, f16 or bf16, not from q8_0")
    if not gguf_runtime.available():
        raise GGUFExportError(f"--quantize {name} runs llama.cpp's quantiser, which is not installed: {gguf_runtime.INSTALL_HINT}")
    return name


def _export_quantized(model, path: Path, file_type: str, export: dict):
    """Export at --outtype to a temporary sibling, quantise it with llama.cpp into a second one, rename that over
    `path`; the report names the tensors llama.cpp could not give `file_type` (rows not a multiple of its block)."""
    from ..convert.gguf_export import export_gguf
    from ..convert.gguf_layout import gguf_layout, tensor_shapes
    from ..outputs.files import TAG, fsync_dir, publish_file

    stem = f".{path.name}.{TAG}-tmp-{secrets.token_hex(4)}"
    plain, quantized = path.with_name(stem + ".src"), path.with_name(stem)
    try:
        report = export_gguf(model, plain, **export)
        gguf_runtime.quantize(plain, quantized, file_type)
        publish_file(quantized, path)
    finally:
        for tmp in (plain, quantized):
            if os.path.lexists(tmp):
                tmp.unlink()
    fsync_dir(path.parent)
    block = gguf_runtime.BLOCK_SIZES[file_type]
    layout = gguf_layout(export["config"] if export.get("config") is not None else model.config, export.get("pad_mlp", False))
    short = sorted({s[-1] for _, s in tensor_shapes(layout) if len(s) > 1 and s[-1] % block})
    report.outtype = f"{file_type} (llama.cpp's quantiser, from {report.outtype})"
    report.path, report.file_bytes = str(path), path.stat().st_size
    if short:
        mlp = sorted(w for w in short if w in set(layout.feed_forward) and w != layout.hidden_size)
        fixed = sorted(w for w in short if w not in mlp)
        report.notes.append(
            f"rows of length {short} are not multiples of {block}: llama.cpp keeps those tensors in a fallback type"
            + (f" (the model width {layout.hidden_size}, which no option changes)" if layout.hidden_size in fixed else "")
            + (f"; `compress --width-multiple {block}` makes the SwiGLU widths {mlp} multiples of it" if mlp else "")
        )
    return report
