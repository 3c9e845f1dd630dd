"""Training dynamics on the quotient: the trajectory callback records only the chosen steps and its file reloads to
the same arrays (with NumPy alone); horizontal updates record a vertical share near zero and AdamW updates do not;
a random symmetry move is invisible in the invariant coordinates and large in the raw ones; the plots and the
`dynamics` command run on recorded files."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_symmetry_zoo import build, perturb
from tiny_models import periodic_data, tiny_relational
from transformers import Trainer, TrainingArguments

from relational_hf import RelationalForCausalLM
from relational_hf.commands.main import main
from relational_hf.dynamics import (
    TRAJECTORY_NAME,
    ParameterSketch,
    QuotientRecorder,
    QuotientTrajectoryCallback,
    coordinate_distances,
    final_distances,
    load_trajectory,
    save_trajectory,
)
from relational_hf.symmetry import ProjectedOptimizer, UpdateProjector, apply_random_symmetry
from relational_hf.training import RelationalTrainer, RelationalTrainingArguments

STEPS, EVERY = 10, 4


def relational(gauge: str = "free") -> RelationalForCausalLM:
    return tiny_relational(gauge, seed=0)


def arguments(path, cls=TrainingArguments, **overrides):
    settings = dict(
        output_dir=str(path), per_device_train_batch_size=8, max_steps=STEPS, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    return cls(**(settings | overrides))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two short runs of one free-gauge model: plain `Trainer` with AdamW, and `RelationalTrainer` with projection."""
    root = tmp_path_factory.mktemp("dynamics")
    probe = torch.stack([row["input_ids"] for row in periodic_data(4)])
    out = {}
    for name, trainer_cls, args in (
        ("adamw", Trainer, arguments(root / "adamw")),
        ("projected", RelationalTrainer,
         arguments(root / "projected", RelationalTrainingArguments, symmetry_projection="update")),
    ):  # fmt: skip
        callback = QuotientTrajectoryCallback(every=EVERY, probe_input_ids=probe)
        trainer = trainer_cls(model=relational(), args=args, train_dataset=periodic_data(), callbacks=[callback])
        trainer.train()
        out[name] = (trainer, callback, root / name)
    return out


def test_callback_records_only_the_chosen_steps_and_the_file_reloads_to_the_same_arrays(runs):
    trainer, callback, folder = runs["adamw"]
    assert trainer.state.global_step == STEPS
    in_memory = callback.recorder.trajectory()
    assert in_memory.steps.tolist() == [0, 4, 8, 10]  # start, every 4th step, the last step: not every step
    assert [f.name for f in folder.iterdir()] == [TRAJECTORY_NAME]  # one file, no temporary left behind
    loaded = load_trajectory(folder)
    assert loaded.arrays.keys() == in_memory.arrays.keys()
    for key, value in in_memory.arrays.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
        assert loaded[key].dtype == value.dtype, key
    with np.load(folder / TRAJECTORY_NAME, allow_pickle=False) as raw:  # plain NumPy: no model, no pickle
        np.testing.assert_array_equal(raw["canonical_sketch"], in_memory["canonical_sketch"])
    assert loaded.metadata["label"] == "adamw" and loaded.metadata["projection"] is False
    assert loaded["loss_step"].tolist() == list(range(1, STEPS + 1))  # the Trainer's logged losses
    assert loaded["qk_spectrum"].shape == (4, 2, 4, 8) and loaded["parallel_ratio"].shape == (4, 2, 2)
    assert np.isnan(loaded["update_norm"][0]) and (loaded["update_norm"][1:] > 0).all()


def test_recorder_schedule_records_every_step_only_when_asked():
    model = relational()
    assert [s for s in range(13) if QuotientRecorder(model, every=5).due(s)] == [0, 5, 10]
    assert [s for s in range(13) if QuotientRecorder(model, every=None, steps=[3, 7]).due(s)] == [3, 7]
    assert all(QuotientRecorder(model, every=1).due(s) for s in range(13))


