"""The main job (`relational-hf train`): it trains, beats the unigram baseline, saves a loadable checkpoint."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relational_hf.commands import main as cli
from relational_hf.lm.data import byte_level_tokenizer, generate_corpus, split_text, unigram_perplexity


def test_train_command_saves_a_checkpoint_the_auto_classes_load(tmp_path, capsys):
    out = tmp_path / "ckpt"
    code = cli.main(
        [
            "train",
            "--max-steps",
            "30",
            "--batch-size",
            "8",
            "--block-size",
            "64",
            "--layers",
            "2",
            "--output-dir",
            str(out),
            "--sample-tokens",
            "20",
            "--eval-blocks",
            "8",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "validation perplexity" in printed and "unigram perplexity" in printed
    ppl = float(printed.split("validation perplexity:")[1].split()[0])
    unigram = float(printed.split("unigram perplexity of the corpus:")[1].split(";")[0])
    assert ppl < unigram  # even 30 steps learn more than token frequencies
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("ada lives by the", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    assert (out / "trainer_state").is_dir()  # resumable trainer checkpoints kept beside the model


def test_train_file_and_offline_dataset_errors(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert cli.main(["train", "--train-file", str(short), "--output-dir", str(tmp_path / "x")]) == 2
    assert "need at least 1000" in capsys.readouterr().err
    assert cli.main(["train", "--train-file", str(tmp_path / "nope.txt")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert cli.main(["train", "--dataset", "surely-not-a-dataset-name-xyz", "--output-dir", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "could not load dataset 'surely-not-a-dataset-name-xyz'" in err and "Traceback" not in err


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_level_tokenizer()
    text = "naïve café — 12 + 30 = 42\n\ttabs & ünïcødé ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert len(tok) == 259


def test_generated_corpus_is_deterministic_and_learnable_baseline():
    a, b = generate_corpus(500, seed=3), generate_corpus(500, seed=3)
    assert a == b and a != generate_corpus(500, seed=4)
    train, val = split_text(a)
    assert train + val == a and train.endswith("\n")
    tok = byte_level_tokenizer()
    tr = torch.tensor(tok(train, add_special_tokens=False)["input_ids"])
    va = torch.tensor(tok(val, add_special_tokens=False)["input_ids"])
    # unigram perplexity is bounded by the vocabulary and above 1 for any non-trivial text
    assert 1.0 < unigram_perplexity(tr, va, len(tok)) < len(tok)
