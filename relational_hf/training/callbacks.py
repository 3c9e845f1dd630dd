"""Trainer callbacks of the project's training jobs."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class TimeLimitCallback(TrainerCallback):
    """Stops training once the wall-clock budget of `seconds` is spent (the model is still evaluated and saved).
    Where the arguments save checkpoints at all (`save_strategy` not "no"), the step it stops at also writes one, so
    that `--resume` can run the rest; `stopped_at` is that step (None while the budget lasts)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step < state.max_steps and time.monotonic() - self.start > self.seconds:
            control.should_training_stop = True
            control.should_save = args.save_strategy != "no"
            self.stopped_at = state.global_step
        return control


__all__ = ["TimeLimitCallback"]
