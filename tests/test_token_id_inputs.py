"""Every command that reads a text for a model also takes the same text as a `.pt` tensor of token ids (`evaluate
--text`, `convert --calibration`, `compress --calibration/--eval/--heal-text`, `analyze --text`): the ids of a text
give exactly what the text gives, and a bad tensor is refused in one line naming the flag before anything is
written."""

from __future__ import annotations

import json

import pytest
import torch

from relational_hf.commands.main import main

TEXT = "the quick brown fox jumps over the lazy dog; a stitch in time saves nine. " * 30


def _ids(tmp_path, src):
    """TEXT as a file and as the .pt tensor of its ids, tokenised as the commands tokenise a text."""
    from transformers import AutoTokenizer

    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(src)(TEXT, add_special_tokens=False)["input_ids"]
    path = tmp_path / "text.pt"
    torch.save(torch.tensor(ids), path)
    return text, path


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_compress_on_token_ids_equals_compress_on_their_text(tmp_path, capsys, byte_llama_checkpoint, stream):
    text, ids = _ids(tmp_path, byte_llama_checkpoint)
    reports = []
    for name, source in (("from_text", text), ("from_ids", ids)):
        out = tmp_path / name
        args = ["compress", str(byte_llama_checkpoint), str(out), "--remove", "0.15", "--calibration", str(source),
                "--eval", str(source), "--window", "32", "--calibration-windows", "4", "--eval-windows", "2", stream]  # fmt: skip
        assert main(args) == 0, capsys.readouterr().err
        reports.append(json.loads((out / "compression_report.json").read_text()))
    a, b = reports
    assert a["widths"] == b["widths"] and a["parameters_after"] == b["parameters_after"]
    for key in ("calibration_perplexity_before", "calibration_perplexity_after", "eval_perplexity_before"):
        if key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
    assert a["eval_perplexity_after"] == pytest.approx(b["eval_perplexity_after"], rel=1e-6)


def test_healing_on_token_ids_equals_healing_on_their_text(tmp_path, capsys, byte_llama_checkpoint):
    text, ids = _ids(tmp_path, byte_llama_checkpoint)
    reports = []
    for name, source in (("from_text", text), ("from_ids", ids)):
        out = tmp_path / name
        args = ["compress", str(byte_llama_checkpoint), str(out), "--remove", "0.15", "--calibration", str(text),
                "--window", "32", "--calibration-windows", "4", "--heal-steps", "2", "--heal-text", str(source)]  # fmt: skip
        assert main(args) == 0, capsys.readouterr().err
        reports.append(json.loads((out / "compression_report.json").read_text()))
    a, b = reports
    assert a["heal"]["tokens_available"] == b["heal"]["tokens_available"]
    assert a["calibration_perplexity_healed"] == pytest.approx(b["calibration_perplexity_healed"], rel=1e-5)


@pytest.mark.parametrize(
    ("tensor", "flag", "needle"),
    [
        (torch.rand(400), "--calibration", "integer tensor"),
        (torch.full((400,), 10_000), "--calibration", "token ids must lie in [0, 259)"),
        (torch.full((400,), -1), "--eval", "token ids must lie in [0, 259)"),
        (torch.arange(10), "--calibration", "fewer than one window"),
        (None, "--eval", "no such file"),
    ],
)
def test_compress_refuses_a_bad_tensor_in_one_line(tmp_path, capsys, byte_llama_checkpoint, tensor, flag, needle):
    text, _ = _ids(tmp_path, byte_llama_checkpoint)
    bad = tmp_path / "bad.pt"
    if tensor is not None:
        torch.save(tensor, bad)
    args = {"--calibration": str(text), flag: str(bad)}
    out = tmp_path / "out"
    command = ["compress", str(byte_llama_checkpoint), str(out), "--remove", "0.15", "--window", "32",
               "--calibration-windows", "4"] + [x for pair in args.items() for x in pair]  # fmt: skip
    assert main(command) == 2
    printed = capsys.readouterr().err
    err = [line for line in printed.splitlines() if line.strip() and "Writing model shards" not in line]
    assert len(err) == 1 and flag in err[0] and needle in err[0] and "Traceback" not in printed, err
    assert not out.exists()


