"""`benchmarks/compress_speed.py`: the speed-ups are the ratios of the rounds' medians (and of their best rounds) to
the dense model's, for every model timed, the rounds alternate their order, and a bad `--tag` is refused in one line
before anything loads."""

from __future__ import annotations

import argparse
import statistics

import pytest
from conftest import benchmark_modules


@pytest.fixture(scope="module")
def speed():
    with benchmark_modules("compress_speed") as (module,):
        yield module


def test_speedups_are_ratios_of_medians_and_of_best_rounds_for_every_model(speed, monkeypatch):
    walls = {"dense": [4.0, 2.0, 3.0], "compressed": [2.0, 1.0, 4.0], "compressed_kept": [1.0, 2.0, 2.0]}
    calls = []

    def fake_measure(model, args, device, generator):
        calls.append(model)
        r = sum(1 for m in calls if m == model) - 2  # the first call of each model is the warm-up round
        wall = walls[model][max(r, 0)]
        return {case: (wall, 2 * wall, 8) for case in speed.CASES}

    monkeypatch.setattr(speed, "measure", fake_measure)
    monkeypatch.setattr(speed, "load_average", lambda: (0.0, 0.0, 0.0))
    out = speed.compare("dense", "compressed", argparse.Namespace(rounds=3), "cpu", kept="compressed_kept")
    assert calls[:3] == ["dense", "compressed", "compressed_kept"] and calls[3:6] == calls[2::-1]
    for name, suffix in (("compressed", ""), ("compressed_kept", "_kept")):
        for case in speed.CASES:
            median = statistics.median(8 / w for w in walls[name]) / statistics.median(8 / w for w in walls["dense"])
            best = max(8 / w for w in walls[name]) / max(8 / w for w in walls["dense"])
            assert out["speedup" + suffix][case] == pytest.approx(median)
            assert out["speedup_best" + suffix][case] == pytest.approx(best)
            assert out["speedup_cpu_time" + suffix][case] == pytest.approx(median)
    calls.clear()
    plain = speed.compare("dense", "compressed", argparse.Namespace(rounds=1), "cpu")
    assert "compressed_kept" not in plain and "speedup_kept" not in plain


@pytest.mark.parametrize("tag", ["../x", "a/b", "x y"])
def test_a_tag_that_is_not_a_plain_name_is_refused(speed, tag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        speed.main(["--tag", tag])
    assert exit_info.value.code == 2 and "--tag" in capsys.readouterr().err


def test_both_models_are_timed_from_newly_allocated_memory_with_ties_kept(speed):
    """in_own_memory gives every parameter and buffer new storage with the same values, and a tied head stays the
    embedding (one tensor)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    before = {n: (t.data_ptr(), t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    speed.in_own_memory(model)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.data_ptr() != before[name][0] and torch.equal(t, before[name][1]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("gauge", [["--gauge", "free"], []])
def test_keeping_assembled_weights_in_the_free_gauge_is_refused(speed, capsys, gauge):
    """The free gauge (the default) has no gauge-fixed weight to keep: --keep-assembled without --gauge pivot is
    refused in one line that names the way out."""
    with pytest.raises(SystemExit) as exit_info:
        speed.main([*gauge, "--keep-assembled"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--keep-assembled" in err and "--gauge pivot" in err


def test_widths_come_from_a_benchmark_result_or_a_compress_report(speed):
    """`--widths-from` reads the relational cells of a compress benchmark result (ok cells only, other methods left
    out) or the share and widths of one `relational-hf compress` report; anything else gives nothing (then refused)."""
    w1, w2 = {"qk": [8], "vo": [8], "mlp": [64]}, {"qk": [6], "vo": [4], "mlp": [32]}
    cells = {
        "a": {"method": "relational", "target": 0.25, "status": "ok", "details": {"widths": w1}},
        "b": {"method": "relational", "target": 0.5, "status": "failed", "details": {"widths": w2}},
        "c": {"method": "slice", "target": 0.1, "status": "ok", "details": {"widths": w2}},
    }
    assert speed.planned_widths({"cells": cells}) == {0.25: w1}
    assert speed.planned_widths({"remove": 0.3, "widths": w2, "parameters_after": 1}) == {0.3: w2}
    for other in ({"levels": {}}, [], {"remove": 0.3}, {"widths": w2}):
        assert speed.planned_widths(other) == {}
