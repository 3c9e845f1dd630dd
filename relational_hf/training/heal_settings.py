"""The healing's defaults, in a module light enough for the command line's help to read (no Trainer, no PEFT).

`training.heal.heal` takes them as its defaults; `relational-hf compress --help` quotes them.
"""

from __future__ import annotations

#: Healing losses: distillation from the source ("kd") or the language-model loss on a text ("lm").
HEAL_LOSSES: tuple[str, ...] = ("kd", "lm")

#: What healing trains: LoRA adapters merged back ("lora"), or the decoder maps' stored entries themselves ("full").
HEAL_ADAPTERS: tuple[str, ...] = ("lora", "full")

#: Default learning rate of each loss. Through the command line on SmolLM2 at 25%, 200 distillation steps at 1e-3 moved
#: the dense control +4.3% and did not repair (`benchmarks/results/heal_cli_lr1e-3.json`); at 3e-4 the control moved
#: +0.5% and the compressed model went from x1.73 to x1.60 of dense (`heal_cli_calibration64.json`;
#: `heal_kd_lr3e-4.json` for the benchmark's protocol). The language-model loss keeps its measured 1e-3.
DEFAULT_HEAL_LR: dict[str, float] = {"kd": 3e-4, "lm": 1e-3}

#: Tokens in one block of the healing text.
DEFAULT_HEAL_BLOCK_SIZE = 256

#: Blocks a healing step takes. `benchmarks/heal.py` ran 4; 2 is what lets the command line's 200 steps of
#: SmolLM2-135M fit, with the compression, in 45 minutes on a fast 2-core machine (`benchmarks/heal_cli.py`).
DEFAULT_HEAL_BATCH_SIZE = 2

__all__ = ["DEFAULT_HEAL_BATCH_SIZE", "DEFAULT_HEAL_BLOCK_SIZE", "DEFAULT_HEAL_LR", "HEAL_ADAPTERS", "HEAL_LOSSES"]
