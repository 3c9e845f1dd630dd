"""Healing a compressed model: a short LoRA recovery fine-tune, merged back.

The adapters (PEFT LoRA, `peft_support.relational_lora_config`, on every linear map of the decoder layers) train on
random blocks of the given token ids for `steps` steps with one of two losses:

- `loss="kd"` (repair, DESIGN.md 2.2a): distillation from the source model, KL(p_teacher || p_model) of the
  next-token distributions at every position (`distillation.DistillationTrainer`), typically on text the teacher
  sampled itself (`relational_hf.compress.distill.generate_teacher_text`). It asks for the source's function back
  and nothing else: the same run on the source itself leaves it where it is.
- `loss="lm"`: the language-model loss on a user's text (`RelationalTrainer`). It also adapts the model to that
  text; report it beside the same healing of the uncompressed model.

The adapters are then merged and every merged module is put back into its pivot gauge
(`peft_support.merge_and_unload`), so the result has exactly the compressed model's shapes and stored size.
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings

import torch
from peft import get_peft_model
from torch import nn
from transformers import PrinterCallback

from ..lm.data import RandomBlockDataset
from .arguments import RelationalTrainingArguments
from .distillation import DistillationTrainer
from .heal_settings import (
    DEFAULT_HEAL_BATCH_SIZE,
    DEFAULT_HEAL_BLOCK_SIZE,
    DEFAULT_HEAL_LR,
    HEAL_ADAPTERS,
    HEAL_LOSSES,
)
from .peft_support import RELATIONAL_LORA_TARGETS, merge_and_unload, relational_lora_config
from .trainer import RelationalTrainer

logger = logging.getLogger(__name__)


def heal(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    steps: int,
    loss: str = "lm",
    teacher: nn.Module | None = None,
    heal_lr: float | None = None,
    heal_rank: int = 16,
    heal_batch_size: int = DEFAULT_HEAL_BATCH_SIZE,
    heal_block_size: int = DEFAULT_HEAL_BLOCK_SIZE,
    heal_seed: int = 0,
    adapter: str = "lora",
    hidden_weight: float = 0.0,
    progress: bool = True,
    callbacks: list | None = None,
) -> tuple[nn.Module, dict]:
    """LoRA recovery fine-tune of `steps` optimiser steps (rank `heal_rank`, learning rate `heal_lr`, by default
    `DEFAULT_HEAL_LR[loss]`, cosine schedule,
    batches of `heal_batch_size` random blocks of `heal_block_size` tokens of the ids (N, T), read as one stream),
    merged back. `adapter="full"` trains the decoder maps' own stored entries instead (the free entries of a
    gauge-fixed map, so the model stays in its gauge and keeps its shapes; no adapter, nothing to merge; `heal_rank`
    does not apply); its learning rate has no default and must be given. `hidden_weight` (kd only) adds that weight
    times the residual streams' relative distance to the teacher's (`DistillationTrainer`). `loss`: "lm" (next-token
    cross-entropy on the ids) or "kd" (KL to `teacher`'s next-token distributions on the ids; `teacher` is required then and stays frozen). The defaults are the settings measured
    by `benchmarks/heal.py` on SmolLM2, with `DEFAULT_HEAL_BATCH_SIZE` blocks a step (`training.heal_settings`).
    `progress=False`: no progress bar and nothing printed (the loss is in the report and the `callbacks`' logs).
    `callbacks`: extra `transformers.TrainerCallback`s (e.g. a held-out evaluation every k steps; they see the
    unmerged PEFT model, which computes the merged model's function). Returns (merged model in eval mode, report with steps, trainable
    parameters, final training loss, seconds)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be an integer >= 1, got {steps!r}")
    if loss not in HEAL_LOSSES:
        raise ValueError(f"`loss` must be one of {', '.join(HEAL_LOSSES)}, got {loss!r}")
    if adapter not in HEAL_ADAPTERS:
        raise ValueError(f"`adapter` must be one of {', '.join(HEAL_ADAPTERS)}, got {adapter!r}")
    if heal_lr is None and adapter == "full":
        raise ValueError("`heal_lr` is required with adapter='full' (the LoRA defaults do not carry over)")
    if heal_lr is None:
        heal_lr = DEFAULT_HEAL_LR[loss]
    if isinstance(heal_lr, bool) or not isinstance(heal_lr, (int, float)) or not 0.0 < heal_lr < 1.0:
        raise ValueError(f"`heal_lr` must be a number in (0, 1), got {heal_lr!r}")
    if loss == "kd" and not isinstance(teacher, nn.Module):
        raise ValueError("`teacher` (the source model) is required for loss='kd'")
    if loss == "lm" and hidden_weight:
        raise ValueError("`hidden_weight` applies to loss='kd' only")
    if loss == "lm" and teacher is not None:
        raise ValueError("`teacher` applies to loss='kd' only")
    if teacher is not None and {id(p) for p in teacher.parameters()} & {id(p) for p in model.parameters()}:
        raise ValueError("`teacher` shares parameters with the model being healed; pass a separate copy")
    start = time.perf_counter()
    if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or ids.numel() < 3:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"healing ids must be token ids (N, T) or (n,) with at least 3 tokens, got {shape}")
    ids = ids.reshape(-1)
    block = min(heal_block_size, ids.numel() - 1)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in RELATIONAL_LORA_TARGETS if t in present]
    model.train()
    frozen: list[nn.Parameter] = []
    if adapter == "full":
        peft_model, frozen = model, _train_maps_only(model, set(targets))
    else:
        config = relational_lora_config(target_modules=targets, r=heal_rank, lora_alpha=2 * heal_rank, lora_dropout=0.0)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # initialisation depends on heal_seed alone
            # PEFT asks Transformers v5 for a renamed property; the notice is for PEFT, not for the user healing a model
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            torch.manual_seed(heal_seed)
            peft_model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = RelationalTrainingArguments(
                output_dir=tmp,
                per_device_train_batch_size=heal_batch_size,
                max_steps=steps,
                learning_rate=heal_lr,
                lr_scheduler_type="cosine",
                warmup_steps=max(1, steps // 10),
                logging_steps=max(1, steps // 5),
                save_strategy="no",
                report_to=[],
                seed=heal_seed,
                dataloader_num_workers=0,
                use_cpu=not torch.cuda.is_available(),
                disable_tqdm=not progress,
            )
            dataset = RandomBlockDataset(ids, block, steps * heal_batch_size, seed=heal_seed)
            trainer_class, extra = (
                (DistillationTrainer, {"teacher": teacher, "hidden_weight": hidden_weight})
                if loss == "kd"
                else (RelationalTrainer, {})
            )
            trainer = trainer_class(model=peft_model, args=args, train_dataset=dataset, callbacks=callbacks, **extra)
            if not progress:  # without a bar the Trainer prints each log line to stdout instead: quiet is quiet
                trainer.remove_callback(PrinterCallback)
            output = trainer.train()
    finally:  # what adapter="full" froze is trainable again, whether the healing ends or fails
        for p in frozen:
            p.requires_grad_(True)
    merged = model.eval() if adapter == "full" else merge_and_unload(peft_model).eval()
    report = {
        "loss": loss,
        "steps": steps,
        "adapter": adapter,
        **({"hidden_weight": hidden_weight} if hidden_weight else {}),
        "lora_rank": heal_rank if adapter == "lora" else None,
        "learning_rate": heal_lr,
        "batch_size": heal_batch_size,
        "block_size": block,
        "trainable_parameters": trainable,
        "train_loss": float(output.training_loss),
        "seconds": round(time.perf_counter() - start, 2),
    }
    logger.info("healed with %d steps in %.1f s (train loss %.3f)", steps, report["seconds"], report["train_loss"])
    return merged, report


def _train_maps_only(model: nn.Module, targets: set[str]) -> list[nn.Parameter]:
    """Leaves only the parameters of the modules named in `targets` trainable; returns those it froze."""
    keep = {
        id(p)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in targets
        for p in module.parameters()
    }
    if not keep:
        raise ValueError(f"adapter='full' found none of the maps {sorted(targets)} to train in the model")
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in keep]
    for p in frozen:
        p.requires_grad_(False)
    return frozen


__all__ = ["DEFAULT_HEAL_BATCH_SIZE", "DEFAULT_HEAL_BLOCK_SIZE", "DEFAULT_HEAL_LR", "HEAL_LOSSES", "heal"]
