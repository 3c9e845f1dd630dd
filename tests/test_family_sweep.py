"""Every popular decoder-only family of Transformers, as a user meets it: a tiny random checkpoint built generically
from the family's own config class and saved with `save_pretrained`, then `redundancy`, `analyze` and `convert`
through the command line. Each command either succeeds or exits 2 with one line `relational-hf <command>: error: ...`
(an exception escaping `main` fails the test, so no traceback can reach the user); a family with an architecture
adapter must succeed in the commands that read the model as it is."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from relational_hf.architectures import UnsupportedModelError, get_adapter
from relational_hf.commands import main as cli

VOCAB = 64
#: the same small sizes for every family, under Transformers' common field names (a config maps its own aliases)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
#: a model larger than this was not made tiny by the common fields (its sizes have other names): skipped
MAX_PARAMETERS = 1_000_000

#: popular decoder-only families (model_type): Llama-likes, MoE, LayerNorm families, Gemma, Phi, state-space models
FAMILIES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "smollm3", "gemma", "gemma2", "gemma3_text",
    "phi", "phi3", "gpt2", "gpt_neox", "gptj", "gpt_neo", "gpt_bigcode", "opt", "bloom", "falcon", "starcoder2",
    "stablelm", "olmo", "olmo2", "granite", "cohere", "mamba",
)  # fmt: skip
#: the families this project supports for analysis: redundancy and analyze must succeed on them
ANALYSED = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gpt2", "gpt_neox", "gemma3_text"}


def test_the_families_are_causal_lms_transformers_knows():
    assert set(FAMILIES) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert ANALYSED <= set(FAMILIES)


def tiny_checkpoint(model_type: str, folder) -> torch.nn.Module:
    """The family's causal LM at the TINY sizes, saved to `folder`; skips (with the reason) a family whose config
    cannot be built from the common fields or whose model stays large."""
    try:
        config = CONFIG_MAPPING[model_type](**TINY)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - any refusal of the generic sizes means: not buildable generically
        pytest.skip(f"{model_type}: its config cannot be built from the common fields ({type(err).__name__})")
    size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMETERS:
        pytest.skip(f"{model_type}: {size:,} parameters; its sizes have other field names")
    model.save_pretrained(folder)
    return model


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_success_or_one_line(command: str, code: int, err: str) -> None:
    if code == 0:
        return
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith(f"relational-hf {command}: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("model_type", FAMILIES)
def test_redundancy_analyze_convert_succeed_or_refuse_in_one_line(model_type, tmp_path):
    src = tmp_path / "src"
    model = tiny_checkpoint(model_type, src)
    ids = tmp_path / "ids.pt"
    torch.save(torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(0)), ids)
    commands = {
        "redundancy": ["redundancy", str(src), "--no-descriptors"],
        "analyze": [
            "analyze", str(src), "--text", str(ids), "--out", str(tmp_path / "analysis"), "--seq-len", "16",
            "--sweep-values", "0", "--no-per-layer", "--compression", "none",
        ],
        "convert": ["convert", str(src), str(tmp_path / "converted")],
    }  # fmt: skip
    results = {name: run(argv) for name, argv in commands.items()}
    for name, (code, _, err) in results.items():
        assert_success_or_one_line(name, code, err)
    try:
        get_adapter(model)
        adapted = True
    except UnsupportedModelError:
        adapted = False
    assert adapted == (model_type in ANALYSED)
    if adapted:
        for name in ("redundancy", "analyze"):
            assert results[name][0] == 0, results[name][2]
        assert "redundant" in results["redundancy"][1]
    else:  # refused as unsupported, naming the class
        for name in ("redundancy", "analyze", "convert"):
            assert type(model).__name__ in results[name][2], results[name][2]
