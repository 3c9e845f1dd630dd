"""`benchmarks/heal_cli.py --control-from`: an earlier dense control is reused only for the same healing inputs."""

from __future__ import annotations

import copy
import json
import os

import pytest
from conftest import PROJECT_ROOT, benchmark_modules

EARLIER = PROJECT_ROOT / "benchmarks" / "results" / "heal_cli_calibration64.json"


@pytest.fixture(scope="module")
def heal_cli():
    with benchmark_modules("heal_cli") as (module,):
        yield module


@pytest.fixture
def report():
    """A new command's report with the earlier run's healing inputs (its compressed figures changed)."""
    earlier = json.loads(EARLIER.read_text())
    report = copy.deepcopy(earlier["command_report"])
    report["eval_perplexity_compressed"] = 1.5 * report["eval_perplexity_compressed"]
    report["heal"]["text"]["seconds"] += 100.0  # the text's generation time is not an input of the control
    report["widths"] = {"mlp": [1]}
    return report


def test_same_inputs_reuse_the_earlier_control_and_say_so(heal_cli, report):
    control = heal_cli._reused_control(EARLIER, report)
    earlier = json.loads(EARLIER.read_text())["control"]
    assert {k: v for k, v in control.items() if k != "reused_from"} == earlier
    assert control["reused_from"] == EARLIER.name


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda r: r["heal"].update(learning_rate=1e-3), "heal"),
        (lambda r: r["heal"].update(steps=100), "heal"),
        (lambda r: r["heal"]["text"].update(source="0123456789abcdef"), "text"),
        (lambda r: r["heal"]["text"].update(samples=512), "text"),
        (lambda r: r["heal"]["text"].update(calibration_share=0.5), "text"),  # the calibration windows mixed in
        (lambda r: r.update(eval_windows=[12, 512]), "eval_windows"),
        (lambda r: r.update(eval_perplexity_before=r["eval_perplexity_before"] * 1.01), "dense perplexity"),
    ],
)
def test_other_inputs_are_refused_naming_what_differs(heal_cli, report, change, named):
    change(report)
    with pytest.raises(ValueError, match=named):
        heal_cli._reused_control(EARLIER, report)


def test_command_line_refuses_a_missing_result_in_one_line_before_anything_loads(
    heal_cli, tmp_path, capsys, monkeypatch
):
    import relational_hf.pretrained

    def no_load():
        raise AssertionError("the source checkpoint was loaded before --control-from was checked")

    monkeypatch.setattr(relational_hf.pretrained, "smollm2_checkpoint", no_load)
    (tmp_path / "compressed").mkdir()
    (tmp_path / "command.json").write_text("{}")
    (tmp_path / "compressed" / "compression_report.json").write_text(json.dumps({"heal": {}}))
    with pytest.raises(SystemExit):
        heal_cli.main(["--workdir", str(tmp_path), "--reuse", "--control-from", "no_such_result"])
    assert "--control-from no_such_result" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["command.json", "compressed"]  # nothing written


@pytest.mark.parametrize(("option", "value", "flag"), [("correction", "local", "--correction local"),
                                                       ("heal_batch_size", 6, "--heal-batch-size 6")])
@pytest.mark.parametrize("given", [False, True])
def test_command_options_reach_the_command_and_its_recorded_line(heal_cli, monkeypatch, tmp_path, option, value, flag,
                                                                 given):
    """--correction and --heal-batch-size (like --heal-lr) are passed to `relational-hf compress` and shown in the line
    the result records; without them the command runs with its own defaults and the line says nothing about them."""
    seen, envs = [], []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(heal_cli.subprocess, "run", lambda command, check, env: (seen.append(command), envs.append(env)))
    run = heal_cli._run_command(
        tmp_path / "src", tmp_path / "out", tmp_path / "cal.txt", tmp_path / "held.txt", 200, 0.25, None,
        **({option: value} if given else {}),
    )  # fmt: skip
    assert len(seen) == 1
    passed = flag in " ".join(seen[0])
    assert passed == given and (flag in run["line"]) == passed
    assert str(tmp_path) not in run["line"]
    # the command runs on every core it may use, not on the cores that happened to be idle when it started
    assert envs[0]["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0))) == str(run["threads"])
