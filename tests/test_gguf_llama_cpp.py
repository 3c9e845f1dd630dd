"""llama.cpp itself runs the exported GGUF files (the `gguf` extra: llama-cpp-python, built from its source
distribution): for tiny relational models of every configuration the exporter takes, llama.cpp's logits (all
positions, 2 threads) match the plugin's to 1e-4 of the logit scale in f32, its greedy continuation is the plugin's,
and it tokenizes text with the byte-level tokenizer of `relational-hf train` into the same ids as Transformers.
Skipped, naming the extra, where llama_cpp cannot be imported."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf_helpers import CASES, compressed_model, plugin_logits, relative_difference, tiny_case

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None,
    reason="llama.cpp checks need the gguf extra: pip install 'relational-hf[gguf]' (builds llama-cpp-python)",
)

PROMPT = [1, 40, 7, 200, 13, 13, 90, 250, 3, 64, 128, 5]
NEW_TOKENS = 8


def _llama(path):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=2, logits_all=True, verbose=False, seed=0)


def _export(model, path, outtype="f32"):
    from relational_hf.convert.gguf_export import export_gguf
    from relational_hf.lm.data import byte_level_tokenizer

    export_gguf(model, path, outtype=outtype, tokenizer=byte_level_tokenizer())
    return path


def _llama_cpp_logits_and_greedy(path, prompt, steps):
    llm = _llama(path)
    llm.reset()
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)], dtype=np.float64)
    greedy = []
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(token)
        llm.eval([token])
    return torch.from_numpy(logits), greedy


@torch.no_grad()
def _plugin_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", [*CASES, "compressed"])
def test_llama_cpp_gives_the_plugin_logits_and_greedy_tokens(name, tmp_path):
    model = compressed_model() if name == "compressed" else tiny_case(name)
    path = _export(model, tmp_path / f"{name}.gguf")
    logits, greedy = _llama_cpp_logits_and_greedy(path, PROMPT, NEW_TOKENS)
    reference = plugin_logits(model, torch.tensor(PROMPT))
    assert logits.shape == reference.shape
    assert relative_difference(logits, reference) < 1e-4
    assert greedy == _plugin_greedy(model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_llama_cpp_runs_the_smaller_types_close_to_the_plugin(outtype, tmp_path):
    model = tiny_case("pivot-per-layer-widths")
    logits, _ = _llama_cpp_logits_and_greedy(_export(model, tmp_path / f"{outtype}.gguf", outtype), PROMPT, 0)
    assert relative_difference(logits, plugin_logits(model, torch.tensor(PROMPT))) < 3e-2


def test_llama_cpp_tokenizes_like_the_byte_level_tokenizer(tmp_path):
    from relational_hf.lm.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    llm = _llama(_export(tiny_case("pivot-gqa-tied"), tmp_path / "bytes.gguf"))
    for text in ["Hello, world!", "  two  spaces\nand a line", "digits 12345 and ünïcödé ✓ 日本", "'s 've <s>x"]:
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) == want, text
        assert llm.detokenize(want).decode("utf-8") == text