def test_adamw_updates_have_a_vertical_part_and_gradients_do_not(runs):
    """The Euclidean gradient of the invariant loss is horizontal (DESIGN 2.3); AdamW's per-coordinate scaling and
    weight decay move the weights along the orbits."""
    trajectory = runs["adamw"][1].recorder.trajectory()
    assert (trajectory.vertical_share("update")[1:] > 1e-2).all()
    assert (trajectory.vertical_share("gradient")[1:] < 1e-5).all()
    # the split is orthogonal: |Delta|^2 = |P_V Delta|^2 + |Delta - P_V Delta|^2
    for kind in ("update", "interval"):
        total, v, h = (trajectory[f"{kind}_{p}"][1:] for p in ("norm", "vertical_norm", "horizontal_norm"))
        np.testing.assert_allclose(total**2, v**2 + h**2, rtol=1e-6)
    assert 0 < trajectory.gauge_share() < 1


def _horizontal_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, projector: UpdateProjector) -> None:
    """An AdamW step replaced by its horizontal part delta - P_V(delta), P_V at the weights before the step."""
    params = projector.params
    old = {k: p.detach().clone() for k, p in params.items()}
    optimizer.step()
    with torch.no_grad():
        delta = {k: p.detach().double() - old[k].double() for k, p in params.items()}
        for k, p in params.items():
            p.copy_(old[k])
        vertical = projector.vertical_part(delta)
        for k, p in params.items():
            p.copy_(old[k].double() + delta[k] - vertical[k])


def test_horizontal_updates_record_a_vertical_share_near_zero():
    model = relational()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    projector = UpdateProjector(model, tol=1e-12)
    recorder = QuotientRecorder(model, every=2)
    ids = torch.stack([row["input_ids"] for row in periodic_data(8)])
    recorder.record(0)
    for step in range(1, 5):
        model(input_ids=ids, labels=ids).loss.backward()
        due = recorder.due(step)
        if due:
            recorder.before_update()
        _horizontal_step(model, optimizer, projector)
        if due:
            recorder.after_update()
        optimizer.zero_grad()
        if due:
            recorder.record(step)
    share = recorder.trajectory().vertical_share("update")
    assert share.size == 3 and (share[1:] < 1e-3).all()


def test_relational_trainer_projection_records_a_vertical_share_near_zero(runs):
    trainer, callback, _ = runs["projected"]
    assert isinstance(trainer.optimizer.optimizer, ProjectedOptimizer)
    trajectory = callback.recorder.trajectory()
    assert trajectory.metadata["projection"] is True
    assert (trajectory.vertical_share("update")[1:] < 1e-3).all()


def test_relational_trainer_projection_lowers_the_vertical_share(runs):
    projected = runs["projected"][1].recorder.trajectory().vertical_share("update")[1:]
    free = runs["adamw"][1].recorder.trajectory().vertical_share("update")[1:]
    assert (projected < 0.5 * free).all()


@pytest.mark.parametrize("name", ["relational_free", "relational_pivot", "llama", "trained"])
def test_a_symmetry_move_is_invisible_in_invariant_coordinates_and_large_in_raw_ones(name, runs):
    if name == "trained":
        model = copy.deepcopy(runs["adamw"][0].model).double()
    else:
        model = perturb(build(name)).double()
    recorder = QuotientRecorder(model)
    moved = apply_random_symmetry(copy.deepcopy(model), torch.Generator().manual_seed(5), scale=0.5)
    distance = coordinate_distances(recorder.coordinates(), recorder.coordinates(moved))
    assert distance["raw"] > 0.05
    assert distance["canonical"] < 1e-5
    assert distance["descriptors"] < 1e-5 and distance["descriptors_sorted_heads"] < 1e-5


