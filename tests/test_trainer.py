"""RelationalTrainer: projection and suppression train and log; off, it is plain Trainer; gradient accumulation and
resuming are exact; the suppression term is the mean cos^2 the directional toolkit measures."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, periodic_data, tiny_llama, tiny_relational
from transformers import Trainer, TrainerCallback, TrainingArguments

from relational_hf.directional import decompose
from relational_hf.directional.suppression import ParallelSuppression
from relational_hf.symmetry import ProjectedOptimizer
from relational_hf.training import RelationalTrainer, RelationalTrainingArguments
from relational_hf.training.trainer import STATE_NAME

#: real lengths of the padded sequences: the first four hold 45 tokens, the last four 18, so a micro-batch mean is not
#: the batch mean
LENGTHS = (12, 12, 11, 10, 3, 4, 5, 6)


def padded_data(n: int = 8, length: int = 12) -> list[dict[str, torch.Tensor]]:
    """Random sequences of unequal length (right padding, attention_mask 0 and labels -100 there)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        mask = (torch.arange(length) < LENGTHS[i % len(LENGTHS)]).long()
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def arguments(tmp_path, cls=RelationalTrainingArguments, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return cls(**(settings | overrides))


class LogRecorder(TrainerCallback):
    """What reporting integrations (TensorBoard, W&B, ...) receive: the logs of every on_log event."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_projection_and_suppression_lower_the_loss_and_log_the_extra_terms(tmp_path):
    recorder = LogRecorder()
    args = arguments(
        tmp_path, max_steps=24, logging_steps=6, symmetry_projection="update", parallel_suppression_coef=0.3,
        parallel_suppression_site="value",
    )  # fmt: skip
    trainer = RelationalTrainer(model=tiny_relational(), args=args, train_dataset=periodic_data(), callbacks=[recorder])
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, ProjectedOptimizer)
    assert trainer.optimizer.optimizer.projected_steps == 24
    logs = [entry for entry in recorder.logs if "loss" in entry]
    assert len(logs) == 4
    for entry in logs:
        assert {"task_loss", "parallel_suppression", "parallel_ratio", "orbit_drift"} <= entry.keys()
        assert entry["loss"] == pytest.approx(entry["task_loss"] + entry["parallel_suppression"], rel=1e-5)
        assert 0 < entry["parallel_suppression"] <= 0.3  # lambda * mean cos^2, cos^2 in [0, 1]
        assert entry["parallel_ratio"] > 0 and entry["orbit_drift"] >= 0
    assert logs[-1]["task_loss"] < logs[0]["task_loss"] - 0.5
    assert logs[-1]["parallel_suppression"] < logs[0]["parallel_suppression"]


def test_defaults_compute_exactly_what_plain_trainer_computes(tmp_path):
    torch.manual_seed(0)
    model_a = tiny_relational()
    start = {k: v.clone() for k, v in model_a.state_dict().items()}
    model_b = tiny_relational()
    model_b.load_state_dict(start)
    data = periodic_data(32)
    plain = Trainer(model=model_a, args=arguments(tmp_path / "a", cls=TrainingArguments), train_dataset=data)
    plain.train()
    ours = RelationalTrainer(model=model_b, args=arguments(tmp_path / "b"), train_dataset=data)
    ours.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain, ours)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    assert torch.equal(flat(model_a), flat(model_b))
    # with lambda > 0 the first step's task loss is still plain Trainer's (same weights, same batch), and the
    # logged loss adds the suppression term to it
    model_c = tiny_relational()
    model_c.load_state_dict(start)
    args = arguments(tmp_path / "c", parallel_suppression_coef=1.0)
    suppressed = RelationalTrainer(model=model_c, args=args, train_dataset=data)
    suppressed.train()
    first = suppressed.state.log_history[0]
    assert first["task_loss"] == pytest.approx(losses[0][0], rel=1e-6)
    assert first["loss"] > first["task_loss"] + 1e-3


@pytest.mark.parametrize("site", ["residual", "value"])
def test_gradient_accumulation_2x4_equals_batch_8_with_suppression(tmp_path, site):
    """One SGD step (update = -lr * gradient, so any mis-scaling shows) from the same start on the same 8 padded
    sequences: 2 micro-batches of 4 with accumulation give the update of one batch of 8."""
    torch.manual_seed(0)
    start = tiny_relational()
    results = []
    for batch, accumulation in ((8, 1), (4, 2)):
        model = tiny_relational()
        model.load_state_dict(start.state_dict())
        args = arguments(
            tmp_path / f"{batch}", per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
            max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant",
            parallel_suppression_coef=5.0, parallel_suppression_site=site, train_sampling_strategy="sequential",
        )  # fmt: skip
        trainer = RelationalTrainer(model=model, args=args, train_dataset=padded_data())
        trainer.train()
        results.append((flat(model) - flat(start), trainer.state.log_history[0]))
    (full, full_log), (accumulated, accumulated_log) = results
    assert full.abs().max() > 1e-3
    torch.testing.assert_close(accumulated, full, rtol=1e-4, atol=1e-6)
    assert accumulated_log["parallel_suppression"] == pytest.approx(full_log["parallel_suppression"], rel=1e-5)
    assert accumulated_log["task_loss"] == pytest.approx(full_log["task_loss"], rel=1e-5)


def test_resumed_run_continues_with_the_same_losses(tmp_path):
    """Projection and suppression on: 6 steps in one go equal 3 steps, a checkpoint, and 3 resumed steps."""

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                control.should_training_stop = True

    torch.manual_seed(0)
    start = tiny_relational(gauge="free").state_dict()
    settings = dict(
        max_steps=6, save_strategy="steps", save_steps=3, symmetry_projection="update",
        parallel_suppression_coef=0.5, per_device_train_batch_size=4,
    )  # fmt: skip

    def run(directory, callbacks=(), resume=None):
        model = tiny_relational(gauge="free")
        model.load_state_dict(start)
        trainer = RelationalTrainer(
            model=model, args=arguments(directory, **settings), train_dataset=periodic_data(64),
            callbacks=list(callbacks),
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return model, {h["step"]: h for h in trainer.state.log_history if "loss" in h}

    whole_model, whole = run(tmp_path / "whole")
    run(tmp_path / "split", callbacks=[StopAt()])
    checkpoint = tmp_path / "split" / "checkpoint-3"
    assert (checkpoint / STATE_NAME).is_file()
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert saved["symmetry_projection"]["projected_steps"] == 3
    resumed_model, resumed = run(tmp_path / "split", resume=str(checkpoint))
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # the log history up to the checkpoint is restored too
    for step in (4, 5, 6):
        for key in ("loss", "task_loss", "parallel_suppression", "orbit_drift"):
            assert resumed[step][key] == pytest.approx(whole[step][key], rel=1e-6, abs=1e-9), (step, key)
    torch.testing.assert_close(flat(resumed_model), flat(whole_model), rtol=0, atol=1e-6)


def test_suppression_measures_the_mean_cos2_of_the_directional_toolkit():
    """mean cos^2(y, z) of ParallelSuppression = the parallel energy that `decompose` reports, averaged over the
    sites and layers (no padding), for both site groups."""
    model = tiny_relational(gauge="pivot").eval()
    ids = torch.randint(0, VOCAB, (3, 10))
    for site, sites in (("residual", ("residual_attention", "residual_mlp")), ("value", ("value",))):
        suppression = ParallelSuppression(model, site)
        with suppression.installed(), torch.no_grad():
            suppression.start()
            model(input_ids=ids)
            batch = suppression.stop()
        report = decompose(model, ids, sites=sites)
        energies = [layer.parallel_energy for s in sites for layer in report.sites[s]]
        assert batch.units == len(energies)
        assert batch.mean_energy.item() == pytest.approx(sum(energies) / len(energies), rel=1e-4)


def test_suppression_with_activation_checkpointing_takes_the_same_steps(tmp_path):
    """The hooks stay installed through the backward pass, so recomputation runs the same (value-site) kernel and
    is not measured twice: activation checkpointing leaves losses and weights unchanged."""
    torch.manual_seed(0)
    start = tiny_relational().state_dict()
    outcomes = []
    for checkpointing in (False, True):
        model = tiny_relational()
        model.load_state_dict(start)
        args = arguments(
            tmp_path / str(checkpointing), max_steps=2, activation_checkpointing=checkpointing,
            parallel_suppression_coef=1.0, parallel_suppression_site="value",
        )  # fmt: skip
        trainer = RelationalTrainer(model=model, args=args, train_dataset=periodic_data(16))
        trainer.train()
        outcomes.append(([h["loss"] for h in trainer.state.log_history if "loss" in h], flat(model)))
    assert outcomes[0][0] == pytest.approx(outcomes[1][0], rel=1e-6)
    torch.testing.assert_close(outcomes[0][1], outcomes[1][1], rtol=1e-5, atol=1e-7)


def test_projection_on_a_llama_model_reduces_the_orbit_drift(tmp_path):
    """Plain AdamW moves a Llama model along its symmetry orbits (the balance drifts); the projected optimiser
    keeps every step horizontal, so the drift it logs is much smaller."""
    torch.manual_seed(0)
    start = tiny_llama().state_dict()
    drift = {}
    for projection in ("none", "update"):
        model = tiny_llama()
        model.load_state_dict(start)
        args = arguments(tmp_path / projection, max_steps=8, logging_steps=8, symmetry_projection=projection)
        trainer = RelationalTrainer(model=model, args=args, train_dataset=periodic_data(64))
        trainer.train()
        drift[projection] = trainer.state.log_history[0]["orbit_drift"]
    assert drift["update"] < 0.5 * drift["none"]


def test_invalid_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="parallel_suppression_site"):
        arguments(tmp_path, parallel_suppression_site="mlp")
    with pytest.raises(ValueError, match="symmetry_projection"):
        arguments(tmp_path, symmetry_projection="always")
    with pytest.raises(ValueError, match="parallel_suppression_coef"):
        arguments(tmp_path, parallel_suppression_coef=-1.0)
