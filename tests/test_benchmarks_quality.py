"""The quality benchmark (benchmarks/quality*.py): the Llama-equivalent interpolation on known curves, the per-point
and paired verdicts, the Transformers LR schedule, and a smoke run of the whole pipeline at tiny settings that checks
the JSON it writes and its re-analysis."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from conftest import benchmark_modules


@pytest.fixture(scope="module")
def bench():
    """The benchmark modules, imported by name as the scripts import one another."""
    names = ("quality", "quality_analysis", "quality_runner", "quality_setup")
    with benchmark_modules(*names) as modules:
        yield dict(zip(("quality", "analysis", "runner", "setup"), modules, strict=True))


@pytest.fixture(scope="module")
def quality(bench):
    return bench["quality"]


@pytest.fixture(scope="module")
def analysis(bench):
    return bench["analysis"]


@pytest.fixture(scope="module")
def runner(bench):
    return bench["runner"]


@pytest.fixture(scope="module")
def setup(bench):
    return bench["setup"]


# A Llama curve exactly linear in log2(parameters): every doubling lowers the loss by 0.1 nats.
PARAMS = [1e5, 2e5, 4e5, 8e5]
LOSSES = [2.0, 1.9, 1.8, 1.7]


@pytest.mark.parametrize(
    ("loss", "expected", "status"),
    [
        (1.9, 2e5, "interpolated"),  # a measured point
        (1.85, 2e5 * math.sqrt(2), "interpolated"),  # halfway between 2e5 and 4e5 in log-parameters
        (1.76, 4e5 * 2**0.4, "interpolated"),
        (2.0, 1e5, "interpolated"),  # the ends are inside the range
        (1.7, 8e5, "interpolated"),
        (1.65, 8e5 * math.sqrt(2), "extrapolated_above_largest"),  # last segment extended by half a doubling
        (2.05, 1e5 / math.sqrt(2), "extrapolated_below_smallest"),
        (1.5, None, "beyond_largest"),  # would need 4x the largest Llama: more than the 2x limit
        (2.2, None, "beyond_smallest"),
    ],
)
def test_llama_equivalent_on_a_log_linear_curve(analysis, loss, expected, status):
    eq, got = analysis.llama_equivalent(PARAMS, LOSSES, loss)
    assert got == status
    if expected is None:
        assert eq is None
    else:
        assert eq == pytest.approx(expected, rel=1e-9)


def test_llama_equivalent_ignores_input_order_and_inverts_llama_loss_at(analysis):
    order = [2, 0, 3, 1]
    for loss in (1.95, 1.83, 1.71):
        a, _ = analysis.llama_equivalent(PARAMS, LOSSES, loss)
        b, _ = analysis.llama_equivalent([PARAMS[i] for i in order], [LOSSES[i] for i in order], loss)
        assert a == pytest.approx(b, rel=1e-12)
        assert analysis.llama_loss_at(PARAMS, LOSSES, a) == pytest.approx(loss, abs=1e-12)


def test_llama_equivalent_on_a_non_monotone_curve_uses_the_isotonic_fit(analysis):
    # 4e5 is worse than 2e5: pooled to 1.85 for both; a loss on the plateau maps to its smallest model
    losses = [2.0, 1.8, 1.9, 1.7]
    assert analysis.isotonic_decreasing(losses) == pytest.approx([2.0, 1.85, 1.85, 1.7])
    assert analysis.llama_equivalent(PARAMS, losses, 1.85)[0] == pytest.approx(2e5)
    assert analysis.llama_equivalent(PARAMS, losses, 1.775)[0] == pytest.approx(math.sqrt(4e5 * 8e5))
    assert analysis.llama_equivalent([1e5, 2e5], [1.8, 1.8], 1.8) == (None, "undefined")
    assert analysis.llama_equivalent(PARAMS, LOSSES, float("nan")) == (None, "undefined")


def _runs(contender, size, params, losses):
    return [
        {
            "contender": contender,
            "size": size,
            "seed": i,
            "parameters": params,
            "formula_parameters": params,
            "val_loss": v,
        }
        for i, v in enumerate(losses)
    ]


def test_analyse_ratios_and_noise_labels(analysis):
    sizes = {"a": {}, "b": {}, "c": {}, "d": {}}
    runs = []
    for size, n, loss in zip(sizes, PARAMS, LOSSES):
        runs += _runs("llama", size, int(n), [loss - 0.002, loss, loss + 0.002])
    # 2e5 parameters at Llama-4e5 loss: ratio 2, far outside the seed noise
    runs += _runs("better", "b", 200_000, [1.798, 1.8, 1.802])
    # 2e5 parameters, 0.001 nats off the Llama curve with a spread of 0.01: inside the noise
    runs += _runs("same", "b", 200_000, [1.891, 1.901, 1.911])
    out = analysis.analyse(runs, sizes)
    better, same = out["comparisons"]["better"]["b"], out["comparisons"]["same"]["b"]
    assert better["efficiency_ratio"] == pytest.approx(2.0)
    assert better["llama_equivalent_parameters"] == 400_000
    assert better["status"] == "interpolated"
    assert better["verdict"] == "below the Llama curve (better)"
    assert better["loss_minus_llama_same_size"] == pytest.approx(-0.1)
    assert same["verdict"] == "within seed noise"
    assert same["same_size_within_noise"] is True
    assert out["goal"]["met_by"] == ["better"]
    assert out["llama_curve"]["monotone"] is True
    assert out["results"]["llama"]["a"]["val_loss"]["std"] == pytest.approx(0.002)


def test_lr_schedule_is_transformers_cosine_with_min_lr(runner, setup):
    """Warmup from 0 to the peak over 5% of the steps, then non-increasing to min_lr_fraction x peak after the last
    step; equal to what the scheduler sets on a real optimiser step by step."""
    steps, peak = 100, 1e-2
    lrs = [runner.lr_at(s, steps, peak) for s in range(steps + 1)]
    floor = setup.OPTIMIZER["min_lr_fraction"] * peak
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(peak) and max(lrs) == pytest.approx(peak)
    assert all(a >= b - 1e-15 for a, b in zip(lrs[5:], lrs[6:]))
    assert lrs[-1] == pytest.approx(floor) and min(lrs[5:]) >= floor - 1e-15
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    schedule = runner.lr_schedule(optimizer, steps)
    for s in range(steps):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lrs[s], abs=1e-15)
        optimizer.step()
        schedule.step()


def test_curve_standard_error_is_that_of_the_points_compared(analysis):
    """At a measured size the curve's standard error is that point's own; halfway (in log parameters) between two
    points it is sqrt(se_a^2 + se_b^2) / 2; where the isotonic fit pools two points, their mean's."""
    ses = [0.001, 0.002, 0.04, 0.003]
    assert analysis.llama_curve_standard_error(PARAMS, LOSSES, ses, 2e5) == pytest.approx(0.002)
    mid = analysis.llama_curve_standard_error(PARAMS, LOSSES, ses, 2e5 * math.sqrt(2))
    assert mid == pytest.approx(math.sqrt(0.002**2 + 0.04**2) / 2)
    pooled = analysis.llama_curve_standard_error(PARAMS, [2.0, 1.8, 1.9, 1.7], ses, 2e5)
    assert pooled == pytest.approx(math.sqrt(0.002**2 + 0.04**2) / 2)


