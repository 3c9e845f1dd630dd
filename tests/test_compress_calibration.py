"""Calibration that generalises (`relational_hf.compress.calibration`) and the compression report across texts: the
user's windows mixed with text the source samples itself, interleaved so every prefix holds the mixture; the
automatic share; the `compress` command's --self-calibration and several --eval texts, in memory and streamed."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from relational_hf.compress.calibration import (
    AUTO_SELF_MAX_PARAMETERS,
    DEFAULT_SELF_SHARE,
    added_self_windows,
    approximate_parameters,
    deinterleave,
    interleave,
    mixed_calibration,
    resolve_self_share,
    sampled_calibration,
    self_windows_count,
)
from relational_hf.compress.eval import eval_table


def _rows(n: int, t: int, start: int) -> torch.Tensor:
    return torch.arange(start, start + n * t).view(n, t)


@pytest.mark.parametrize("sizes", [(5, 3), (1, 7), (4, 4, 4), (10, 1, 3)])
def test_interleave_keeps_every_row_once_in_order_and_every_prefix_in_proportion(sizes):
    """Each part's rows appear once each, in their order, and after k rows each part has given within one row of its
    share of k (the plan reads the first windows, the refinement holds the last ones back)."""
    parts = [_rows(n, 3, 1000 * i) for i, n in enumerate(sizes)]
    out = interleave(parts)
    total = sum(sizes)
    assert out.shape == (total, 3)
    owner = [int(row[0]) // 1000 for row in out]
    for i, part in enumerate(parts):
        mine = out[[j for j in range(total) if owner[j] == i]]
        assert torch.equal(mine, part)
    for k in range(1, total + 1):
        for i, n in enumerate(sizes):
            assert abs(owner[:k].count(i) - n / total * k) <= 1.0 + 1e-9


@pytest.mark.parametrize("sizes", [(5, 3), (0, 4), (3, 0), (4, 4, 4), (10, 0, 1, 3)])
def test_deinterleave_gives_the_parts_back(sizes):
    """`deinterleave(interleave(parts), sizes)` is `parts` (empty parts included, as empty tensors)."""
    parts = [_rows(n, 3, 1000 * i) for i, n in enumerate(sizes)]
    back = deinterleave(interleave(parts), list(sizes))
    assert len(back) == len(parts) and all(torch.equal(a, b) for a, b in zip(back, parts))
    for bad in ([*sizes[:-1], sizes[-1] + 1], [-1, sum(sizes) + 1]):
        with pytest.raises(ValueError, match="must be counts adding up"):
            deinterleave(interleave(parts), bad)


def test_interleave_refuses_windows_of_different_lengths():
    with pytest.raises(ValueError, match="one length"):
        interleave([_rows(2, 3, 0), _rows(2, 4, 100)])
    with pytest.raises(ValueError, match="at least one"):
        interleave([_rows(0, 3, 0)])


@pytest.mark.parametrize("n", [1, 2, 7, 128])
@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_self_windows_count_is_the_share_with_both_sides_present(n, share):
    k = self_windows_count(n, share)
    assert 0 <= k <= n
    assert abs(k - n * share) <= 1.0
    if share > 0:
        assert k >= 1
    if share < 1 and n > 1:
        assert k <= n - 1
    if share in (0.0, 1.0):
        assert k == round(n * share)


@pytest.mark.parametrize("n", [None, 8])
def test_mixed_calibration_takes_the_first_windows_of_each_side(n):
    """The result holds the first n - k user windows and the first k sampled rows, nothing else: by default every
    user window and as many sampled ones as make the share of the whole (`added_self_windows`); with n, sampled
    windows replace user ones. Share 0 and 1 give one side alone."""
    user, sampled = _rows(8, 4, 0), _rows(8, 4, 10_000)
    mixed, info = mixed_calibration(user, 0.25, n=n, sampled=sampled)
    total = 8 + added_self_windows(8, 0.25) if n is None else n
    k = self_windows_count(total, 0.25)
    assert info == {"self_share": 0.25, "self_windows": k, "user_windows": total - k}
    assert mixed.shape == (total, 4) and (n is not None or total - k == 8)
    rows = {tuple(r.tolist()) for r in mixed}
    assert rows == {tuple(r.tolist()) for r in user[: total - k]} | {tuple(r.tolist()) for r in sampled[:k]}
    alone, _ = mixed_calibration(user, 0.0)
    assert torch.equal(alone, user)
    own, info = mixed_calibration(None, 1.0, n=5, window=4, sampled=sampled)
    assert torch.equal(own, sampled[:5]) and info["user_windows"] == 0


@pytest.mark.parametrize("n_user", [1, 5, 64, 128])
@pytest.mark.parametrize("share", [0.1, 1 / 3, 0.5, 0.9])
def test_added_self_windows_make_the_share_of_the_whole(n_user, share):
    k = added_self_windows(n_user, share)
    assert k >= 1 and abs(k / (n_user + k) - share) <= 1 / (n_user + k)
    assert self_windows_count(n_user + k, share) == k or n_user + k <= 2


def test_mixed_calibration_keeps_the_share_when_the_user_text_is_short():
    user, sampled = _rows(2, 4, 0), _rows(16, 4, 10_000)
    mixed, info = mixed_calibration(user, 0.5, n=16, sampled=sampled)
    assert info["user_windows"] == 2 and info["self_windows"] == 8
    assert mixed.shape == (10, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"user": None, "share": 0.5}, "needs the user's calibration windows"),
        ({"user": _rows(4, 4, 0), "share": 1.5}, "share in"),
        ({"user": _rows(4, 4, 0), "share": True}, "share in"),
        ({"user": _rows(4, 4, 0).float(), "share": 0.5}, "LongTensor"),
        ({"user": _rows(4, 4, 0), "share": 0.5, "window": 8}, "not `window`"),
        ({"user": _rows(4, 4, 0), "share": 0.5}, "needs the source model"),
        ({"user": _rows(4, 4, 0), "share": 0.5, "sampled": _rows(1, 4, 0)}, "at least 4 rows"),
    ],
)
def test_mixed_calibration_refuses_bad_input_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mixed_calibration(**kwargs)


def test_resolve_self_share_given_automatic_and_large_models():
    assert resolve_self_share(0.3, True, 10**8) == (0.3, "given")
    assert resolve_self_share(None, True, 10**8)[0] == DEFAULT_SELF_SHARE
    assert resolve_self_share(None, False, 10**8)[0] == 1.0
    share, why = resolve_self_share(None, True, AUTO_SELF_MAX_PARAMETERS + 1)
    assert share == 0.0 and "more than" in why
    with pytest.raises(ValueError):
        resolve_self_share(-0.1, True, 10)


def _llama(seed: int = 0, vocab: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def test_approximate_parameters_is_close_to_the_real_count():
    model = _llama()
    real = sum(p.numel() for p in model.parameters())
    assert abs(approximate_parameters(model.config) - real) / real < 0.05


def test_sampled_calibration_is_reproducible_and_the_source_s_own():
    """The same seed gives the same windows; another seed or another model other windows; every row is `window`
    tokens of the model's vocabulary, and the settings name the source."""
    a, settings = sampled_calibration(_llama(0), None, n=3, window=16, seed=5, progress=False)
    b, _ = sampled_calibration(_llama(0), None, n=3, window=16, seed=5, progress=False)
    c, _ = sampled_calibration(_llama(0), None, n=3, window=16, seed=6, progress=False)
    d, other = sampled_calibration(_llama(1), None, n=3, window=16, seed=5, progress=False)
    assert a.shape == (3, 16) and a.dtype == torch.long and int(a.max()) < 64 and int(a.min()) >= 0
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    assert settings["source"] != other["source"] and settings["seed"] == 5


