"""`relational-hf export SRC OUT.gguf --to gguf`: the GGUF branch of the export command (`commands.export`).

Order: SRC resolved and its config read; everything GGUF cannot hold refused in one line (a SRC that is not
relational: convert it first; a config field with no llama.cpp form: named) before OUT is touched; OUT classified
by the rule of `relational_hf.outputs.paths` and locked against a second writer; the file written a tensor at a time
(a local safetensors folder a decoder layer at a time) and renamed into place (`relational_hf.convert.gguf_export`).
"""

from __future__ import annotations

import importlib.util
import sys


def run_gguf(args) -> int:
    from ..convert.gguf_export import export_gguf, require_gguf
    from ..convert.gguf_layout import GGUFExportError, gguf_refusal
    from ..errors import UsageError
    from ..loading import load_config_from, load_model_from, load_tokenizer_from, resolve_model_source
    from ..outputs import OutputLock
    from ..outputs.paths import file_target
    from ..shards import is_safetensors_checkpoint

    require_gguf()
    source = resolve_model_source(args.src)
    if source.gguf_file is not None:
        raise GGUFExportError(
            f"SRC {args.src} is a GGUF file already; export takes a relational checkpoint (`relational-hf convert` a "
            "Llama-family model first)"
        )
    config = load_config_from(source, trust_remote_code=args.trust_remote_code)
    reason = gguf_refusal(config)
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
        report = export_gguf(
            model,
            target.path,
            outtype=args.outtype,
            tokenizer=tokenizer,
            config=config,
            trust_remote_code=args.trust_remote_code,
        )
    sys.stdout.write(report.to_markdown())
    sys.stdout.write(f"saved {report.path} (runs in llama.cpp: llama-cli -m {report.path})\n")
    if importlib.util.find_spec("llama_cpp") is None:
        sys.stdout.write(
            "llama-cpp-python is not installed: pip install 'relational-hf[gguf]' runs the file from Python "
            "(llama_cpp.Llama) and the checks of tests/test_gguf_llama_cpp.py\n"
        )
    return 0
