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