def test_eval_table_ratios_and_worst():
    table = eval_table({"a": 10.0, "b": 20.0}, {"a": 12.0, "b": 50.0}, {"a": [2, 8], "b": [2, 8]})
    assert table["texts"]["a"]["ratio"] == pytest.approx(1.2)
    assert table["texts"]["b"]["ratio"] == pytest.approx(2.5)
    assert table["worst_text"] == "b" and table["worst_ratio"] == pytest.approx(2.5)


# --------------------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def texts(tmp_path, byte_llama_checkpoint):
    """(SRC, a prose text, a code text): the tiny byte-level Llama and two unlike texts."""
    prose = tmp_path / "prose.txt"
    prose.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    code = tmp_path / "code.txt"
    code.write_text("def f(x):\n    return [i * x for i in range(10)]\n\n" * 40)
    return byte_llama_checkpoint, prose, code


COMMON = ["--remove", "0.2", "--window", "32", "--calibration-windows", "6", "--eval-windows", "2",
          "--refine-epochs", "0"]  # fmt: skip


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_cli_reports_every_eval_text_and_the_mixture(tmp_path, capsys, texts, mode):
    """Several --eval texts are each reported (perplexity before and after, their ratio) with the worst ratio; the
    first also under the single-text keys; the report says how the calibration was mixed (every --calibration window
    kept, as many sampled by SRC added at --self-calibration 0.5); both paths agree on all of it, to float
    tolerance."""
    from relational_hf.commands.main import main

    src, prose, code = texts
    args = [*COMMON, "--calibration", str(prose), "--eval", str(prose), "--eval", str(code), "--self-calibration", "0.5"]
    reports = {}
    for path in ("--stream", "--no-stream"):
        out = tmp_path / path.strip("-")
        assert main(["compress", str(src), str(out), *args, path]) == 0, capsys.readouterr().err
        summary = capsys.readouterr().out
        assert "prose.txt perplexity" in summary and "code.txt perplexity" in summary and "worst x" in summary
        assert "6 windows of prose.txt and 6 SRC sampled itself" in summary
        reports[path] = json.loads((out / "compression_report.json").read_text())
    report = reports[mode]
    assert report["calibration"]["self_windows"] == 6 and report["calibration"]["user_windows"] == 6
    assert report["calibration_windows"] == [12, 32]
    assert report["calibration"]["self_share"] == 0.5 and report["calibration"]["text"] == "prose.txt"
    texts = report["eval"]["texts"]
    assert set(texts) == {"prose.txt", "code.txt"}
    for row in texts.values():
        assert row["ratio"] == pytest.approx(row["perplexity_after"] / row["perplexity_before"])
    assert report["eval"]["worst_ratio"] == max(r["ratio"] for r in texts.values())
    assert report["eval_perplexity_after"] == texts["prose.txt"]["perplexity_after"]
    from relational_hf.hub import build_model_card

    card = str(build_model_card(tmp_path / mode.strip("-"), "someone/compressed"))
    section = card[card.index("## Compression") :]
    assert "12 windows of 32 tokens: 6 of `prose.txt` and 6 sampled from the source itself" in section
    for name, row in texts.items():  # every --eval text with the source's figure beside the checkpoint's
        line = next(x for x in section.splitlines() if x.startswith(f"| `{name}` |"))
        assert f"| {row['perplexity_before']:.2f} | {row['perplexity_after']:.2f} | x{row['ratio']:.2f} |" in line
    assert f"Worst ratio: x{report['eval']['worst_ratio']:.2f} (`{report['eval']['worst_text']}`)" in section
    assert str(tmp_path) not in card  # names only: no path of the machine that compressed
    a, b = reports["--stream"], reports["--no-stream"]
    assert a["widths"] == b["widths"]
    for name in texts:
        assert a["eval"]["texts"][name]["perplexity_after"] == pytest.approx(
            b["eval"]["texts"][name]["perplexity_after"], rel=1e-4
        )


