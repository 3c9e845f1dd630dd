"""`DistillationTrainer`: `RelationalTrainer` whose loss is the next-token KL to a frozen teacher.

The teacher runs on every batch under `torch.no_grad()` (no labels, no cached logits: a vocabulary of 50k makes
stored logits far larger than the text); the loss is `lm.metrics.next_token_kl`, KL(p_teacher || p_student) averaged
over the micro-batch's positions. Everything else (optimiser, schedule, callbacks, PEFT models, checkpoints) is the
Trainer's. `relational_hf.training.heal.heal(..., loss="kd")` uses it to repair a compressed model from its source.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..lm.metrics import hidden_state_distance, next_token_kl
from .trainer import RelationalTrainer


class DistillationTrainer(RelationalTrainer):
    """`RelationalTrainer` training `model` to match `teacher`'s next-token distributions at `temperature`, plus,
    with `hidden_weight` > 0, that weight times `lm.metrics.hidden_state_distance` of the two residual streams (for a
    model that shares the teacher's residual basis, as a compressed model does its source's).

    The loss is a per-micro-batch mean over positions, so the Trainer divides it by the gradient-accumulation steps
    (`loss_is_scaled_for_ga = False`): k micro-batches of b blocks give the gradient of one batch of k b blocks."""

    loss_is_scaled_for_ga = False

    def __init__(
        self, *args: Any, teacher: nn.Module, temperature: float = 1.0, hidden_weight: float = 0.0, **kwargs: Any
    ) -> None:
        if not isinstance(teacher, nn.Module):
            raise ValueError(f"`teacher` must be a model (nn.Module), got {type(teacher).__name__}")
        if not temperature > 0 or not math.isfinite(temperature):
            raise ValueError(f"`temperature` must be a finite number > 0, got {temperature}")
        if isinstance(hidden_weight, bool) or not isinstance(hidden_weight, (int, float)):
            raise ValueError(f"`hidden_weight` must be a number >= 0, got {hidden_weight!r}")
        if not (math.isfinite(hidden_weight) and hidden_weight >= 0):
            raise ValueError(f"`hidden_weight` must be a finite number >= 0, got {hidden_weight!r}")
        super().__init__(*args, **kwargs)
        if self.suppression is not None:
            raise ValueError("parallel suppression is not combined with distillation (the loss is the KL alone)")
        self.teacher = teacher.eval().to(self.args.device)
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.temperature = float(temperature)
        self.hidden_weight = float(hidden_weight)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        hidden = self.hidden_weight > 0
        with torch.no_grad():
            target = self.teacher(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=hidden)
        outputs = model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=hidden)
        loss = next_token_kl(outputs.logits, target.logits, mask, self.temperature)
        if hidden:
            loss = loss + self.hidden_weight * hidden_state_distance(outputs.hidden_states, target.hidden_states, mask)
        return (loss, outputs) if return_outputs else loss


__all__ = ["DistillationTrainer"]
