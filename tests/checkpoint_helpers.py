"""Helpers for the real-checkpoint and export tests (tests/ is on sys.path under pytest's default import mode).

`first_layers(folder, n)` loads only the first n decoder layers of a Llama-family checkpoint (fp32, eval).
`run_without_plugin(code, cwd)` starts `python -c` from `cwd` (a temporary folder, so the project is not on the
path), with PYTHONPATH removed, offline, a private Transformers modules cache, and `relational_hf` blocked in
`sys.modules` (the development environment may have the project installed). Returns the CompletedProcess;
stdin is closed, so any interactive "run custom code?" prompt fails instead of waiting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PRELUDE = (
    "import sys\n"
    "sys.modules['relational_hf'] = None\n"  # import relational_hf -> ImportError
    "import torch\n"
    "torch.set_num_threads(1)\n"
)


def run_without_plugin(code: str, cwd: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "hf_modules"), TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def first_layers(folder: Path, n: int):
    """The checkpoint in `folder` truncated to its first `n` decoder layers (the rest of the weights are not read
    into the model), fp32, eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = n
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the unused layers are reported as unexpected keys
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval()


def truncated_gguf(source: Path, target: Path, layers: int, tokenizer: bool = True) -> Path:
    """Write a copy of the GGUF file `source` that keeps only its first `layers` blocks (metadata, tokenizer and
    the non-block tensors unchanged, quantised data copied as stored). tokenizer=False leaves the tokenizer out and
    states the vocabulary size instead (a file that parses in a fraction of a second: the vocabulary is what makes
    parsing SmolLM2's header take seconds)."""
    import re

    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    writer = gguf.GGUFWriter(target, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if not tokenizer and field.name.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == block_count else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    if not tokenizer:
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        writer.add_uint32(gguf.Keys.LLM.VOCAB_SIZE.format(arch=arch), int(embedding.shape[-1]))
    block = re.compile(r"blk\.(\d+)\.")
    kept = [t for t in reader.tensors if not (m := block.match(t.name)) or int(m.group(1)) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return target