def test_cli_several_calibration_texts_share_the_windows_interleaved(tmp_path, capsys, caplog, texts):
    """--calibration A B: the --calibration-windows are shared evenly among the texts and interleaved (the windows
    the compression fitted are those of each text, alternating); a text too short for its share gives what it holds
    and the others make up for it; the report names each text with its count, the card too; two texts with one name
    are refused in one line before any work. A text short of the whole count is not warned about when the others
    make up for it (each text used to be warned about against the whole count); a mixture short in all is, once."""
    from relational_hf.commands.compress_texts import user_calibration
    from relational_hf.commands.main import main
    from relational_hf.hub import build_model_card

    src, prose, code = texts
    tokenizer = AutoTokenizer.from_pretrained(src)
    windows, taken = user_calibration([str(prose), str(code)], tokenizer, 32, 6, len(tokenizer))
    alone = {name: user_calibration([str(p)], tokenizer, 32, 6, len(tokenizer))[0] for name, p in (("p", prose), ("c", code))}
    assert taken == {"prose.txt": 3, "code.txt": 3} and windows.shape == (6, 32)
    assert torch.equal(windows[0::2], alone["p"][:3]) and torch.equal(windows[1::2], alone["c"][:3])
    short = tmp_path / "short.txt"
    short.write_text("a tiny text, " * 5)  # one window of 32 bytes at most
    few = user_calibration([str(short)], tokenizer, 32, 6, len(tokenizer))[0].shape[0]
    assert f"asked for 6 windows of 32 tokens, the text has only {few}" in caplog.text  # alone, it is short
    caplog.clear()
    windows, taken = user_calibration([str(short), str(code)], tokenizer, 32, 6, len(tokenizer))
    assert taken == {"short.txt": few, "code.txt": 6 - few} and windows.shape[0] == 6
    assert "the text has only" not in caplog.text and "hold only" not in caplog.text  # made up for: nothing to warn
    all_of_code = user_calibration([str(code)], tokenizer, 32, 1000, len(tokenizer))[0].shape[0]
    caplog.clear()
    windows, _ = user_calibration([str(short), str(code)], tokenizer, 32, 1000, len(tokenizer))
    assert windows.shape[0] == few + all_of_code  # short in all: one warning with the totals, none per text
    assert f"asked for 1000 calibration windows of 32 tokens, the 2 texts hold only {few + all_of_code}" in caplog.text
    assert "the text has only" not in caplog.text

    out = tmp_path / "mixed"
    args = [*COMMON, "--calibration", str(prose), str(code), "--self-calibration", "0", "--eval", str(prose)]
    assert main(["compress", str(src), str(out), *args]) == 0, capsys.readouterr().err
    report = json.loads((out / "compression_report.json").read_text())
    assert report["calibration"]["texts"] == {"prose.txt": 3, "code.txt": 3}
    assert report["calibration"]["text"] == "prose.txt + code.txt" and report["calibration_windows"] == [6, 32]
    assert "3 of `prose.txt`, 3 of `code.txt`" in str(build_model_card(out, "someone/mixed"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "prose.txt").write_text("more prose " * 50)
    assert main(["compress", str(src), str(tmp_path / "x"), *COMMON, "--calibration", str(prose), str(other / "prose.txt")]) == 2
    err = capsys.readouterr().err
    assert "--calibration: two texts are named prose.txt" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_cli_keeps_the_sampled_windows_and_they_reproduce_the_compression(tmp_path, capsys, texts, mode):
    """OUT holds the windows SRC sampled (never the user's), as a file the report names; given back as a --calibration
    text beside the user's, with nothing sampled, they rebuild the very calibration: the same widths, the same
    calibration perplexity and the same weights. A .safetensors that is not such a file is refused in one line."""
    from tiny_models import stored_tensors

    from relational_hf.commands.compress_texts import SAMPLED_CALIBRATION_NAME
    from relational_hf.commands.main import main
    from relational_hf.compress.distill import load_teacher_text

    src, prose, code = texts
    first, again = tmp_path / "first", tmp_path / "again"
    args = [*COMMON, "--calibration", str(prose), mode]  # the default share: 6 user windows, 3 sampled added
    assert main(["compress", str(src), str(first), *args]) == 0, capsys.readouterr().err
    report = json.loads((first / "compression_report.json").read_text())
    assert report["calibration"]["sampling"]["file"] == SAMPLED_CALIBRATION_NAME
    sampled, settings = load_teacher_text(first / SAMPLED_CALIBRATION_NAME)
    assert sampled.shape == (3, 32) and settings["source"] == report["calibration"]["sampling"]["source"]
    from relational_hf.hub import build_model_card

    card = str(build_model_card(first, "someone/c"))
    assert f"the sampled windows are in `{SAMPLED_CALIBRATION_NAME}`" in card
    sampling = report["calibration"]["sampling"]  # the card says how they were drawn, as the report records it
    assert f"at temperature {sampling['temperature']:g}, seed {sampling['seed']}; " in card
    assert f"{sampling['chat_share']:.0%} of the rows start from a request of the '{sampling['prompts']}' prompt set" in card
    tokenizer = AutoTokenizer.from_pretrained(src)
    user = torch.tensor(tokenizer(prose.read_text())["input_ids"][: 6 * 32]).view(6, 32)
    assert not any(torch.equal(row, u) for row in sampled for u in user)  # SRC's own text, none of the user's
    rebuilt = [*COMMON, "--calibration-windows", "9", "--self-calibration", "0", mode]
    rebuilt += ["--calibration", str(prose), str(first / SAMPLED_CALIBRATION_NAME)]
    assert main(["compress", str(src), str(again), *rebuilt]) == 0, capsys.readouterr().err
    second = json.loads((again / "compression_report.json").read_text())
    assert second["calibration"]["self_windows"] == 0 and not (again / SAMPLED_CALIBRATION_NAME).exists()
    assert second["widths"] == report["widths"]
    assert second["calibration_perplexity_before"] == pytest.approx(report["calibration_perplexity_before"], rel=1e-6)
    a, b = stored_tensors(first), stored_tensors(again)
    assert torch.equal(a.pop("input_ids"), sampled)  # the sampled windows' file, beside the model's
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    bad = [*COMMON, "--calibration", str(first / "model.safetensors"), mode]
    assert main(["compress", str(src), str(tmp_path / "bad"), *bad]) == 2
    err = capsys.readouterr().err
    assert "--calibration" in err and "not a teacher-text file" in err and "Traceback" not in err


def test_card_of_a_folder_without_or_with_a_broken_compression_report(tmp_path, byte_llama_checkpoint):
    """A checkpoint that was not compressed gets no Compression section; a compression report that is not JSON is
    refused in one line naming the file, not published as if absent."""
    import shutil

    from relational_hf.hub import build_model_card

    folder = tmp_path / "ckpt"
    shutil.copytree(byte_llama_checkpoint, folder)
    assert "## Compression" not in str(build_model_card(folder, "someone/plain"))
    (folder / "compression_report.json").write_text("{not json")
    with pytest.raises(ValueError, match="compression_report.json .* not a readable compression report"):
        build_model_card(folder, "someone/plain")


def test_cli_without_calibration_text_calibrates_on_src_s_own_text(tmp_path, capsys, texts):
    """No --calibration: every calibration window is sampled by SRC (the built-in text is no real text); an explicit
    --self-calibration 0 keeps the built-in text; the two compressions differ."""
    from relational_hf.commands.main import main

    src, prose, _ = texts
    assert main(["compress", str(src), str(tmp_path / "a"), *COMMON, "--eval", str(prose)]) == 0
    assert "6 windows SRC sampled itself" in capsys.readouterr().out
    own = json.loads((tmp_path / "a" / "compression_report.json").read_text())
    assert own["calibration"]["self_windows"] == 6 and own["calibration"]["self_share"] == 1.0
    assert main(["compress", str(src), str(tmp_path / "b"), *COMMON, "--self-calibration", "0"]) == 0
    assert "calibration: built-in" in capsys.readouterr().out
    builtin = json.loads((tmp_path / "b" / "compression_report.json").read_text())
    assert builtin["calibration"]["self_windows"] == 0
    assert builtin["calibration_perplexity_before"] != own["calibration_perplexity_before"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--self-calibration", "1.5"], "--self-calibration"),
        (["--self-calibration", "-0.1"], "--self-calibration"),
        (["--eval", "{prose}", "--eval", "{other}/prose.txt"], "two files are named prose.txt"),
        (["--eval", "{root}/missing.txt"], "missing.txt"),
    ],
)
def test_cli_refuses_bad_calibration_and_eval_arguments_in_one_line(tmp_path, capsys, texts, extra, message):
    from relational_hf.commands.main import main

    src, prose, _ = texts
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "prose.txt").write_text("x " * 400)
    extra = [e.format(prose=prose, other=tmp_path / "other", root=tmp_path) for e in extra]
    assert main(["compress", str(src), str(tmp_path / "out"), *COMMON, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
