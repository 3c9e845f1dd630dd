"""benchmarks/gpu_check.sh, the prepared script for the first session with a GPU: it parses, it runs every benchmark
that has a --gpu option, and without a CUDA device (here; on a GPU machine the device is hidden for the test) it
stops at once with one line naming the missing GPU and writes nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the script is a bash script; bash is missing")


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=environment, timeout=120)


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_without_a_gpu_it_stops_with_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    done = run(str(out))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "no CUDA GPU" in lines[0] and lines[0].startswith("gpu_check.sh: "), lines[0]
    assert done.stdout == ""
    assert not out.exists()


def test_without_its_output_folder_it_says_how_to_call_it():
    done = run()
    assert done.returncode != 0
    assert done.stderr.strip().startswith("usage: benchmarks/gpu_check.sh OUT_DIR"), done.stderr


def test_every_benchmark_with_a_gpu_option_is_run():
    """Each benchmarks/*.py that defines a --gpu option appears in a step of the script with --gpu (a new GPU path
    fails this test until the script runs it)."""
    with_gpu = sorted(
        p.name for p in (ROOT / "benchmarks").glob("*.py") if re.search(r"add_argument\(\s*\"--gpu\"", p.read_text())
    )
    assert with_gpu, "no benchmark defines --gpu any more: is the script still needed?"
    steps = [line for line in SCRIPT.read_text().splitlines() if re.match(r"\s*(step|\")", line)]
    text = " ".join(steps)
    for name in with_gpu:
        assert re.search(rf"benchmarks/{re.escape(name)} --gpu\b", text), f"{name} has --gpu but no step runs it"
