"""Evaluation metrics, computed here (Evaluate's metric scripts are fetched from the Hub). The one home of
perplexity for the trainer, the converter and the analysis tools."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..modeling.modeling_gauge import weight_cache


def model_device(model: nn.Module) -> torch.device:
    """The device to put a model's inputs on: that of its first parameter not on the meta device (a model dispatched
    by Accelerate with CPU / disk offload holds meta parameters, and its hooks move the inputs to each module's
    execution device, so any real device will do), CPU for a model without one."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _batches(
    input_ids: torch.Tensor | Sequence[torch.Tensor], attention_mask: torch.Tensor | None, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (N, T) token ids, got shape {tuple(input_ids.shape)}")
        for start in range(0, input_ids.shape[0], batch_size):
            mask = None if attention_mask is None else attention_mask[start : start + batch_size]
            yield input_ids[start : start + batch_size], mask
    else:  # a sequence of (T,) or (B, T) tensors of any lengths, each evaluated as its own batch
        for ids in input_ids:
            yield (ids.unsqueeze(0) if ids.dim() == 1 else ids), None


@torch.no_grad()
def token_nll(
    model: nn.Module,
    input_ids: torch.Tensor | Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) and the number of predicted tokens. A target counts when it
    and the token before it are real (attention_mask 1). Eval mode, no autograd, and the gauge-fixed weights
    assembled once (`weight_cache`) while it runs; the training flag is
    restored."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        n = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) else len(input_ids)
        steps = math.ceil(n / batch_size) if isinstance(input_ids, torch.Tensor) else n
        batches = tqdm(
            _batches(input_ids, attention_mask, batch_size), total=steps, desc="evaluating", disable=not progress,
            leave=False,
        )  # fmt: skip
        with torch.no_grad(), weight_cache(model):
            for ids, mask in batches:
                ids = ids.to(device)
                mask = None if mask is None else mask.to(device)
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()  # (B,T-1,V)
                nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
                valid = torch.ones_like(nll, dtype=torch.bool) if mask is None else (mask[:, 1:] * mask[:, :-1]).bool()
                total += nll[valid].double().sum().item()
                count += int(valid.sum())
    finally:
        model.train(was_training)
    return total, count


def perplexity(
    model: nn.Module,
    input_ids: torch.Tensor | Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> float:
    """exp(mean next-token NLL) of a causal LM over (N, T) token ids (or a sequence of id tensors)."""
    total, count = token_nll(model, input_ids, attention_mask, batch_size, progress)
    if count == 0:
        raise ValueError("no target token to evaluate (sequences shorter than 2 real tokens)")
    mean = total / count
    return math.exp(mean) if mean < 709.0 else (math.inf if mean == mean else math.nan)  # exp overflows past 709


def next_token_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean over positions of KL(p_teacher || p_student) of the next-token distributions (nats), both taken at
    `temperature` and the result scaled by temperature^2 (the usual gradient scale of distillation). Logits (B, T, V);
    `attention_mask` (B, T) leaves padded positions out. Computed in float32; differentiable in both."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits differ in shape: {tuple(student_logits.shape)} vs {tuple(teacher_logits.shape)}"
        )
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"`temperature` must be a finite number > 0, got {temperature}")
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    per_position = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # (B, T)
    if attention_mask is not None:
        mask = attention_mask.to(per_position.dtype)
        return (per_position * mask).sum() / mask.sum().clamp_min(1.0) * temperature**2
    return per_position.mean() * temperature**2


def hidden_state_distance(
    student_hidden: tuple[torch.Tensor, ...] | list[torch.Tensor],
    teacher_hidden: tuple[torch.Tensor, ...] | list[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over layers and positions of the relative squared distance ||h_s - h_t||^2 / ||h_t||^2 between the two
    models' residual streams (each a sequence of (B, T, d) states, as `output_hidden_states` gives them; the first,
    the embedding's output, is left out). Per position, so tokens with massive activations weigh like the others.
    Meaningful only where both streams share a basis (a compressed model and its source: compression keeps the
    residual basis). Computed in float32; differentiable in the student's states."""
    if len(student_hidden) != len(teacher_hidden) or len(student_hidden) < 2:
        raise ValueError(f"the models' hidden states differ in count: {len(student_hidden)} vs {len(teacher_hidden)}")
    terms = []
    for s, t in zip(student_hidden[1:], teacher_hidden[1:]):
        if s.shape != t.shape:
            raise ValueError(f"hidden states differ in shape: {tuple(s.shape)} vs {tuple(t.shape)}")
        s, t = s.float(), t.float()
        terms.append((s - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-12))  # (B, T)
    per_position = torch.stack(terms).mean(0)
    if attention_mask is not None:
        mask = attention_mask.to(per_position.dtype)
        return (per_position * mask).sum() / mask.sum().clamp_min(1.0)
    return per_position.mean()


@torch.no_grad()
def teacher_kl(student: nn.Module, teacher: nn.Module, input_ids: torch.Tensor, batch_size: int = 4) -> float:
    """Mean KL(p_teacher || p_student) per token position (nats) over the windows `input_ids` (N, T), each window on
    its own. Both models in eval mode while it runs; their training flags are restored."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor of shape (N, T)")
    modes = student.training, teacher.training
    student.eval()
    teacher.eval()
    total, count = 0.0, 0
    try:
        for ids, _ in _batches(input_ids, None, batch_size):
            s = student(input_ids=ids.to(next(student.parameters()).device), use_cache=False).logits
            t = teacher(input_ids=ids.to(next(teacher.parameters()).device), use_cache=False).logits.to(s.device)
            total += float(next_token_kl(s, t)) * ids.numel()
            count += ids.numel()
    finally:
        student.train(modes[0])
        teacher.train(modes[1])
    return total / count
