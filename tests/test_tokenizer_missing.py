"""A checkpoint saved without its tokenizer files: no command treats the empty tokenizer Transformers may build for
it as the model's own (copying it would give the output a tokenizer that encodes every text to nothing)."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

from relational_hf.commands.main import main
from relational_hf.lm.data import byte_level_tokenizer
from relational_hf.loading import load_tokenizer_from, usable_tokenizer


@pytest.fixture
def bare_qwen2(tmp_path):
    """A Qwen2 checkpoint folder with its config and weights only (Transformers builds an empty Qwen2Tokenizer for
    such a folder rather than failing)."""
    src = tmp_path / "src"
    tiny_model("qwen2", seed=0, num_key_value_heads=2).save_pretrained(src)
    assert not [p for p in src.iterdir() if "token" in p.name]
    return src


def test_a_folder_without_tokenizer_files_has_no_tokenizer(bare_qwen2):
    with pytest.raises((ValueError, OSError), match="tokenizer"):
        load_tokenizer_from(str(bare_qwen2))


def test_a_real_tokenizer_passes_the_check_unchanged():
    tokenizer = byte_level_tokenizer()
    assert usable_tokenizer(tokenizer, "here") is tokenizer


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_convert_writes_no_tokenizer_for_a_folder_without_one(bare_qwen2, tmp_path, capsys, stream):
    """The converted checkpoint has no tokenizer files (rather than an empty tokenizer), the command says so, and the
    checkpoint loads."""
    out = tmp_path / "out"
    assert main(["convert", str(bare_qwen2), str(out), stream]) == 0
    assert "has none" in capsys.readouterr().err
    assert not [p.name for p in out.iterdir() if "token" in p.name]
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "relational-transformer"


def test_compress_refuses_a_source_without_a_tokenizer_in_one_line(bare_qwen2, tmp_path, capsys):
    """Where the text must be tokenized, the error names the missing tokenizer files (not "the text has 0 tokens"),
    and OUT is not created."""
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    code = main(["compress", str(bare_qwen2), str(out), "--remove", "0.1", "--calibration", str(text), "--window", "16"])
    err = capsys.readouterr().err
    assert code == 2 and "tokenizer files are missing" in err and "0 tokens" not in err, err
    assert "Traceback" not in err and not out.exists()


def test_a_tokenizer_that_cannot_encode_is_a_value_error_naming_the_place():
    class Broken:
        def __call__(self, text, **kwargs):
            raise RuntimeError("no model file")

        def __len__(self):
            return 10

    with pytest.raises(ValueError, match="SRC: the Broken found there cannot encode text"):
        usable_tokenizer(Broken(), "SRC")