def test_verdict_uses_the_local_llama_noise_not_an_average(analysis):
    """A point 0.01 nats below a precisely measured Llama size is better, although one noisy Llama size elsewhere
    would make an averaged standard error call it noise; paired by seed, a constant shift is resolved even when the
    seeds spread widely."""
    sizes = {"a": {}, "b": {}, "c": {}, "d": {}}
    spreads = {"a": 0.001, "b": 0.001, "c": 0.001, "d": 0.2}
    runs = []
    for size, n, loss in zip(sizes, PARAMS, LOSSES):
        s = spreads[size]
        runs += _runs("llama", size, int(n), [loss - s, loss, loss + s])
    runs += _runs("shifted", "b", 200_000, [1.889, 1.890, 1.891])
    out = analysis.analyse(runs, sizes)
    row = out["comparisons"]["shifted"]["b"]
    assert row["verdict"] == "below the Llama curve (better)"
    averaged = 2.0 * math.sqrt(row["val_loss_se"] ** 2 + statistics.fmean(out["llama_curve"]["standard_errors"]) ** 2)
    assert abs(row["loss_minus_llama_curve"]) < averaged  # the old rule's threshold would have hidden it

    wide = []
    for size, n, loss in zip(sizes, PARAMS, LOSSES):
        wide += _runs("llama", size, int(n), [loss - 0.05, loss + 0.05, loss])
    wide += _runs("paired", "b", 200_000, [1.9 - 0.05 - 0.01, 1.9 + 0.05 - 0.01, 1.9 - 0.01])
    row = analysis.analyse(wide, sizes)["comparisons"]["paired"]["b"]
    assert row["verdict"] == "within seed noise"  # unpaired, the seeds' spread hides the shift
    assert row["paired_difference_same_size"]["mean"] == pytest.approx(-0.01)
    assert row["same_size_verdict"] == "below the same-size Llama (better)"


