"""llama.cpp itself runs the exported GGUF files (the `gguf` extra: llama.cpp's shared library as a prebuilt wheel,
reached through `relational_hf.convert.gguf_runtime`): for tiny relational models of every configuration the
exporter takes, llama.cpp's logits (all positions, 2 threads) match the plugin's to 1e-4 of the logit scale in f32,
its greedy continuation (decoded a token at a time with its cache) is the plugin's, llama.cpp's own quantiser runs
on the exported files, and it tokenizes text with the byte-level tokenizer of `relational-hf train` into the same
ids as Transformers. Skipped, naming the extra, where llama.cpp cannot be imported."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gguf_helpers import CASES, compressed_model, plugin_logits, relative_difference, tiny_case

from relational_hf.convert import gguf_runtime

pytestmark = pytest.mark.skipif(
    not gguf_runtime.available() or importlib.util.find_spec("gguf") is None,
    reason=f"llama.cpp checks need the gguf extra: {gguf_runtime.INSTALL_HINT}",
)

PROMPT = [1, 40, 7, 200, 13, 13, 90, 250, 3, 64, 128, 5]
NEW_TOKENS = 8


def _export(model, path, outtype="f32"):
    from relational_hf.convert.gguf_export import export_gguf
    from relational_hf.lm.data import byte_level_tokenizer

    export_gguf(model, path, outtype=outtype, tokenizer=byte_level_tokenizer())
    return path


@torch.no_grad()
def _plugin_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", [*CASES, "compressed"])
def test_llama_cpp_gives_the_plugin_logits_and_greedy_tokens(name, tmp_path):
    model = compressed_model() if name == "compressed" else tiny_case(name)
    path = _export(model, tmp_path / f"{name}.gguf")
    with gguf_runtime.LlamaCpp(path, n_ctx=64, threads=2, f32_cache=True) as llm:
        logits = torch.from_numpy(llm.logits(PROMPT)).double()
        greedy = llm.greedy(PROMPT, NEW_TOKENS)
    reference = plugin_logits(model, torch.tensor(PROMPT))
    assert logits.shape == reference.shape
    assert relative_difference(logits, reference) < 1e-4
    assert greedy == _plugin_greedy(model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_llama_cpp_runs_the_smaller_types_close_to_the_plugin(outtype, tmp_path):
    model = tiny_case("pivot-per-layer-widths")
    with gguf_runtime.LlamaCpp(_export(model, tmp_path / f"{outtype}.gguf", outtype), n_ctx=64) as llm:
        logits = torch.from_numpy(llm.logits(PROMPT)).double()
    assert relative_difference(logits, plugin_logits(model, torch.tensor(PROMPT))) < 3e-2


def test_llama_cpp_quantiser_runs_on_an_exported_file(tmp_path):
    """llama.cpp's own quantiser takes the exported file (rows too short for its blocks fall back to a type of
    llama.cpp's choice) and the quantised model still predicts like the plugin's."""
    model = tiny_case("pivot-gqa-tied")
    src = _export(model, tmp_path / "f32.gguf")
    dst = tmp_path / "q8.gguf"
    gguf_runtime.quantize(src, dst, "Q8_0")
    assert dst.stat().st_size < src.stat().st_size
    with gguf_runtime.LlamaCpp(dst, n_ctx=64) as llm:
        logits = torch.from_numpy(llm.logits(PROMPT)).double()
    assert relative_difference(logits, plugin_logits(model, torch.tensor(PROMPT))) < 3e-2
    with pytest.raises(ValueError, match="unknown llama.cpp type"):
        gguf_runtime.quantize(src, tmp_path / "x.gguf", "Q4_X")


def test_llama_cpp_perplexity_is_the_plugins(tmp_path):
    """Perplexity computed by llama.cpp on windows of token ids equals the plugin's on the same ids (f32)."""
    model = tiny_case("free-untied")
    generator = torch.Generator().manual_seed(3)
    windows = torch.randint(3, 259, (3, 24), generator=generator)
    with torch.no_grad():
        out = model(windows, labels=windows)
    with gguf_runtime.LlamaCpp(_export(model, tmp_path / "m.gguf"), n_ctx=64, f32_cache=True) as llm:
        ours = llm.perplexity(windows.tolist())
    assert abs(ours / float(torch.exp(out.loss)) - 1) < 1e-4


def test_llama_cpp_tokenizes_like_the_byte_level_tokenizer(tmp_path):
    """The same ids for plain text, and for special tokens written in the text (which Transformers parses by
    default: llama.cpp with parse_special)."""
    from relational_hf.lm.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    with gguf_runtime.LlamaCpp(_export(tiny_case("pivot-gqa-tied"), tmp_path / "bytes.gguf"), n_ctx=64) as llm:
        for text in ["Hello, world!", "  two  spaces\nand a line", "digits 12345 and ünïcödé ✓ 日本", "'s 've <s>x"]:
            want = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert llm.tokenize(text, parse_special=True) == want, text
            assert llm.detokenize(want) == text


TEXTS = [
    "Hello, world! It's 2026 and we've got 12345 reasons.",
    "  indented\n\tcode(x) -> {'a': [1, 2]}  # comment",
    "ünïcödé ✓ 日本語のテキスト and émojis 🙂🙂",
    "<|im_start|>user\nHi there<|im_end|>\n",
]


def test_llama_cpp_tokenizes_like_smollm2s_tokenizer(smollm2_dir, tmp_path):
    """SmolLM2's own BPE tokenizer, written as GGUF vocabulary: llama.cpp gives the ids Transformers gives, for
    prose, code, non-Latin text and the chat template's special tokens."""
    from transformers import AutoTokenizer

    from relational_hf.convert.gguf_export import export_gguf
    from relational_hf.modeling import RelationalConfig, RelationalForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = RelationalConfig(
        vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    path = tmp_path / "vocab.gguf"
    export_gguf(RelationalForCausalLM(config).eval(), path, outtype="f32", tokenizer=tokenizer)
    with gguf_runtime.LlamaCpp(path, n_ctx=64) as llm:
        for text in TEXTS:
            want = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert llm.tokenize(text, parse_special=True) == want, text


def test_export_command_quantizes_with_llama_cpp(tmp_path, capsys):
    """`export --to gguf --quantize Q8_0` writes the llama.cpp-quantised file (predicting like the plugin) and nothing
    else in the folder, and names the SwiGLU widths its block does not divide with the --width-multiple that would;
    an unknown type is refused in one line before anything is written."""
    from relational_hf.commands.main import main

    model = tiny_case("pivot-per-layer-widths")
    src = tmp_path / "src"
    model.save_pretrained(src)
    capsys.readouterr()
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    assert main(["export", str(src), str(out), "--to", "gguf", "--quantize", "q4_x"]) == 2
    err = capsys.readouterr().err
    assert "Q4_K_M" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    assert main(["export", str(src), str(out), "--to", "gguf", "--quantize", "Q8_0"]) == 0
    printed = capsys.readouterr().out
    assert "Q8_0 (llama.cpp's quantiser" in printed
    assert "rows of length [24, 40]" in printed and "--width-multiple 32` makes the SwiGLU widths [24, 40]" in printed
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]
    with gguf_runtime.LlamaCpp(out, n_ctx=64) as llm:
        logits = torch.from_numpy(llm.logits(PROMPT)).double()
    assert relative_difference(logits, plugin_logits(model, torch.tensor(PROMPT))) < 3e-2
