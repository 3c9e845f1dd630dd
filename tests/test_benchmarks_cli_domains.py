"""`benchmarks/cli_domains.py`: a compression report's per-domain figures become ratios to the source on the same
windows, the worst over the four target domains only (prose is the check no choice was made on), with the
calibration settings the report was made with; the committed result holds what its command printed."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import PROJECT_ROOT, benchmark_modules

RESULT = PROJECT_ROOT / "benchmarks" / "results" / "cli_domains.json"


@pytest.fixture(scope="module")
def cli_domains():
    with benchmark_modules("cli_domains") as (module,):
        yield module


def _report(before: dict, after: dict, prompts: str | None) -> dict:
    sampling = {"seed": 1} | ({"prompts": prompts} if prompts else {})
    return {
        "parameters_before": 100, "parameters_after": 75, "removed_share": 0.25, "seconds": 1.0,
        "calibration": {"text": "calibration.pt", "self_windows": 2, "user_windows": 4, "sampling": sampling},
        "options": {"width_multiple": 64},
        "eval": {"texts": {f"{d}.pt": {"windows": [2, 8], "perplexity_before": before[d], "perplexity_after": after[d]}
                           for d in before}},
    }  # fmt: skip


def test_ratios_and_the_worst_of_the_four_target_domains(tmp_path, cli_domains):
    before = {"wikitext": 10.0, "shakespeare": 20.0, "python": 5.0, "chat": 8.0, "prose": 4.0}
    after = {"wikitext": 14.0, "shakespeare": 30.0, "python": 9.0, "chat": 12.0, "prose": 40.0}
    (tmp_path / "compression_report.json").write_text(json.dumps(_report(before, after, "calibration")))
    cell = cli_domains.read_variant(tmp_path)
    assert cell["ratio"] == pytest.approx({d: after[d] / before[d] for d in before})
    assert cell["worst_of_four"] == pytest.approx(1.8)  # python; prose's x10 is not a target domain
    assert cell["calibration"]["prompts"] == "calibration" and cell["width_multiple"] == 64
    (tmp_path / "compression_report.json").write_text(json.dumps(_report(before, after, None)))
    assert cli_domains.read_variant(tmp_path)["calibration"]["prompts"] == "generic"  # made before the setting
    assert cli_domains.read_variant(tmp_path / "missing") is None


def test_without_texts_the_script_says_what_to_run_first(tmp_path, cli_domains, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cli_domains.py", "--workdir", str(tmp_path), "--no-run"])
    with pytest.raises(SystemExit, match="gguf_llamacpp.py --prepare-only"):
        cli_domains.main()


def test_the_committed_result_is_consistent():
    """Every variant's ratios are its perplexities over the source's, its worst the largest of the four targets."""
    payload = json.loads(RESULT.read_text())
    for name, cell in payload["variants"].items():
        for d, r in cell["ratio"].items():
            assert r == pytest.approx(cell["perplexity"][d] / cell["dense"][d]), (name, d)
        four = [cell["ratio"][d] for d in ("wikitext", "shakespeare", "python", "chat")]
        assert cell["worst_of_four"] == pytest.approx(max(four)), name
        assert cell["command"].startswith("relational-hf compress SMOLLM2 ")


def test_a_presampled_variant_gives_its_file_as_a_second_calibration_text_and_samples_nothing(tmp_path, cli_domains):
    """A variant whose sampled windows are drawn before the command passes the WikiText-2 windows and its file as two
    --calibration texts, all of both counted (128 + the file's), with --self-calibration 0, and no second
    --calibration; the other variants keep the 128 windows alone."""
    for name in cli_domains.PRESAMPLED:
        extra = cli_domains.presampled_options(name, tmp_path)
        command = cli_domains.compress_command("SRC", tmp_path / "out", tmp_path, extra)
        assert command.count("--calibration") == 1 and command.count("--calibration-windows") == 1
        at = command.index("--calibration")
        assert command[at + 1 : at + 3] == [str(tmp_path / "calibration.pt"), str(cli_domains.presampled_file(name, tmp_path))]
        assert cli_domains.presampled_file(name, tmp_path).parent == tmp_path
        other = cli_domains.PRESAMPLED[name].get("same_as")  # another variant's very windows: its file
        assert other is None or cli_domains.presampled_file(name, tmp_path) == cli_domains.presampled_file(other, tmp_path)
        assert command[command.index("--self-calibration") + 1] == "0"
        assert command[command.index("--calibration-windows") + 1] == str(128 + cli_domains.PRESAMPLED_WINDOWS)
    plain = cli_domains.compress_command("SRC", tmp_path / "out", tmp_path, [])
    assert plain[plain.index("--calibration-windows") + 1] == "128" and "--self-calibration" not in plain


def test_a_variant_on_another_folders_windows_copies_them_as_they_are(tmp_path, cli_domains):
    """A PRESAMPLED variant that takes the windows another run of the command kept ({"from": FOLDER}) copies that
    folder's calibration_sampled.safetensors into texts/ token for token with its settings, one file for every such
    variant; without the folder's file it stops in one line and writes nothing."""
    import torch

    from relational_hf.commands.compress_texts import SAMPLED_CALIBRATION_NAME
    from relational_hf.compress.distill import load_teacher_text, save_teacher_text

    takers = [n for n, s in cli_domains.PRESAMPLED.items() if "from" in s]
    assert takers, "no variant takes another folder's windows"
    texts = tmp_path / "texts"
    texts.mkdir()
    folder = tmp_path / cli_domains.PRESAMPLED[takers[0]]["from"]
    with pytest.raises(SystemExit, match="make that variant first"):
        cli_domains.presample(takers[0], texts)
    assert list(texts.iterdir()) == []
    folder.mkdir()
    ids = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(0))
    save_teacher_text(folder / SAMPLED_CALIBRATION_NAME, ids, {"seed": 1, "samples": 3, "length": 8})
    for name in takers:
        cli_domains.presample(name, texts)
        got, settings = load_teacher_text(cli_domains.presampled_file(name, texts))
        assert torch.equal(got, ids) and settings == {"seed": 1, "samples": 3, "length": 8}
    assert len({cli_domains.presampled_file(n, texts) for n in takers}) == 1 == len(list(texts.iterdir()))
