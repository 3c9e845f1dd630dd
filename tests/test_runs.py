"""What a training run promises (`relational_hf.commands.runs`): a diverged run ends with an error and saves
nothing, a healthy one is never taken for diverged; a run cut by --max-minutes says so and --resume runs the rest;
memory does not grow with the steps asked for; the windows are drawn lazily and reproducibly; defaults that decide
what is trained are printed; the thread count never exceeds the idle cores; the corpora follow one setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.commands import main as cli
from relational_hf.commands.runs import collapsed_output
from relational_hf.lm import corpora
from relational_hf.lm.data import RandomBlockDataset, generate_corpus
from relational_hf.lm.metrics import perplexity

PROJECT_ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--layers", "1", "--hidden-size", "32", "--heads", "2", "--batch-size", "4", "--block-size", "32",
    "--eval-blocks", "2", "--sample-tokens", "0", "--warmup-steps", "0", "--logging-steps", "5",
]  # fmt: skip


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "train.txt"
    path.write_text(generate_corpus(600, seed=4), encoding="utf-8")
    return path


def train(text: Path, out: Path, *flags: str) -> list[str]:
    return ["train", "--train-file", str(text), "--output-dir", str(out), *TINY, *flags]


# ---------------------------------------------------------------------------------------------------------------
# divergence
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "learning_rate,reason",
    [
        ("10", "the training loss rose from"),  # the loss explodes: finite but far above its start
        ("1e6", "collapsed to uniform"),  # the residual stream overflows: every logit exactly equal
        ("1e10", "the training loss became nan"),  # NaN (the Trainer's own log would show it as 0)
    ],
)
def test_a_diverging_run_ends_with_an_error_and_saves_nothing(text, tmp_path, capsys, learning_rate, reason):
    """The three ways the learning-rate probe diverged on the tiny model: exit 2, one line naming the cause and the
    flag; an existing checkpoint is left as it was, a new folder is not created."""
    out = tmp_path / "run"
    assert cli.main(train(text, out, "--max-steps", "20", "--learning-rate", learning_rate)) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("relational-hf train: error: training diverged (") and reason in line, line
    assert "--learning-rate" in line and "Traceback" not in err
    assert not out.exists()


def test_a_diverging_run_keeps_the_previous_model(text, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(train(text, out, "--max-steps", "4")) == 0
    before = AutoModelForCausalLM.from_pretrained(out).model.embed_tokens.weight.detach().clone()
    assert cli.main(train(text, out, "--max-steps", "10", "--learning-rate", "10")) == 2
    assert "diverged" in capsys.readouterr().err
    after = AutoModelForCausalLM.from_pretrained(out).model.embed_tokens.weight
    assert torch.equal(before, after)
    # no trainer checkpoint of the diverged run; the previous run's, set aside at its start, is back for --resume
    assert sorted(p.name for p in (out / "trainer_state").iterdir()) == ["checkpoint-4"]


@pytest.mark.parametrize("learning_rate", ["3e-3", "3e-2"])
def test_a_healthy_short_run_is_not_taken_for_diverged(text, tmp_path, capsys, learning_rate):
    """A few steps at the default and at a high but workable learning rate save a model, whatever the loss did."""
    for steps in ("1", "12"):
        out = tmp_path / f"run{steps}_{learning_rate}"
        assert cli.main(train(text, out, "--max-steps", steps, "--learning-rate", learning_rate)) == 0, (
            capsys.readouterr().err
        )
        assert (out / "model.safetensors").is_file()


def test_collapsed_output_is_recognised_and_a_fresh_model_is_not(tmp_path):
    torch.manual_seed(0)
    config = RelationalConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2)  # fmt: skip
    model = RelationalForCausalLM(config)
    blocks = torch.randint(0, 40, (2, 12))
    assert not collapsed_output(model, blocks)
    with torch.no_grad():  # a blown-up residual stream: the final norm divides by an infinite RMS, logits all 0
        model.model.embed_tokens.weight.fill_(1e30)
    assert collapsed_output(model, blocks)


def test_perplexity_of_an_exploded_model_is_infinite_not_an_overflow():
    torch.manual_seed(0)
    config = RelationalConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, final_norm_gain=True)  # fmt: skip
    model = RelationalForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(1e6)  # logits of order 1e6: a mean NLL far beyond exp's range
    assert perplexity(model, torch.randint(0, 40, (2, 12))) == float("inf")


# ---------------------------------------------------------------------------------------------------------------
# the time limit, --resume, memory
# ---------------------------------------------------------------------------------------------------------------


def test_a_run_cut_by_the_time_limit_says_so_and_resume_runs_the_rest(text, tmp_path, capsys, monkeypatch):
    """--max-minutes stops the run after some steps: the summary says how many of how many, that the model is
    undertrained and how to go on; --resume with the same folder continues from that step and ends with the weights
    of an uninterrupted run (same windows, optimizer state and schedule)."""
    from relational_hf.training import callbacks

    class Clock:  # the time limit's clock only: five seconds pass at every step
        now = 0.0

        @classmethod
        def monotonic(cls) -> float:
            cls.now += 5.0
            return cls.now

    whole = tmp_path / "whole"
    assert cli.main(train(text, whole, "--max-steps", "12")) == 0
    assert "12 of 12 steps" in capsys.readouterr().out
    monkeypatch.setattr(callbacks, "time", Clock)
    out = tmp_path / "run"
    assert cli.main(train(text, out, "--max-steps", "12", "--max-minutes", "0.5")) == 0
    printed = " ".join(capsys.readouterr().out.split())
    ran = int(printed.split("parameters; ")[1].split(" of 12 steps")[0])
    assert 1 <= ran < 12
    assert f"stopped by the time limit (--max-minutes) after {ran} of 12 steps: the model is undertrained" in printed
    assert f"To run the remaining {12 - ran} steps, rerun the same `relational-hf train` command with --resume" in (
        printed
    )
    assert (out / "trainer_state" / f"checkpoint-{ran}" / "trainer_state.json").is_file()  # written at the cut
    monkeypatch.undo()
    assert cli.main(train(text, out, "--max-steps", "12", "--resume")) == 0
    printed = capsys.readouterr().out
    assert "12 of 12 steps" in printed and "stopped by the time limit" not in printed
    resumed, uninterrupted = (AutoModelForCausalLM.from_pretrained(p) for p in (out, whole))
    for (name, a), b in zip(resumed.named_parameters(), uninterrupted.parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_memory_does_not_grow_with_the_steps_asked_for(text, tmp_path):
    """--max-steps 10^8 under a time limit of a few steps: the peak memory of the process stays that of a small run
    (the windows were once drawn up front: 10^8 x 4 x 8 bytes = 3.2 GB)."""
    script = (
        "import resource, sys\n"
        "from relational_hf.commands import main as cli\n"
        f"code = cli.main({train(text, tmp_path / 'big', '--max-minutes', '0.1')!r} + sys.argv[1:])\n"
        "print('PEAK_MIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, 'CODE', code)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), TOKENIZERS_PARALLELISM="false")
    peaks = {}
    for steps in ("20", "100000000"):
        done = subprocess.run(
            [sys.executable, "-c", script, "--max-steps", steps, "--overwrite"],
            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert "CODE 0" in done.stdout, done.stdout + done.stderr[-2000:]
        peaks[steps] = int(done.stdout.split("PEAK_MIB")[1].split()[0])
    assert peaks["100000000"] < peaks["20"] + 200, peaks


def test_random_windows_are_lazy_reproducible_and_cover_the_text():
    ids = torch.arange(1000)
    a, b = RandomBlockDataset(ids, 10, 10**15, seed=3), RandomBlockDataset(ids, 10, 10**15, seed=3)
    assert len(a) == 10**15
    picks = [0, 1, 7, 10**6, 10**15 - 1]
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in picks)  # the same seed: the same windows
    other = RandomBlockDataset(ids, 10, 10**15, seed=4)
    assert any(not torch.equal(a[i]["input_ids"], other[i]["input_ids"]) for i in picks)
    starts = [a.start(i) for i in range(20000)]
    assert min(starts) == 0 and max(starts) == 1000 - 10 - 1 and len(set(starts)) == 990  # every start is drawn
    window = a[5]["input_ids"]
    assert torch.equal(window, torch.arange(a.start(5), a.start(5) + 10)) and torch.equal(a[5]["labels"], window)
    with pytest.raises(IndexError):
        a[10**15]


# ---------------------------------------------------------------------------------------------------------------
# what is printed, threads, data folder
# ---------------------------------------------------------------------------------------------------------------


def test_the_built_in_corpus_is_announced_when_no_data_is_given(tmp_path, capsys):
    assert cli.main(["train", *TINY, "--max-steps", "1", "--output-dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "relational-hf train: no --train-file or --dataset given: training on the built-in generated corpus" in err
    base = tmp_path / "a"
    assert cli.main(["finetune", str(base), "--max-steps", "1", "--block-size", "32", "--eval-blocks", "1",
                     "--output-dir", str(tmp_path / "b")]) == 0  # fmt: skip
    assert "relational-hf finetune: no --train-file or --dataset given: training on the built-in" in (
        capsys.readouterr().err
    )


def test_the_thread_count_never_exceeds_the_idle_cores(monkeypatch, tmp_path):
    """Threads = cores less the other processes' runnable threads now (/proc/loadavg's runnable count less the
    reader), at least 1, at most torch's default; the load average only where /proc/loadavg cannot be read; the
    user's OMP_NUM_THREADS decides when set."""
    import torch as torch_module

    from relational_hf.commands import main as cli

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch_module, "get_num_threads", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.5, 9.5, 9.5))  # a finished job's stale load: not read
    proc = tmp_path / "loadavg"
    monkeypatch.setattr(cli, "PROC_LOADAVG", str(proc))
    for runnable, expected in ((1, 2), (2, 1), (3, 1), (40, 1)):  # the reader itself is one runnable thread
        proc.write_text(f"9.50 9.50 9.50 {runnable}/812 4242\n")
        assert cli.busy_cores_now(interval=0) == runnable - 1
        assert cli.cpu_threads()[0] == expected, runnable
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    proc.write_text("0.00 0.00 0.00 1/812 4242\n")
    assert cli.cpu_threads()[0] == 8  # never more than torch's own default
    proc.write_text("garbled\n")  # unreadable: the 1-minute load average decides
    assert cli.busy_cores_now() is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    for load, expected in ((0.0, 2), (0.4, 2), (0.8, 1), (9.5, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert cli.cpu_threads() == (expected, f"2 core(s) available, load average {load:.1f}"), load
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cli.cpu_threads() == (8, "OMP_NUM_THREADS")  # the user's setting decides


def test_the_thread_count_is_counted_again_before_each_long_phase(monkeypatch, tmp_path, caplog):
    """A command that started while another process was busy (one idle core of two) gets the second thread back at
    its next phase once that process is gone, never more than torch's own default, and logs the change;
    `OMP_NUM_THREADS` still decides alone."""
    import logging

    import torch as torch_module

    from relational_hf.commands import main as cli

    threads = {"n": 2}  # torch's default on this 2-core machine
    monkeypatch.setattr(torch_module, "get_num_threads", lambda: threads["n"])
    monkeypatch.setattr(torch_module, "set_num_threads", lambda n: threads.update(n=n))
    monkeypatch.setattr(cli, "_TORCH_DEFAULT_THREADS", [])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    proc = tmp_path / "loadavg"
    monkeypatch.setattr(cli, "PROC_LOADAVG", str(proc))
    proc.write_text("1.00 1.00 1.00 2/812 4242\n")  # one other runnable thread at the start
    assert cli.set_cpu_threads() == 1 and threads["n"] == 1
    assert cli.recheck_cpu_threads("plan") == 1  # still busy: unchanged
    proc.write_text("1.00 1.00 1.00 1/812 4242\n")  # the other process is gone
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        assert cli.recheck_cpu_threads("heal") == 2 and threads["n"] == 2
    assert "heal: torch now uses 2 CPU thread(s)" in caplog.text
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert cli.recheck_cpu_threads("more cores") == 2  # torch's default stays the ceiling
    proc.write_text("1.00 1.00 1.00 3/812 4242\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cli.recheck_cpu_threads("user's setting") == 2 and threads["n"] == 2


def test_compress_counts_the_threads_again_at_each_phase(tmp_path, monkeypatch, capsys, byte_llama_checkpoint):
    """`compress` re-counts the idle cores before each long phase: sampling its calibration text, sampling the
    teacher text, compressing, healing (in memory), and before the streamed compression."""
    from relational_hf.commands import main as cli

    phases = []
    monkeypatch.setattr(cli, "recheck_cpu_threads", lambda phase: phases.append(phase) or 1)
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    base = ["compress", str(byte_llama_checkpoint)]
    small = ["--remove", "0.1", "--calibration", str(text), "--window", "32", "--calibration-windows", "4"]
    heal = ["--heal-steps", "1", "--heal-samples", "2", "--heal-length", "16"]
    assert cli.main([*base, str(tmp_path / "a"), *small, *heal]) == 0, capsys.readouterr().err
    assert phases == ["sampling calibration text", "sampling the teacher text", "compress", "heal"]
    phases.clear()
    assert cli.main([*base, str(tmp_path / "b"), *small, "--stream"]) == 0, capsys.readouterr().err
    assert phases == ["sampling calibration text", "compress"]


def test_the_runnable_count_is_read_from_this_machine():
    """On Linux the real /proc/loadavg gives a count (the reader excluded, so never negative)."""
    from relational_hf.commands.main import busy_cores_now

    busy = busy_cores_now()
    if busy is None:
        pytest.skip("no /proc/loadavg here")
    assert busy >= 0 and busy == int(busy)


def test_the_corpora_follow_one_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(corpora.DATA_ENV, raising=False)
    assert corpora.data_dir() == (PROJECT_ROOT.parent / "shared" / "data").resolve()
    monkeypatch.setenv(corpora.DATA_ENV, str(tmp_path))
    assert corpora.data_dir() == tmp_path.resolve()
    with pytest.raises(corpora.CorpusNotFound) as missing:
        corpora.corpus_file("tinyshakespeare")
    message = str(missing.value)
    assert str(tmp_path / "tinyshakespeare" / "input.txt") in message and corpora.DATA_ENV in message
    assert "karpathy/tiny_shakespeare" in message  # and how to get it
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("to be")
    assert corpora.corpus_file("tinyshakespeare") == tmp_path / "tinyshakespeare" / "input.txt"
    assert corpora.data_path("../shared/data/wikitext-2/valid.txt") == tmp_path / "wikitext-2" / "valid.txt"
    assert corpora.data_path("model_cards/x.md", PROJECT_ROOT) == PROJECT_ROOT / "model_cards" / "x.md"
