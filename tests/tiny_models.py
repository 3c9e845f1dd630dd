"""The tests' one home of tiny models (every supported family at d = 32, 2 layers, 4 heads) and a learnable toy
dataset."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from relational_hf import RelationalConfig, RelationalForCausalLM

VOCAB = 48
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)

#: Llama-layout families: (config class, model class), built from TINY plus overrides.
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "relational": (RelationalConfig, RelationalForCausalLM),
}


def tiny_model(family: str, seed: int | None = None, **overrides) -> PreTrainedModel:
    """A freshly initialised tiny causal LM of `family` ("gpt2" or a key of FAMILIES): the TINY dimensions with
    `overrides` (any config field, e.g. vocab_size, num_key_value_heads, gauge); GPT-2 takes d = 32, 2 layers,
    4 heads, 64 positions and its own field names in `overrides`. `seed` re-seeds torch first."""
    if seed is not None:
        torch.manual_seed(seed)
    if family == "gpt2":
        gpt2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(GPT2Config(**(gpt2 | overrides)))
    config_class, model_class = FAMILIES[family]
    return model_class(config_class(**(TINY | overrides)))


def tiny_relational(gauge: str = "free", seed: int | None = None, **overrides) -> RelationalForCausalLM:
    """d = 32, 2 layers, 4 heads, vocabulary 48; `seed` re-seeds torch first (else the test's seed applies)."""
    return tiny_model("relational", seed=seed, gauge=gauge, **overrides)


def tiny_llama() -> LlamaForCausalLM:
    """Transformers' Llama at the tiny size, GQA with 2 key/value heads."""
    return tiny_model("llama", num_key_value_heads=2)


def periodic_data(n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """Learnable sequences: a period-7 cycle at random offsets (token ids 3..9)."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(n):
        ids = (torch.arange(length) + torch.randint(0, 7, (1,), generator=g)) % 7 + 3
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def stored_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in the checkpoint folder `path`, by name (as written, no model)."""
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


#: the relational configurations the generic-contract tests run (tests/test_contract*.py): pivot gauge, free gauge,
#: value-space parallel removal, thin keys with GQA; CONTRACT_VOCAB tokens, ids 0-2 reserved (pad, bos, eos)
CONTRACT_VOCAB = 61
CONTRACT_BASE = dict(
    vocab_size=CONTRACT_VOCAB,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
CONTRACT_CONFIGS = {
    "pivot": dict(),
    "free": dict(gauge="free"),
    "value_removal": dict(value_parallel_removal=True),
    "thin_keys_gqa": dict(num_key_value_heads=2, qk_rank=4),
}


def run_on_two_processes(worker: str, out_dir, master_port: int, timeout: float) -> None:
    """Start `worker` (a test file that is also a torchrun worker) on 2 gloo processes with OUT_DIR = `out_dir`, one
    thread each; fails the test with the end of both outputs when the launch does not exit 0.

    A launch whose worker was killed by a signal inside native code is run once more, from the folder as it was before
    the launch and on the next port, with a warning that holds the crash's stacks (PYTHONFAULTHANDLER). CI saw it once:
    a worker of tests/test_fsdp.py died of a segmentation fault in a collective after its first training run, the other
    then reading a closed connection; 25 launches in a row beside a two-thread load did not repeat it. A second crash,
    a worker's own error (a failed assertion is a result) or a timeout fails the test."""
    import os
    import shutil
    import subprocess
    import sys
    import warnings
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(Path.cwd())}
    env["PYTHONFAULTHANDLER"] = "1"  # a crash in native code prints every thread's Python stack
    before = set(Path(out_dir).iterdir())
    for attempt in range(2):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(master_port + attempt), worker, str(out_dir),
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        output = done.stdout[-4000:] + done.stderr[-4000:]
        if done.returncode == 0 or attempt or not killed_by_a_signal(done.stderr):
            break
        warnings.warn(f"a torchrun worker was killed by a signal; launching once more:\n{output}", stacklevel=2)
        for path in set(Path(out_dir).iterdir()) - before:  # what the crashed launch wrote, in the test's own folder
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert done.returncode == 0, output


def killed_by_a_signal(launcher_stderr: str) -> bool:
    """Whether torchrun's failure summary names a worker that died by a signal (a negative exit code), as opposed to
    one that raised (exit code 1) or a launch that did not start."""
    import re

    return re.search(r"exitcode\s*:\s*-\d+ .*\((SIGSEGV|SIGBUS|SIGABRT|SIGILL)\)", launcher_stderr) is not None
