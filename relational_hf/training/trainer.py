"""`RelationalTrainer`: Transformers' `Trainer` with optimisation on the quotient and soft parallel suppression.

What it adds to `Trainer` (each off by default, so with the defaults it computes exactly what `Trainer` computes):

- `symmetry_projection="update"`: the optimiser built by `Trainer` is wrapped in
  `relational_hf.symmetry.ProjectedOptimizer`, which replaces every step delta by its horizontal part
  delta - P_V(delta) (DESIGN.md section 2.3). The wrapper is a `torch.optim.Optimizer`, so Accelerate, the LR
  scheduler and checkpointing (`optimizer.pt`) see one optimiser and resuming restores it exactly.
- `parallel_suppression_coef=lambda > 0`: the loss becomes task loss + lambda * mean cos^2(y, z) over the sites
  of `parallel_suppression_site` (DESIGN.md section 3; `suppression.ParallelSuppression`). The term is normalised
  like the task loss: when the Trainer divides the summed token loss by the number of label tokens of the whole
  accumulated (and, with `average_tokens_across_devices`, all-process) batch, the summed cos^2 is divided by the
  number of token positions of that same batch, and multiplied by the number of processes where the task loss is;
  otherwise both are per-micro-batch means that the Trainer divides by the accumulation steps. So gradient
  accumulation k x b gives the gradient of batch k b, and DDP's gradient average gives the gradient of the global
  batch.
- FSDP (`fsdp=True`, version 2, or an Accelerate FSDP config): the projection gathers each block of its normal
  equations whole and applies every process's shard of the one-process update (`ProjectedOptimizer`), the balance of
  `orbit_drift` is read from whole tensors, and `save_model` and the Trainer's checkpoints write the model's own
  code files and `auto_map` (`training.fsdp.unsharded_class`), not the FSDP subclass's. Accelerate enables FSDP only
  on accelerators: on CPU processes `fsdp=True` trains with DDP, and the trainer says so.
- its own state rides on public mechanisms: the projection's step count on the wrapped optimiser's state dict
  (`optimizer.pt`), the balance reference of `orbit_drift` in `relational_trainer_state.pt`, written beside each
  checkpoint by a callback's `on_save` and read back by `train(resume_from_checkpoint=...)`.
- logs, at every logging step: `task_loss` and `parallel_suppression` (their sum is the Trainer's `loss`),
  `parallel_ratio` (mean |y_par| / |y_perp| at the suppression sites, measured on the micro-batches of the logging
  step) and `orbit_drift` (change of the balance W_Q^T W_Q - W_K^T W_K, W_V^T W_V - W_O W_O^T since the start of
  training, `relational_hf.symmetry`), so they reach every reporting integration (TensorBoard, W&B, ...).
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from typing import Any

import torch
from torch import nn
from transformers import DefaultFlowCallback, Trainer, TrainerCallback, TrainerControl
from transformers.trainer_pt_utils import nested_gather
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, IntervalStrategy, get_last_checkpoint

from ..directional.suppression import ParallelSuppression
from .arguments import RelationalTrainingArguments
from .fsdp import is_sharded_model, unsharded_class

logger = logging.getLogger(__name__)

#: Written next to optimizer.pt in every checkpoint: the trainer's own state (the balance reference of orbit_drift).
STATE_NAME = "relational_trainer_state.pt"


class RelationalTrainer(Trainer):
    """`transformers.Trainer` with `symmetry_projection`, `parallel_suppression_coef`/`_site` and their logging.

    Takes the same arguments as `Trainer`; `args` should be a `RelationalTrainingArguments` (a plain
    `TrainingArguments` means projection "none" and no suppression). The model must be one an architecture adapter
    knows (`relational_hf.architectures.get_adapter`) when projection or suppression is on.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.symmetry_projection = getattr(self.args, "symmetry_projection", "none")
        self.suppression_coef = float(getattr(self.args, "parallel_suppression_coef", 0.0))
        self.suppression_site = getattr(self.args, "parallel_suppression_site", "residual")
        self.suppression: ParallelSuppression | None = None
        if self.suppression_coef > 0:
            if self.args.n_gpu > 1:
                raise ValueError(
                    "parallel suppression does not support torch.nn.DataParallel (several GPUs in one process); "
                    "launch one process per GPU with torchrun or accelerate launch (DDP)"
                )
            self.suppression = ParallelSuppression(self.model, self.suppression_site)
        if self.symmetry_projection == "update" and _is_peft(self.model):
            raise ValueError(
                "symmetry_projection='update' projects updates of the model's full weights, which a PEFT (LoRA) model "
                "keeps frozen; use full fine-tuning with projection, or projection 'none' with LoRA"
            )
        self._batch_positions: torch.Tensor | None = None  # token positions of the current accumulated batch
        self._measure_ratio = False
        self._sums: torch.Tensor | None = None  # task loss, suppression term, ratio sum, ratio count (on device)
        self._steps_since_log = 0  # optimiser steps since the last training log (counted by `_StateCallback`)
        self._balance_reference: Any = None
        self.add_callback(_StateCallback(self))
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None) if self.is_fsdp_enabled else None
        if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2 and self.symmetry_projection == "update":
            raise ValueError(
                "symmetry_projection='update' supports FSDP version 2 only (DTensor parameters, read whole block by "
                "block); FSDP 1 flattens the weights: set fsdp_config={'version': 2} or --fsdp_version 2"
            )
        if self.args.fsdp and not self.is_fsdp_enabled:
            logger.warning(
                "fsdp: Accelerate enables FSDP only on accelerators (CUDA, XPU, ...); these %d CPU processes train "
                "with DDP (every process holds the whole model)",
                self.args.world_size,
            )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """`Trainer.train`; when resuming, also reads back the balance reference of `orbit_drift` saved beside the
        checkpoint (`relational_trainer_state.pt`), so the resumed run logs what the uninterrupted run logs."""
        checkpoint = resume_from_checkpoint
        if isinstance(checkpoint, bool):
            checkpoint = get_last_checkpoint(self.args.output_dir) if checkpoint else None
        if checkpoint is not None:
            path = os.path.join(checkpoint, STATE_NAME)
            if os.path.isfile(path):
                self._balance_reference = torch.load(path, map_location="cpu", weights_only=True)["balance_reference"]
        self._sums, self._steps_since_log = None, 0
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ---- optimiser ----------------------------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """`Trainer.create_optimizer`, wrapped in `ProjectedOptimizer` when `symmetry_projection == "update"`."""
        optimizer = super().create_optimizer(model)
        if self.symmetry_projection == "update" and not _is_projected(optimizer):
            from ..symmetry import ProjectedOptimizer

            self.optimizer = optimizer = ProjectedOptimizer(optimizer, self.model)
        if self._balance_reference is None:
            self._balance_reference = _balance_snapshot(self.model)
        return optimizer

    # ---- loss -----------------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """`Trainer.get_batch_samples`, also counting the token positions of the accumulated batch (all processes when
        `average_tokens_across_devices`), the denominator of the suppression term."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.suppression is not None and batch_samples:
            positions = sum(token_positions(batch) for batch in batch_samples).to(device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                positions = self.accelerator.gather(positions).sum()
            self._batch_positions = positions
        self._measure_ratio = self.suppression is not None and self._logs_next_step()
        return batch_samples, num_items_in_batch

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """`Trainer.training_step` with the suppression hooks installed for the forward and the backward pass."""
        if self.suppression is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with self.suppression.installed():
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """Task loss (`Trainer.compute_loss`) plus, in training with suppression on, lambda * mean cos^2(y, z)
        normalised like the task loss (see the module docstring)."""
        if self.suppression is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.suppression.start(inputs.get("attention_mask"), measure_ratio=self._measure_ratio)
        try:
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        finally:
            batch = self.suppression.stop()
        scaled = self._loss_is_scaled(num_items_in_batch)
        if scaled and self._batch_positions is not None:
            term = batch.energy_sum / self._batch_positions.to(batch.energy_sum.device).clamp_min(1)
            if (  # the rescaling Trainer.compute_loss applies to the task loss
                self.args.average_tokens_across_devices
                and (self.model_accepts_loss_kwargs or self.compute_loss_func)
                and num_items_in_batch is not None
            ):
                term = term * (self.accelerator.num_processes // self.get_tp_size())
        else:
            term = batch.mean_energy
        term = self.suppression_coef * term
        divisor = 1 if scaled else self.current_gradient_accumulation_steps
        values = torch.stack([loss.detach().float() / divisor, term.detach().float() / divisor])
        values = torch.cat([values, torch.stack([batch.ratio_sum, batch.ratio_count]).float().to(values.device)])
        self._sums = values if self._sums is None else self._sums + values
        total = loss + term.to(loss.dtype)
        return (total, outputs) if return_outputs else total

    def _loss_is_scaled(self, num_items_in_batch) -> bool:
        """True when the task loss is already normalised over the accumulated batch (the rule of
        `Trainer.training_step`), False when it is a per-micro-batch mean."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool(self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            self.compute_loss_func is not None
        )

    def _logs_next_step(self) -> bool:
        """Whether the optimiser step about to run is a logging step. The trainer's `DefaultFlowCallback`s answer
        (their `on_step_end` on a copy of the state one step ahead and a fresh control), so the rule stays theirs;
        with an epoch logging strategy any step may end the epoch, so every step measures."""
        if self.args.logging_strategy == IntervalStrategy.EPOCH:
            return True
        ahead = copy.copy(self.state)
        ahead.global_step = self.state.global_step + 1
        control = TrainerControl()
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, DefaultFlowCallback):
                callback.on_step_end(self.args, ahead, control)
        return control.should_log

    # ---- logging --------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`, adding at training logging steps task_loss, parallel_suppression, parallel_ratio (with
        suppression on) and orbit_drift (for models with a balance to track)."""
        if "loss" in logs:
            logs.update(self._training_metrics())
        super().log(logs, start_time)

    def _training_metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        steps = self._steps_since_log
        if self.suppression is not None and steps > 0:
            sums = torch.zeros(4, device=self.args.device) if self._sums is None else self._sums.to(self.args.device)
            gathered = nested_gather(sums, self.args.parallel_mode).view(-1, 4).double().cpu()
            metrics["task_loss"] = gathered[:, 0].mean().item() / steps
            metrics["parallel_suppression"] = gathered[:, 1].mean().item() / steps
            count = gathered[:, 3].sum().item()
            if count > 0:
                metrics["parallel_ratio"] = gathered[:, 2].sum().item() / count
        self._sums = None
        self._steps_since_log = 0
        drift = _orbit_drift(self.model, self._balance_reference)
        if drift is not None:
            metrics["orbit_drift"] = drift
        return metrics

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """`Trainer._save`; a model sharded by FSDP2 writes its gathered `state_dict` through its own class, so the
        folder holds the model's code files and an `auto_map` naming them (`training.fsdp.unsharded_class`)."""
        if state_dict is None or not is_sharded_model(self.model):
            return super()._save(output_dir, state_dict)
        # Trainer has no public hook between gathering a sharded model's weights and writing them; `_save` is it
        with unsharded_class(self.model):
            return super()._save(output_dir, state_dict)

    def _save_balance_reference(self, checkpoint: str) -> None:
        """Write the balance reference beside the checkpoint (staged beside, then renamed)."""
        if not self.args.should_save or self._balance_reference is None:
            return
        if not os.path.isdir(checkpoint):
            logger.warning("checkpoint folder %s not found: the orbit_drift reference is not saved with it", checkpoint)
            return
        fd, staged = tempfile.mkstemp(prefix=f".{STATE_NAME}.", dir=checkpoint)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save({"balance_reference": self._balance_reference}, handle)
            os.replace(staged, os.path.join(checkpoint, STATE_NAME))
        except BaseException:
            if os.path.exists(staged):
                os.remove(staged)
            raise


class _StateCallback(TrainerCallback):
    """The trainer's bookkeeping through public callback events: counts optimiser steps between training logs, and
    saves the balance reference of orbit_drift beside every checkpoint `Trainer` writes."""

    def __init__(self, trainer: RelationalTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._steps_since_log += 1

    def on_save(self, args, state, control, **kwargs):
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.trainer._save_balance_reference(checkpoint)


def _is_peft(model: nn.Module) -> bool:
    """A PEFT-wrapped model (its base weights are frozen)."""
    from peft import PeftMixedModel, PeftModel

    return isinstance(model, (PeftModel, PeftMixedModel))


def _is_projected(optimizer: torch.optim.Optimizer) -> bool:
    from ..symmetry import ProjectedOptimizer

    return isinstance(optimizer, ProjectedOptimizer)


def _balance_snapshot(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The balance mu(theta) of every symmetry group of `model` (`relational_hf.symmetry.orbit_balance`, on the
    CPU), or None for a PEFT model, a model no architecture adapter knows, or one without a group to track."""
    from ..architectures import UnsupportedModelError
    from ..symmetry import orbit_balance

    if _is_peft(model):  # the base weights are frozen: nothing moves along their orbits
        return None
    try:
        balance = orbit_balance(model)
    except UnsupportedModelError:
        return None
    return {key: value.detach().float().cpu() for key, value in balance.items()} or None


def _orbit_drift(model: nn.Module, reference: dict[str, torch.Tensor] | None) -> float | None:
    """Total orbit drift |mu(theta_now) - mu(theta_start)| (`relational_hf.symmetry.orbit_drift`), or None."""
    if not reference:
        return None
    from ..symmetry import orbit_drift

    return orbit_drift(reference, _balance_snapshot(model) or {})["total"]


def token_positions(batch: dict) -> torch.Tensor:
    """Number of real token positions in a collated batch: attention_mask.sum(), else input_ids.numel()."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum()
    ids = batch.get("input_ids")
    if ids is None:
        ids = batch.get("inputs_embeds")
        return torch.tensor(ids.shape[0] * ids.shape[1])
    return torch.tensor(ids.numel())


__all__ = ["RelationalTrainer", "RelationalTrainingArguments", "STATE_NAME"]