def test_caveats_flag_a_reused_sweep_winner_and_an_overfitting_budget(quality):
    """A grid point that is the LR sweep's selected run is flagged (and marked in lr_sweep); several passes over the
    training tokens with a large validation-training gap are called an overfitting regime."""
    run = {"contender": "llama", "size": "d32", "seed": 0, "lr": 4e-3, "val_loss": 2.5, "train_loss_last_5pct": 1.8}
    payload = {
        "lr_sweep": {"model": "llama/d32", "seed": 0, "chosen_lr": 4e-3},
        "runs": [run, dict(run, seed=1, val_loss=2.4)],
        "budget": {"epochs_per_run": 6.0, "seeds": [0, 1]},
        "corpus": {"train_tokens": 380_000},
    }
    notes = quality.caveats(payload)
    assert any("d32/seed 0 point is the LR sweep's winning run" in n for n in notes)
    assert payload["lr_sweep"]["reused_as_grid_run"].startswith("llama/d32/seed 0")
    assert any("overfitting regime" in n and "0.60 to 0.70 nats" in n for n in notes)
    payload["lr_sweep"]["seed"] = quality.SWEEP_SEED  # a sweep outside the grid: nothing reused
    payload["budget"]["epochs_per_run"] = 0.5
    notes = quality.caveats(payload)
    assert not any("winning run" in n or "overfitting" in n for n in notes)
    assert "reused_as_grid_run" not in payload["lr_sweep"]


def test_quick_run_writes_the_documented_json(quality, setup, shared_data, tmp_path, monkeypatch):
    import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    threads = torch.get_num_threads()
    contenders = ["llama", "relational_pivot", "relational_free_projected", "relational_thin4_gqa"]
    argv = [
        "--quick",
        "--corpus",
        "shakespeare",
        "--steps",
        "6",
        "--workers",
        "1",
        "--contenders",
        ",".join(contenders),
    ]
    (payload,) = quality.main(argv)
    assert torch.get_num_threads() == threads  # the run restores the caller's thread count

    data = json.loads((tmp_path / "quality_shakespeare_quick.json").read_text())
    assert (tmp_path / "quality_shakespeare_quick.png").stat().st_size > 0
    assert data["results"] == json.loads(json.dumps(payload["results"]))
    for key in ("machine", "command", "corpus", "budget", "optimizer", "lr_sweep", "sizes", "contenders", "skipped"):
        assert key in data
    assert "partial" not in data
    assert data["corpus"]["vocab_size"] == 65  # character level, as nanoGPT
    assert data["budget"]["tokens_per_run"] == 6 * setup.BATCH_SIZE * setup.CONTEXT
    assert data["optimizer"]["peak_lr"] == data["lr_sweep"]["chosen_lr"]
    assert data["optimizer"]["peak_lr"] in setup.BUDGETS["quick"]["sweep_lrs"]
    # the sweep runs on a seed outside the grid: no grid point is the run it selected
    assert data["lr_sweep"]["seed"] not in data["budget"]["seeds"] and "reused_as_grid_run" not in data["lr_sweep"]
    assert not any("LR sweep's winning run" in c for c in data["caveats"])
    ran = [c for c in contenders if c not in data["skipped"]]
    assert set(data["results"]) == set(ran)
    assert all(data["skipped"].values())  # a skipped contender says why
    assert len(data["runs"]) == len(ran) * len(setup.QUICK_SIZES) * 2
    for run in data["runs"]:
        assert run["parameters"] == run["formula_parameters"]  # stored count = relational_hf.params' formula
        assert run["tokens"] == data["budget"]["tokens_per_run"]
    for contender in ran:
        for size in setup.QUICK_SIZES:
            loss = data["results"][contender][size]["val_loss"]
            assert loss["n"] == 2 and math.isfinite(loss["mean"]) and loss["std"] is not None
            if contender != "llama":
                row = data["comparisons"][contender][size]
                for key in ("llama_equivalent_parameters", "efficiency_ratio", "status", "verdict"):
                    assert key in row
    # thin keys with GQA store fewer parameters than the pivot model of the same size
    assert (
        data["results"]["relational_thin4_gqa"]["q32"]["parameters"]
        < data["results"]["relational_pivot"]["q32"]["parameters"]
    )

    # --resume keeps every run made with the same settings and only trains what is new
    argv = [*argv[:-1], ",".join([*contenders, "relational_pivot_vpr"]), "--resume"]
    (again,) = quality.main(argv)
    assert again["reused_runs"] == len(data["runs"])
    assert again["lr_sweep"] == data["lr_sweep"]
    assert again["results"]["llama"] == payload["results"]["llama"]
    assert again["results"]["relational_pivot_vpr"]["q16"]["val_loss"]["n"] == 2
    assert again["caveats"] and "verdict_rule" in again

    # --reanalyse recomputes the stored file's analysis from its runs: same rule, same verdicts, nothing trained
    assert quality.main(["--quick", "--corpus", "shakespeare", "--reanalyse"]) == []
    redone = json.loads((tmp_path / "quality_shakespeare_quick.json").read_text())
    assert redone["verdict_changes"]["changes"] == []
    assert redone["comparisons"] == json.loads(json.dumps(again["comparisons"]))
    assert redone["runs"] == json.loads(json.dumps(again["runs"]))