def test_analyze_on_token_ids_equals_analyze_on_their_text(tmp_path, capsys, byte_llama_checkpoint):
    text, ids = _ids(tmp_path, byte_llama_checkpoint)
    reports = []
    for name, source in (("from_text", text), ("from_ids", ids)):
        out = tmp_path / name
        args = ["analyze", str(byte_llama_checkpoint), "--text", str(source), "--seq-len", "16", "--max-tokens", "128",
                "--out", str(out)]  # fmt: skip
        assert main(args) == 0, capsys.readouterr().err
        report = json.loads((out / "report.json").read_text())
        for key in ("text", "figures", "peak_rss_mib", "timings_s"):  # where and how long, not what was measured
            report.pop(key, None)
        reports.append(report)
    assert json.dumps(reports[0], sort_keys=True) == json.dumps(reports[1], sort_keys=True)
    torch.save(torch.full((200,), 10_000), tmp_path / "big.pt")
    assert main(["analyze", str(byte_llama_checkpoint), "--text", str(tmp_path / "big.pt"), "--out", str(tmp_path / "x")]) == 2
    assert "token ids must lie in [0, 259)" in capsys.readouterr().err


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_compress_without_a_tokenizer_takes_token_ids_and_writes_none(tmp_path, capsys, byte_llama_checkpoint, stream):
    """A checkpoint with no tokenizer compresses as it does with one when every text is token ids (same widths,
    same perplexities, a loadable model), OUT holds no tokenizer, and a text input is refused naming its flag.
    (--self-calibration 0: the text SRC samples itself starts from its tokenizer's chat template and leaves out its
    special tokens, so with and without a tokenizer SRC samples other text.)"""
    text, ids = _ids(tmp_path, byte_llama_checkpoint)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in byte_llama_checkpoint.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            (bare / f.name).write_bytes(f.read_bytes())
    reports = []
    for name, src in (("with", byte_llama_checkpoint), ("without", bare)):
        out = tmp_path / name
        args = ["compress", str(src), str(out), "--remove", "0.15", "--calibration", str(ids), "--eval", str(ids),
                "--window", "32", "--calibration-windows", "4", "--eval-windows", "2", "--self-calibration", "0",
                stream]  # fmt: skip
        assert main(args) == 0, capsys.readouterr().err
        reports.append(json.loads((out / "compression_report.json").read_text()))
    printed = capsys.readouterr().out
    assert "SRC has no tokenizer, so OUT holds none" in printed
    assert not list((tmp_path / "without").glob("tokenizer*")) and list((tmp_path / "with").glob("tokenizer*"))
    a, b = reports
    assert a["widths"] == b["widths"]
    assert a["eval_perplexity_after"] == pytest.approx(b["eval_perplexity_after"], rel=1e-6)
    from transformers import AutoModelForCausalLM

    import relational_hf  # noqa: F401  (registers the architecture)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "without")
    assert model.num_parameters() == b["parameters_after"]
    # a text file, and the built-in text when SRC is not to sample its own (--self-calibration 0)
    for flag_args in (["--calibration", str(text)], ["--self-calibration", "0"]):
        out = tmp_path / "refused"
        args = ["compress", str(bare), str(out), "--remove", "0.15", "--window", "32", *flag_args, stream]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "--calibration" in err and "no tokenizer" in err and ".pt tensor of token ids" in err, err
        assert "Traceback" not in err and not out.exists()
    # with no text at all, SRC calibrates on text it samples itself: no tokenizer needed
    out = tmp_path / "data-free"
    args = ["compress", str(bare), str(out), "--remove", "0.15", "--window", "32", "--calibration-windows", "4", stream]
    assert main(args) == 0, capsys.readouterr().err
    assert json.loads((out / "compression_report.json").read_text())["calibration"]["self_windows"] == 4


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_compress_says_when_eval_is_not_held_out(tmp_path, capsys, caplog, byte_llama_checkpoint, stream):
    """--eval given the calibration's own text (as a file or as its ids) measures the fit: one warning and the
    summary say so; text the calibration does not hold gets neither."""
    text, ids = _ids(tmp_path, byte_llama_checkpoint)
    other = tmp_path / "other.txt"
    other.write_text("pack my box with five dozen liquor jugs, said the sphinx of black quartz. " * 30, encoding="utf-8")
    for name, held, fitted in (("same", ids, True), ("other", other, False)):
        caplog.clear()
        args = ["compress", str(byte_llama_checkpoint), str(tmp_path / name), "--remove", "0.15", "--calibration",
                str(text), "--eval", str(held), "--window", "32", "--calibration-windows", "4", "--eval-windows", "2",
                stream]  # fmt: skip
        assert main(args) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        warned = [r.getMessage() for r in caplog.records if "not a held-out figure" in r.getMessage()]
        assert bool(warned) == fitted and ("not held out: 2 of 2 windows" in out) == fitted, (warned, out)


_NOT_TOKEN_IDS = {
    "bool": (lambda: torch.ones(400, dtype=torch.bool), ["got bool", "integer tensor"]),
    "sparse": (lambda: torch.arange(400).remainder(7).to_sparse(), ["sparse_coo", "dense"]),
    "float16": (lambda: torch.ones(400, dtype=torch.float16), ["got float16", "integer tensor"]),
}
_READERS = {
    "evaluate": "evaluate {src} --text {bad} --window 32",
    "analyze": "analyze {src} --text {bad} --seq-len 32 --max-tokens 128 --out {out}",
    "compress --eval": "compress {src} {out} --remove 0.15 --calibration {text} --eval {bad} --window 32",
    "compress --calibration": "compress {src} {out} --remove 0.15 --calibration {bad} --window 32",
    "convert": "convert {src} {out} --slice 0.1 --calibration {bad} --seq-len 32",
}


@pytest.mark.parametrize("kind", list(_NOT_TOKEN_IDS))
@pytest.mark.parametrize("command", list(_READERS))
def test_every_command_refuses_a_tensor_that_is_not_token_ids(tmp_path, capsys, byte_llama_checkpoint, kind, command):
    """A bool, sparse or floating tensor given as token ids is refused in one line naming the flag, the file and
    the dtype or layout, by every command that takes token ids (one shared check), and nothing is written."""
    text, _ = _ids(tmp_path, byte_llama_checkpoint)
    bad = tmp_path / "bad.pt"
    make, words = _NOT_TOKEN_IDS[kind]
    torch.save(make(), bad)
    out = tmp_path / "out"
    line = _READERS[command].format(src=byte_llama_checkpoint, bad=bad, out=out, text=text)
    assert main(line.split()) == 2
    printed = capsys.readouterr().err
    last = printed.strip().splitlines()[-1]
    assert "Traceback" not in printed and "bad.pt" in last and all(w in last for w in words), last
    assert not out.exists()
