"""Lengths beyond the model's context (`max_position_embeddings`): Transformers runs such positions without a word,
so every command that takes a length of text for a model (`evaluate --window`, `compress --window` and
`--heal-length`, `finetune --block-size`, `analyze --seq-len`) warns in one line naming the flag and the context, and still runs; within
the context nothing is said."""

from __future__ import annotations

import logging

from relational_hf.commands.main import main
from relational_hf.loading import warn_beyond_context

CONTEXT = 64  # the byte_llama_checkpoint fixture's max_position_embeddings


def _warnings(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "context" in r.getMessage()]
    caplog.clear()
    return lines


def _text(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    return str(text)


def test_the_helper_names_each_flag_beyond_the_context():
    class Config:
        max_position_embeddings = 100

    lines = warn_beyond_context(Config(), {"--window": 101, "--block-size": 100, "--heal-length": None}, "SRC")
    assert lines == [
        "--window 101 is longer than SRC's context (max_position_embeddings 100): positions beyond it were never trained"
    ]
    assert warn_beyond_context(object(), {"--window": 10**6}) == []  # a config without a context length: nothing


def test_evaluate_warns_beyond_the_context_and_still_measures(byte_llama_checkpoint, tmp_path, caplog, capsys):
    text = _text(tmp_path)
    assert main(["evaluate", str(byte_llama_checkpoint), "--text", text, "--window", str(CONTEXT)]) == 0
    assert _warnings(caplog) == []
    assert main(["evaluate", str(byte_llama_checkpoint), "--text", text, "--window", str(2 * CONTEXT)]) == 0
    (line,) = _warnings(caplog)
    assert line.startswith(f"--window {2 * CONTEXT} is longer than the model's context (max_position_embeddings 64)")
    assert "perplexity" in capsys.readouterr().out


def test_compress_warns_for_the_healing_text_length(byte_llama_checkpoint, tmp_path, caplog, capsys):
    argv = [
        "compress", str(byte_llama_checkpoint), str(tmp_path / "out"), "--remove", "0.1", "--calibration",
        _text(tmp_path), "--window", "32", "--calibration-windows", "4", "--heal-steps", "1", "--heal-samples", "2",
        "--heal-length", str(CONTEXT + 16),
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    (line,) = _warnings(caplog)
    assert line.startswith(f"--heal-length {CONTEXT + 16} is longer than SRC's context")


def test_finetune_warns_for_the_block_size(byte_llama_checkpoint, tmp_path, caplog, capsys):
    argv = [
        "finetune", str(byte_llama_checkpoint), "--train-file", _text(tmp_path), "--block-size", str(CONTEXT + 8),
        "--eval-blocks", "1", "--max-steps", "1", "--output-dir", str(tmp_path / "ft"),
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    (line,) = _warnings(caplog)
    assert line.startswith(f"--block-size {CONTEXT + 8} is longer than the model's context")


def test_analyze_warns_for_the_row_length(byte_llama_checkpoint, tmp_path, caplog, capsys):
    argv = [
        "analyze", str(byte_llama_checkpoint), "--text", _text(tmp_path), "--out", str(tmp_path / "an"), "--seq-len",
        str(CONTEXT * 2), "--max-tokens", str(CONTEXT * 4), "--sites", "block", "--no-per-layer",
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    (line,) = _warnings(caplog)
    assert line.startswith(f"--seq-len {CONTEXT * 2} is longer than the model's context")