def test_sketch_is_a_fixed_linear_map_that_roughly_keeps_distances():
    shapes = [(30, 40), (50,), (7, 9, 11)]
    generator = torch.Generator().manual_seed(0)
    x = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    y = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    sketch = ParameterSketch(shapes, dim=512, seed=3)
    np.testing.assert_allclose(sketch([a + b for a, b in zip(x, y)]), sketch(x) + sketch(y), atol=1e-9)
    exact = torch.cat([(a - b).reshape(-1) for a, b in zip(x, y)]).norm().item()
    assert abs(np.linalg.norm(sketch(x) - sketch(y)) / exact - 1) < 0.2
    same, other = ParameterSketch(shapes, dim=512, seed=3), ParameterSketch(shapes, dim=512, seed=4)
    assert same.signature == sketch.signature != other.signature
    np.testing.assert_array_equal(same(x), sketch(x))
    assert not np.allclose(other(x), sketch(x))


def test_dynamics_command_writes_the_figures_and_summary(runs, tmp_path, capsys):
    folders = [runs["adamw"][2], runs["projected"][2]]
    out = tmp_path / "plots"
    assert main(["dynamics", *[str(f) for f in folders], "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"trajectories.png", "distance.png", "vertical_share.png", "summary.json"} <= names
    assert "seed_distances.png" not in names  # two different settings: no seed pair to compare
    assert "gauge share of motion" in capsys.readouterr().out
    # two runs of one setting (here: the same two files relabelled) give the seed-distance figure (d)
    for i, folder in enumerate(folders):
        trajectory = load_trajectory(folder)
        trajectory.metadata.update(group="one setting", label=f"seed {i}")
        save_trajectory(trajectory, tmp_path / "runs" / f"seed{i}" / TRAJECTORY_NAME)
    assert main(["dynamics", str(tmp_path / "runs"), "--out", str(tmp_path / "seeds")]) == 0
    assert (tmp_path / "seeds" / "seed_distances.png").is_file()


def test_resuming_from_a_checkpoint_continues_the_trajectory(tmp_path):
    args = arguments(tmp_path, max_steps=6, save_strategy="steps", save_steps=4)
    Trainer(model=relational(), args=args, train_dataset=periodic_data(),
            callbacks=[QuotientTrajectoryCallback(every=3)]).train()  # fmt: skip
    assert load_trajectory(tmp_path).steps.tolist() == [0, 3, 6]
    callback = QuotientTrajectoryCallback(every=3)
    args = arguments(tmp_path, max_steps=8, save_strategy="no")
    Trainer(model=relational(), args=args, train_dataset=periodic_data(), callbacks=[callback]).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-4")
    )
    trajectory = load_trajectory(tmp_path)
    assert trajectory.steps.tolist() == [0, 3, 4, 6, 8]  # the first run's records up to step 4 are kept
    assert np.isnan(trajectory["interval_norm"][2]) and np.isfinite(trajectory["interval_norm"][3])
    assert trajectory["loss_step"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    np.testing.assert_allclose(trajectory["balance_drift"][0], 0.0)  # the drift still refers to the first record
    assert (trajectory["balance_drift"][-1] > 0).all()


def test_pivot_runs_with_different_pivot_positions_are_compared_in_invariants_only():
    """Two pivot-gauge models from different seeds store their free entries at different pivot positions: their raw
    and canonical sketches are not comparable (left out), their invariants are; two free-gauge models are compared raw."""
    trajectories = {}
    for gauge in ("pivot", "free"):
        for seed in (0, 1):
            recorder = QuotientRecorder(tiny_relational(gauge, seed=seed), every=1)
            recorder.record(0)
            trajectories[gauge, seed] = recorder.trajectory()
    pivots = [trajectories["pivot", seed] for seed in (0, 1)]
    assert pivots[0].metadata["layout_signature"] != pivots[1].metadata["layout_signature"]
    distances = final_distances(pivots)
    assert "raw" not in distances and "canonical" not in distances  # no comparable pair: left out
    assert np.isfinite(distances["descriptors"][0, 1])
    free = final_distances([trajectories["free", seed] for seed in (0, 1)])
    assert np.isfinite(free["raw"][0, 1]) and free["raw"][0, 1] > 0
