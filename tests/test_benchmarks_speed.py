"""The speed benchmark's GPU configuration stays ready for a machine with a device: `--gpu --dry-run` builds every
contender of every GPU size on the meta device and runs one round at a tiny size in bf16 on the CPU; `--gpu` without
CUDA stops with a message instead of a traceback."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import benchmark_modules


@pytest.fixture(scope="module")
def speed():
    with benchmark_modules("speed") as (module,):
        yield module


def test_gpu_configuration_builds_every_size_and_runs_one_bf16_round_on_cpu(speed):
    checked = speed.dry_run(speed.GPU_SIZES, [512, 2048], torch.bfloat16, "cpu")
    assert set(checked["parameters"]) == set(speed.GPU_SIZES)
    for size, counts in checked["parameters"].items():
        dims = speed.GPU_SIZES[size]
        # Llama stores 2 norm gains per layer that the free gauge folds away (README, "Parameter count"; tied head)
        assert counts["llama"] - counts["relational_free"] == 2 * dims["num_hidden_layers"] * dims["hidden_size"]
        assert counts["relational_thin_gqa"] < counts["relational_pivot"] < counts["relational_free"]
    (round_,) = checked["results"].values()
    assert set(round_) == {"llama", *speed.VARIANTS}
    for entry in round_.values():
        for metric in ("train_tokens_per_s", "prefill_tokens_per_s", "decode_tokens_per_s"):
            assert math.isfinite(entry[metric]["median"]) and entry[metric]["median"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is absent")
def test_gpu_flag_without_cuda_is_a_clear_error(speed, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["speed.py", "--gpu"])
    with pytest.raises(SystemExit) as stop:
        speed.main()
    assert stop.value.code == 2
    assert "--gpu needs a CUDA device" in capsys.readouterr().err


def test_memory_trace_keeps_its_peak_when_merged_and_the_peak_reader_sees_an_allocation():
    """`RSSTrace.coarse` keeps at most the asked number of points, the overall peak and the first time of each
    merged run; `peak_rss_mib` grows by at least the size of a buffer this process touches."""
    with benchmark_modules("common") as (common,):
        pass
    trace = common.RSSTrace()
    trace.points = [(float(s), 100.0 + (s % 13) + (500.0 if s == 1234 else 0.0)) for s in range(3001)]
    merged = trace.coarse(600)
    assert len(merged) <= 600 and max(m for _, m in merged) == max(m for _, m in trace.points) > 600
    assert [t for t, _ in merged] == sorted(t for t, _ in merged) and merged[0][0] == 0.0
    short = [(0.0, 5.0), (1.0, 7.0)]
    trace.points = short
    assert trace.coarse(600) == short  # nothing to merge
    before, now = common.peak_rss_mib(), trace._rss()
    extra = before - now + 64  # MiB: enough to pass the earlier peak by 64 MiB
    buffer = torch.ones(int(extra * 2**20) // 4)  # written, so resident
    assert common.peak_rss_mib() >= before + 48, (before, now, common.peak_rss_mib())
    del buffer
