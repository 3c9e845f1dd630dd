"""Recording a run's motion on the quotient (DESIGN.md 2.3) at chosen optimiser steps, without full checkpoints.

`QuotientRecorder` does the work for any training loop; `QuotientTrajectoryCallback` drives it from a Transformers
`Trainer` (plain or `RelationalTrainer`). At a recorded step s it stores:
- the coordinates of theta_s: a fixed random sketch S theta (`ParameterSketch`) of the raw parameters and S c(theta)
  of the canonical-gauge ones (c = `symmetry.canonicalize`), the per-head spectra of G_QK and G_VO and the
  head-to-head similarities (`symmetry.head_descriptors`): all but the raw sketch are invariant;
- the balance mu(theta) (`symmetry.orbit_balance`, the orbit position): its norm, its drift since the first record
  and a sketch;
- the split of the step's gradient g and update delta = theta_s - theta_{s-1} into vertical and horizontal parts at
  theta_{s-1} (`symmetry.UpdateProjector`), and the same for the chord Delta = theta_s - theta_prev since the
  previous record, at theta_prev, with the chord |c(theta_s) - c(theta_prev)| in canonical coordinates;
- optionally, on a fixed probe batch, the loss and the per-layer parallel ratio |y_par|/|y_perp|
  (`directional.decompose`).
The vertical space is that of the groups `ProjectedOptimizer` projects by default (every linear group but the
residual rotation); `residual=True` adds the residual rotation.

Memory: the sketch map (4 bytes per parameter), and two copies of the trainable parameters (the previous record's
raw and canonical ones; a third, transient, at a recorded step). Not for sharded (FSDP / ZeRO-3) parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..architectures import UnsupportedModelError, get_adapter
from ..symmetry import ProjectedOptimizer, UpdateProjector, canonicalize, head_descriptors, orbit_balance
from .trajectory import TRAJECTORY_NAME, Trajectory, load_trajectory, save_trajectory

logger = logging.getLogger(__name__)

#: default recording interval (optimiser steps); see benchmarks/dynamics.py for the measured overhead
DEFAULT_EVERY = 100
DEFAULT_SKETCH_DIM = 512
DEFAULT_PROBE_SITES = ("residual_attention", "residual_mlp")


class ParameterSketch:
    """A fixed random linear map S: R^n -> R^k (a CountSketch) on a list of tensors of fixed shapes, flattened and
    concatenated: coordinate i goes to bucket b(i) in [0, k) with sign s(i) = +-1, (S x)_b = sum_{b(i) = b} s(i) x_i.

    E|S x|^2 = |x|^2, so |S x - S y| estimates |x - y| (relative error about sqrt(2/k) for spread-out differences),
    and S is linear, so principal components of sketched trajectories approximate those of the parameters. The
    same shapes and seed give the same map: sketches of different runs of one architecture share coordinates."""

    def __init__(self, shapes: Sequence[Sequence[int]], dim: int = DEFAULT_SKETCH_DIM, seed: int = 0) -> None:
        if dim < 1:
            raise ValueError(f"sketch dimension must be >= 1, got {dim}")
        self.dim, self.seed = dim, seed
        self.shapes = [tuple(int(s) for s in shape) for shape in shapes]
        generator = torch.Generator().manual_seed(seed)
        # bucket and sign packed in one int32 per coordinate: code = 2 b + (s + 1) / 2
        self._codes = [
            torch.randint(0, 2 * dim, (math.prod(shape),), generator=generator, dtype=torch.int32)
            for shape in self.shapes
        ]

    @property
    def signature(self) -> str:
        """A short hash of (shapes, dim, seed): equal signatures mean the same map."""
        text = json.dumps([self.shapes, self.dim, self.seed])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @torch.no_grad()
    def __call__(self, tensors: Iterable[torch.Tensor]) -> np.ndarray:
        """S x for x the concatenation of `tensors` (shapes as given at construction), float64 accumulation."""
        out = torch.zeros(self.dim, dtype=torch.float64)
        tensors = list(tensors)
        if len(tensors) != len(self._codes):
            raise ValueError(f"the sketch was built for {len(self._codes)} tensors, got {len(tensors)}")
        for t, code in zip(tensors, self._codes):
            x = t.detach().reshape(-1).to("cpu", torch.float64)
            if x.numel() != code.numel():
                raise ValueError(f"tensor of {x.numel()} entries where the sketch expects {code.numel()}")
            sign = (code & 1).double() * 2 - 1
            out.index_add_(0, code >> 1, x * sign)
        return out.numpy()


class QuotientRecorder:
    """Records the trajectory of `model`'s training at chosen steps (see the module docstring for what is recorded).

    In a training loop, at a step that `due(step)` selects (step = the number of optimiser steps after it)::

        loss.backward(); clip_grad_norm_(...)
        recorder.before_update()          # gradient split; keeps theta_{s-1}
        optimizer.step()
        recorder.after_update()           # update split at theta_{s-1}
        optimizer.zero_grad()
        recorder.record(step)             # coordinates, balance, chord since the previous record
    and `record(0)` before the first step, `add_loss(step, value)` whenever a loss is known, `save(path)` at the end.

    every / steps: record every `every` optimiser steps and at the listed `steps` (either may be None).
    sketch_dim / seed: the `ParameterSketch` of raw and canonical parameters (and of the balance, seed + 1); keep
    the seed across runs to compare them in one set of coordinates.
    residual: count the residual rotation as vertical too (the projector then solves a d x d problem per split).
    probe_input_ids: a fixed (B, T) batch for probe_loss and the per-layer parallel ratio at `probe_sites`
    (none: not recorded).
    metadata: extra JSON-ready entries stored with the trajectory (e.g. "label", "seed").
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int | None = DEFAULT_EVERY,
        steps: Iterable[int] | None = None,
        sketch_dim: int = DEFAULT_SKETCH_DIM,
        seed: int = 0,
        residual: bool = False,
        probe_input_ids: torch.Tensor | None = None,
        probe_sites: Sequence[str] = DEFAULT_PROBE_SITES,
        metadata: dict | None = None,
    ) -> None:
        if every is not None and every < 1:
            raise ValueError(f"every must be >= 1 or None, got {every}")
        self.model, self.every = model, every
        self.steps = {int(s) for s in steps} if steps is not None else set()
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if any(p.numel() == 0 for _, p in self.params):
            raise ValueError("empty parameters (sharded by FSDP or ZeRO-3?): the recorder needs full parameters")
        self.sketch = ParameterSketch([p.shape for _, p in self.params], sketch_dim, seed)
        self.probe_input_ids, self.probe_sites = probe_input_ids, tuple(probe_sites)
        try:
            get_adapter(model)
            self.supported = True
        except UnsupportedModelError as err:
            logger.warning("%s: recording raw coordinates, norms and losses only", err)
            self.supported = False
        # float64 splits: the recorded vertical share of a horizontal step is then at the float32 rounding of theta
        self.projector = UpdateProjector(model, residual=residual, dtype=torch.float64) if self.supported else None
        self.records: list[dict[str, np.ndarray]] = []
        self.losses: list[tuple[int, float]] = []
        self.balance_keys: list[str] | None = None
        self.balance_reference: np.ndarray | None = None
        self._balance_sketch: ParameterSketch | None = None
        self._previous: tuple[list[torch.Tensor], list[torch.Tensor] | None] | None = None
        self._before: list[torch.Tensor] | None = None
        self._pending: dict[str, float] = {}
        self._pending_seconds = 0.0
        names = [n for n, _ in self.params]  # the sketch's coordinates mean the same for equal shapes and names
        layout = _layout_signature(model)  # ... and equal index buffers (a pivot gauge's pivot positions)
        self.metadata = {
            "every": every,
            "steps": sorted(self.steps),
            "sketch_dim": sketch_dim,
            "sketch_seed": seed,
            "sketch_signature": hashlib.sha256("\n".join([self.sketch.signature, layout, *names]).encode()).hexdigest(),
            "layout_signature": layout,
            "parameter_count": sum(p.numel() for _, p in self.params),
            "residual_rotation_vertical": residual,
            "vertical_groups": [g.key for g in self.projector.groups] if self.projector is not None else [],
            "invariants": self.supported,
            "probe_sites": list(self.probe_sites) if probe_input_ids is not None else [],
            "probe_shape": list(probe_input_ids.shape) if probe_input_ids is not None else None,
            "model_class": type(model).__name__,
            "config": _config_dict(model),
            **(metadata or {}),
        }

    # --- schedule -----------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether the state after `step` optimiser steps is to be recorded."""
        return step in self.steps or (self.every is not None and step % self.every == 0)

    @property
    def last_step(self) -> int | None:
        return int(self.records[-1]["step"]) if self.records else None

    # --- around the optimiser step --------------------------------------------------------------------------------
    @torch.no_grad()
    def before_update(self) -> None:
        """Call after the backward pass (and clipping), just before `optimizer.step()`: splits the gradient g at the
        current theta and keeps a copy of theta for `after_update`."""
        start = time.perf_counter()
        self._before = [p.detach().clone() for _, p in self.params]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach() for _, p in self.params]
        total, vertical, horizontal = self._split(grads, at=None)
        self._pending.update(gradient_norm=total, gradient_vertical_norm=vertical, gradient_horizontal_norm=horizontal)
        self._pending_seconds += time.perf_counter() - start

    @torch.no_grad()
    def after_update(self) -> None:
        """Call just after `optimizer.step()`: splits the update delta = theta_now - theta_before at theta_before."""
        if self._before is None:
            raise RuntimeError("after_update() without before_update()")
        start = time.perf_counter()
        delta = [p.detach().double() - b.double() for (_, p), b in zip(self.params, self._before)]
        total, vertical, horizontal = self._split(delta, at=self._before)
        self._pending.update(update_norm=total, update_vertical_norm=vertical, update_horizontal_norm=horizontal)
        self._before = None
        self._pending_seconds += time.perf_counter() - start

    def _split(self, delta: Sequence[torch.Tensor], at: Sequence[torch.Tensor] | None) -> tuple[float, float, float]:
        """(|x|, |P_V x|, |x - P_V x|) for x given per trainable parameter, P_V taken at the parameters `at` (the
        live ones when None). Parameters no group touches are horizontal."""
        total_sq = sum(float(d.double().square().sum()) for d in delta)
        if self.projector is None or not self.projector.groups:
            return math.sqrt(total_sq), 0.0, math.sqrt(total_sq)
        owned = self.projector.params
        keyed = {id(p): d.double() for (_, p), d in zip(self.params, delta) if id(p) in owned}
        values = None
        if at is not None:  # projected at these values, read in place: the live parameters are never touched
            given = {id(p): v for (_, p), v in zip(self.params, at)}
            values = {k: given[k] if k in given else p.detach() for k, p in owned.items()}
        vertical = self.projector.vertical_part(keyed, at=values)
        vertical_sq = sum(float(v.square().sum()) for v in vertical.values())
        horizontal_sq = 0.0
        for (_, p), d in zip(self.params, delta):
            d = d.double()
            v = vertical.get(id(p))
            horizontal_sq += float((d if v is None else d - v).square().sum())
        return math.sqrt(total_sq), math.sqrt(vertical_sq), math.sqrt(horizontal_sq)

    # --- coordinates ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def coordinates(self, model: nn.Module | None = None) -> dict[str, np.ndarray]:
        """The coordinates of `model` (default: the recorded one; same architecture): raw_sketch, param_norm and,
        for a model an adapter knows, canonical_sketch, canonical_norm, qk/vo spectra and similarities."""
        return self._coordinates(model or self.model)[0]

    def _coordinates(self, model: nn.Module) -> tuple[dict[str, np.ndarray], list[torch.Tensor] | None]:
        raw = [p for n, p in model.named_parameters() if p.requires_grad]
        out = {"raw_sketch": self.sketch(raw).astype(np.float32), "param_norm": np.float64(_norm(raw))}
        if not self.supported:
            return out, None
        named = dict(canonicalize(model).named_parameters())
        canonical = [named[n].detach().to("cpu", copy=True) for n, _ in self.params]
        out["canonical_sketch"] = self.sketch(canonical).astype(np.float32)
        out["canonical_norm"] = np.float64(_norm(canonical))
        layers = head_descriptors(model)
        out["qk_spectrum"] = np.stack([d.qk_singular_values.numpy() for d in layers])
        out["vo_spectrum"] = np.stack([d.vo_singular_values.numpy() for d in layers])
        out["qk_similarity"] = np.stack([d.qk_similarity.numpy() for d in layers])
        out["vo_similarity"] = np.stack([d.vo_similarity.numpy() for d in layers])
        return out, canonical

    def _balance(self) -> dict[str, np.ndarray]:
        balance = {k: v.detach().double().reshape(-1).cpu() for k, v in orbit_balance(self.model).items()}
        if self.balance_keys is None:
            self.balance_keys = list(balance)
        if list(balance) != self.balance_keys:
            raise RuntimeError("the model's symmetry groups changed during training")
        parts = [balance[k] for k in self.balance_keys]
        flat = torch.cat(parts).numpy() if parts else np.zeros(0)
        if self.balance_reference is None:
            self.balance_reference = flat
        if self._balance_sketch is None:
            self._balance_sketch = ParameterSketch([p.shape for p in parts], self.sketch.dim, self.sketch.seed + 1)
        reference, drift, offset = torch.from_numpy(self.balance_reference), [], 0
        for part in parts:
            drift.append(float((part - reference[offset : offset + part.numel()]).norm()))
            offset += part.numel()
        return {
            "balance_norm": np.array([float(p.norm()) for p in parts]),
            "balance_drift": np.array(drift),
            "balance_sketch": self._balance_sketch(parts).astype(np.float32),
        }

    @torch.no_grad()
    def _probe(self) -> dict[str, np.ndarray]:
        from ..directional import decompose

        ids = self.probe_input_ids.to(next(self.model.parameters()).device)
        was_training = self.model.training
        self.model.eval()
        try:
            loss = float(self.model(input_ids=ids, labels=ids).loss)
        finally:
            self.model.train(was_training)
        out = {"probe_loss": np.float64(loss)}
        if self.supported and self.probe_sites:
            profile = decompose(self.model, ids, sites=self.probe_sites).profile("parallel_ratio")
            out["parallel_ratio"] = np.array([profile[s] for s in self.probe_sites])
        return out

    # --- records ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def record(self, step: int) -> dict[str, np.ndarray] | None:
        """Record the current state as the state after `step` optimiser steps (a second call for the same step is
        ignored). Uses the gradient / update split of `before_update` / `after_update` when they ran since the last
        record (NaN otherwise). Returns the record."""
        if self.last_step == step:
            return None
        start = time.perf_counter()
        rec: dict[str, Any] = {"step": np.int64(step)}
        try:
            coords, canonical = self._coordinates(self.model)
        except Exception as err:  # an instrument must not end a run: drop the invariants if the first record fails
            if self.records or not self.supported:
                raise
            logger.warning(
                "invariant coordinates failed (%s: %s): recording raw coordinates only", type(err).__name__, err
            )
            self.supported, self.projector = False, None
            self.metadata.update(invariants=False, vertical_groups=[])
            coords, canonical = self._coordinates(self.model)
        rec.update(coords)
        now = [p.detach().clone() for _, p in self.params]
        nan = math.nan
        interval = dict(interval_norm=nan, interval_vertical_norm=nan, interval_horizontal_norm=nan,
                        canonical_interval_norm=nan)  # fmt: skip
        if self._previous is not None:
            before, before_canonical = self._previous
            delta = [a.double() - b.double() for a, b in zip(now, before)]
            total, vertical, horizontal = self._split(delta, at=before)
            interval.update(interval_norm=total, interval_vertical_norm=vertical, interval_horizontal_norm=horizontal)
            if canonical is not None and before_canonical is not None:
                interval["canonical_interval_norm"] = _norm(
                    [a.double() - b.double() for a, b in zip(canonical, before_canonical)]
                )
        rec.update({k: np.float64(v) for k, v in interval.items()})
        for key in ("gradient", "update"):
            for part in ("norm", "vertical_norm", "horizontal_norm"):
                rec[f"{key}_{part}"] = np.float64(self._pending.get(f"{key}_{part}", nan))
        if self.supported:
            rec.update(self._balance())
        if self.probe_input_ids is not None:
            rec.update(self._probe())
        self._previous = (now, canonical)
        rec["seconds"] = np.float64(time.perf_counter() - start + self._pending_seconds)
        self._pending, self._pending_seconds, self._before = {}, 0.0, None
        self.records.append(rec)
        logger.debug("recorded step %d in %.3f s", step, float(rec["seconds"]))
        return rec

    def add_loss(self, step: int, loss: float) -> None:
        """Add a training loss observed at `step` (the loss series of the trajectory)."""
        self.losses.append((int(step), float(loss)))

    def trajectory(self) -> Trajectory:
        """The records so far as a `Trajectory` (arrays stacked over records)."""
        arrays: dict[str, np.ndarray] = {}
        if self.records:
            for key in self.records[0]:
                arrays[key] = np.stack([np.asarray(r[key]) for r in self.records])
        arrays["loss_step"] = np.array([s for s, _ in self.losses], dtype=np.int64)
        arrays["loss"] = np.array([v for _, v in self.losses], dtype=np.float64)
        if self.balance_reference is not None:
            arrays["balance_reference"] = self.balance_reference
        return Trajectory(arrays, dict(self.metadata, balance_groups=self.balance_keys or []))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the trajectory atomically to `path` (see `trajectory.save_trajectory`)."""
        return save_trajectory(self.trajectory(), path)

    def resume_from(self, trajectory: Trajectory, step: int) -> None:
        """Continue a saved trajectory after resuming training at `step`: keep its records up to `step`, its losses
        and its balance reference. The first chord after resuming is not known (NaN)."""
        keep = trajectory.steps <= step
        per_record = [k for k, v in trajectory.arrays.items() if v.shape[:1] == trajectory.steps.shape
                      and k not in ("loss", "loss_step", "balance_reference")]  # fmt: skip
        self.records = [{k: trajectory.arrays[k][i] for k in per_record} for i in np.flatnonzero(keep)]
        self.losses = [(int(s), float(v)) for s, v in zip(trajectory["loss_step"], trajectory["loss"]) if s <= step]
        if "balance_reference" in trajectory:
            self.balance_reference = trajectory["balance_reference"]
            self.balance_keys = list(trajectory.metadata.get("balance_groups", [])) or None


def _layout_signature(model: nn.Module) -> str:
    """A hash of the model's integer buffers: the index layouts (a pivot-gauge layer's pivot and free positions) that
    decide which weight entry a stored coordinate is. Two runs whose layouts differ store different entries at the same
    place, so their raw and canonical sketches are not comparable (the invariants still are)."""
    digest = hashlib.sha256()
    for name, buffer in model.named_buffers():
        if not (buffer.is_floating_point() or buffer.is_complex()):
            digest.update(name.encode())
            digest.update(buffer.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().square().sum()) for t in tensors))


def _config_dict(model: nn.Module) -> dict | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        return None


def uses_projection(optimizer: Any) -> bool:
    """True when `optimizer` is, or wraps (e.g. Accelerate's AcceleratedOptimizer), a `ProjectedOptimizer`."""
    for _ in range(8):
        if optimizer is None:
            return False
        if isinstance(optimizer, ProjectedOptimizer):
            return True
        optimizer = getattr(optimizer, "optimizer", None)
    return False


class QuotientTrajectoryCallback(TrainerCallback):
    """A `TrainerCallback` that records the run's trajectory on the quotient with a `QuotientRecorder` and writes it
    to `path` (default `<output_dir>/quotient_trajectory.npz`) after every record, at each checkpoint save and at the
    end of training (atomically; only on the main process). Works with `Trainer` and `RelationalTrainer`.

    Records the state before training and after every `every` optimiser steps (and the listed `steps`, and the last
    step); the other steps cost nothing. Losses are the Trainer's logged `loss` values. When training resumes from a
    checkpoint, the existing file's records up to the resumed step are kept. The other arguments are those of
    `QuotientRecorder`; `label` names the run in plots (default: the output folder's name).
    """

    def __init__(
        self,
        every: int | None = DEFAULT_EVERY,
        *,
        steps: Iterable[int] | None = None,
        sketch_dim: int = DEFAULT_SKETCH_DIM,
        seed: int = 0,
        path: str | os.PathLike | None = None,
        residual: bool = False,
        probe_input_ids: torch.Tensor | None = None,
        probe_sites: Sequence[str] = DEFAULT_PROBE_SITES,
        label: str | None = None,
    ) -> None:
        self.settings = dict(every=every, steps=steps, sketch_dim=sketch_dim, seed=seed, residual=residual,
                             probe_input_ids=probe_input_ids, probe_sites=probe_sites)  # fmt: skip
        self.path, self.label = None if path is None else Path(path), label
        self.recorder: QuotientRecorder | None = None
        self._due = False

    def _file(self, args: TrainingArguments) -> Path:
        return self.path or Path(args.output_dir) / TRAJECTORY_NAME

    def _save(self, args: TrainingArguments, state: TrainerState) -> None:
        if self.recorder is not None and state.is_world_process_zero:
            self.recorder.save(self._file(args))

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero:
            return
        model = kwargs["model"]
        metadata = {
            "label": self.label or Path(args.output_dir).name,
            "projection": uses_projection(kwargs.get("optimizer")),
            "symmetry_projection": getattr(args, "symmetry_projection", None),
            "learning_rate": args.learning_rate,
            "training_seed": args.seed,
        }
        self.recorder = QuotientRecorder(model, metadata=metadata, **self.settings)
        file = self._file(args)
        if state.global_step > 0 and file.is_file():
            self.recorder.resume_from(load_trajectory(file), state.global_step)
        self.recorder.record(state.global_step)
        self._save(args, state)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        step = state.global_step + 1
        self._due = self.recorder is not None and (self.recorder.due(step) or step == state.max_steps)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._due:
            self.recorder.before_update()

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._due:
            self.recorder.after_update()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._due:
            self.recorder.record(state.global_step)
            self._save(args, state)
            self._due = False

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        if self.recorder is not None and logs and "loss" in logs:
            self.recorder.add_loss(state.global_step, logs["loss"])

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._save(args, state)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.recorder is not None:
            self.recorder.record(state.global_step)  # no-op when the last step was recorded
            self._save(args, state)


__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_PROBE_SITES",
    "DEFAULT_SKETCH_DIM",
    "ParameterSketch",
    "QuotientRecorder",
    "QuotientTrajectoryCallback",
    "uses_projection",
]
