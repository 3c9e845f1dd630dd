"""The converter's exactness check on a real model (SmolLM2-135M-Instruct) and real text: it passes where the
conversion is exact (float32 rounding grows with length, depth and the size of the logits: about 1e-4 absolute on
512 tokens) and still refuses a conversion that changes the function."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import corpus_or_skip
from transformers import AutoModelForCausalLM, AutoTokenizer

import relational_hf.convert.relational as conversion
from relational_hf.convert import ConversionError, to_relational


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    wikitext = corpus_or_skip("wikitext-2")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = wikitext.read_text(encoding="utf-8")[:20000]
    ids = torch.tensor(tokenizer(text)["input_ids"][:512]).unsqueeze(0)
    assert ids.shape[1] == 512
    return model, tokenizer, ids


def _first_layers(model, n: int):
    small = copy.deepcopy(model)
    small.model.layers = small.model.layers[:n]
    small.config.num_hidden_layers = n
    if getattr(small.config, "layer_types", None) is not None:
        small.config.layer_types = small.config.layer_types[:n]
    return small


def test_check_on_real_text_is_relative_to_the_logit_scale(smollm2, monkeypatch):
    model, _, ids = smollm2
    source = _first_layers(model, 4)
    _, report = to_relational(source, verify_data=ids, return_report=True)
    assert report.verified_on == "the given text" and report.verified_sequence_length == 512
    assert report.logit_scale > 1.0  # real logits: the scale the rounding error is measured against
    assert report.relative_logit_difference <= 1e-5 < report.tolerance

    broken = _first_layers(model, 4)
    with torch.no_grad():  # a 1% change of one MLP: a real error, which the check must still catch
        broken.model.layers[2].mlp.down_proj.weight.mul_(1.01)
    real = conversion._fold_and_load
    monkeypatch.setattr(conversion, "_fold_and_load", lambda src, target: real(broken, target))
    with pytest.raises(ConversionError, match="logit scale"):
        to_relational(source, verify_data=ids)


def test_full_smollm2_conversion_is_exact_on_real_text(smollm2):
    model, tokenizer, ids = smollm2
    relational, report = to_relational(model, verify_data=ids, return_report=True)
    assert report.max_logit_difference <= 1e-3
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    expected = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(relational.generate(**prompt, max_new_tokens=12, do_sample=False), expected)
