"""Families close to the supported ones (Granite, OLMo 2, Cohere, StableLM), tiny checkpoints of Transformers' own
classes with random norm gains and biases: the commands that need an architecture adapter refuse them in one line
naming the feature no adapter models (never a traceback, never a silently wrong result, nothing written); the
commands that take any causal LM (evaluate, finetune) work on them."""

from __future__ import annotations

import pytest
import torch
from family_helpers import TINY, error_line, randomize, run, save, text_file
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
)

from relational_hf.architectures import UnsupportedModelError, get_adapter

#: family -> (config class, model class, extra settings that switch the family's own features on, a word of the
#: feature the refusal must name)
NEAR = {
    "granite": (GraniteConfig, GraniteForCausalLM, dict(embedding_multiplier=2.0, logits_scaling=3.0), "multipliers"),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, dict(), "post-norms"),
    "cohere": (CohereConfig, CohereForCausalLM, dict(logit_scale=0.5), "parallel"),
    "stablelm": (StableLmConfig, StableLmForCausalLM, dict(partial_rotary_factor=0.5), "partial rotary"),
}


@pytest.fixture(scope="module", params=list(NEAR))
def near(request, tmp_path_factory):
    config_class, model_class, extra, word = NEAR[request.param]
    torch.manual_seed(0)
    model = randomize(model_class(config_class(**(TINY | extra))))
    return request.param, save(model, tmp_path_factory.mktemp(request.param) / "src"), word, model


def test_the_adapter_lookup_names_the_missing_feature(near):
    _, _, word, model = near
    with pytest.raises(UnsupportedModelError, match=rf"^unsupported: {type(model).__name__} \(.*{word}"):
        get_adapter(model)


@pytest.mark.parametrize("command", ["redundancy", "redundancy_no_stream", "analyze", "convert", "convert_no_stream",
                                     "compress", "canonicalize", "finetune_projection"])  # fmt: skip
def test_commands_needing_an_adapter_refuse_in_one_line(near, command, tmp_path, capsys):
    name, src, word, _ = near
    out = tmp_path / "out"
    text = text_file(tmp_path)
    argv = {
        "redundancy": ["redundancy", src],
        "redundancy_no_stream": ["redundancy", src, "--no-stream"],
        "analyze": ["analyze", src, "--text", text, "--out", out, "--seq-len", 32, "--max-tokens", 64],
        "convert": ["convert", src, out],
        "convert_no_stream": ["convert", src, out, "--no-stream"],
        "compress": ["compress", src, out, "--remove", 0.1, "--calibration", text, "--window", 32],
        "canonicalize": ["canonicalize", src, out],
        "finetune_projection": ["finetune", src, "--train-file", text, "--max-steps", 1, "--block-size", 32,
                                "--output-dir", out, "--projection", "update"],
    }[command]  # fmt: skip
    _, err = run(argv, capsys, code=2)
    line = error_line(err)
    assert word in line, line
    assert not out.exists() or not any(out.iterdir())


def test_evaluate_and_finetune_take_them_as_any_causal_lm(near, tmp_path, capsys):
    _, src, _, _ = near
    text = text_file(tmp_path)
    out, _ = run(["evaluate", src, "--text", text, "--window", 32, "--windows", 2], capsys)
    assert "perplexity" in out
    argv = ["finetune", src, "--train-file", text, "--max-steps", 1, "--block-size", 32, "--eval-blocks", 1]
    run([*argv, "--output-dir", tmp_path / "tuned"], capsys)
    assert (tmp_path / "tuned" / "config.json").exists()
