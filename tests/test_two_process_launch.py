"""The two-process launcher of the distributed tests (`tiny_models.run_on_two_processes`), with a worker that crashes
on purpose.

Properties:
- a worker killed by a signal in its first launch is launched once more, with a warning holding the crash, from the
  output folder as it was before the launch (what the crashed launch wrote is gone, what the test put there is kept);
- a worker that crashes in both launches, or raises (a failed assertion in a worker is a result, never retried),
  fails the test, after one launch for the raise.

This file is also the worker (`python -m torch.distributed.run ... tests/test_two_process_launch.py OUT_DIR`); what it
does is set by the environment variables below; rank 1 counts the launches in a file outside OUT_DIR.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

MODE, COUNTER = "RELATIONAL_HF_TEST_LAUNCH_MODE", "RELATIONAL_HF_TEST_LAUNCH_COUNTER"


def _launches(counter: Path) -> int:
    return len(counter.read_text().split()) if counter.exists() else 0


@pytest.fixture
def launch(tmp_path, monkeypatch):
    out, counter = tmp_path / "out", tmp_path / "launches.txt"
    out.mkdir()
    (out / "input.txt").write_text("the test's own input")
    monkeypatch.setenv(COUNTER, str(counter))

    def run(mode: str) -> tuple[Path, int]:
        from tiny_models import run_on_two_processes  # here, not above: the worker imports no torch

        monkeypatch.setenv(MODE, mode)
        run_on_two_processes(__file__, out, master_port=29531, timeout=120)
        return out, _launches(counter)

    return run, out, counter


def test_a_worker_killed_by_a_signal_once_is_launched_again_from_the_folder_before(launch):
    run, out, counter = launch
    with pytest.warns(UserWarning, match="killed by a signal") as caught:
        run("crash-once")
    assert _launches(counter) == 2
    assert "SIGSEGV" in str(caught[0].message)
    assert (out / "input.txt").read_text() == "the test's own input"
    assert not (out / "first-launch.txt").exists()  # written by the crashed launch, removed before the second
    assert (out / "done-0.txt").exists() and (out / "done-1.txt").exists()


def test_a_worker_that_crashes_twice_fails_the_test(launch):
    run, _out, counter = launch
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match="SIGSEGV"):
        run("crash-always")
    assert _launches(counter) == 2


def test_a_worker_that_raises_fails_at_once_without_a_second_launch(launch):
    run, _out, counter = launch
    with pytest.raises(AssertionError, match="the worker's own assertion"):
        run("raise")
    assert _launches(counter) == 1


def test_only_a_death_by_signal_counts_as_a_crash():
    from tiny_models import killed_by_a_signal

    summary = "  rank      : 1 (local_rank: 1)\n  exitcode  : -11 (pid: 24055)  (SIGSEGV)\n"
    assert killed_by_a_signal(summary)
    assert not killed_by_a_signal(summary.replace("-11 (pid: 24055)  (SIGSEGV)", "1 (pid: 24055)"))
    assert not killed_by_a_signal("torch.distributed.DistNetworkError: address already in use")


def _worker(out: Path) -> None:
    """Rank 1 counts the launches and crashes or raises as the mode says; both ranks leave a file when they finish."""
    rank, mode, counter = int(os.environ["RANK"]), os.environ[MODE], Path(os.environ[COUNTER])
    if rank == 1:
        with counter.open("a") as f:  # one word per launch
            f.write("launch\n")
        if mode == "crash-always" or (mode == "crash-once" and _launches(counter) == 1):
            (out / "first-launch.txt").write_text("partial output")
            os.kill(os.getpid(), signal.SIGSEGV)
        if mode == "raise":
            raise AssertionError("the worker's own assertion")
    (out / f"done-{rank}.txt").write_text("ok")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
