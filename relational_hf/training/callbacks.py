"""Trainer callbacks of the project's training jobs."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class TimeLimitCallback(TrainerCallback):
    """Stops training once the wall-clock budget of `seconds` is spent (the model is still evaluated and saved)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() - self.start > self.seconds:
            control.should_training_stop = True
        return control


__all__ = ["TimeLimitCallback"]
