"""`ProjectedOptimizer`: any torch optimiser whose every step is horizontal (DESIGN.md 2.3), through torch's public
optimiser hooks; the projection itself is `projection.UpdateProjector`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .groups import ParamDict
from .projection import ProjectionStats, UpdateProjector
from .sharding import full_tensor, shard_like

logger = logging.getLogger(__name__)


class ProjectedOptimizer(torch.optim.Optimizer):
    """Wraps any torch optimiser so that every step is horizontal: after the inner step the update
    delta = theta_new - theta_old is replaced by delta - P_V(delta) (DESIGN 2.3), P_V the orthogonal projection onto
    the vertical space of the model's symmetry groups at theta_old.

    The projection is installed on the wrapped optimiser through torch's public hooks: a step pre-hook snapshots
    theta_old, a step post-hook (the first one, so later post-hooks see the projected parameters) replaces the update,
    and state-dict hooks add and read back one entry, "symmetry_projection", with the projection's settings and step
    count. So the wrapped optimiser projects and saves itself whoever calls it; `unwrap()` removes the hooks.

    The wrapper is a `torch.optim.Optimizer` (LR schedulers, HF Trainer and accelerate accept it) that delegates
    `param_groups`, `state`, `defaults`, `step`, `zero_grad`, `add_param_group`, the state dict and hook registration
    to the wrapped optimiser, like accelerate's `AcceleratedOptimizer`. `last_stats` holds the last step's
    `ProjectionStats`. Keyword arguments go to `UpdateProjector`.

    Sharded training (FSDP2): the wrapper may be built before the model is sharded, as the Trainer does (Accelerate
    then swaps the wrapped optimiser's parameters for DTensor shards of the same model): when the optimiser's
    parameters are no longer those the projector was built on, the projector is rebuilt on `model` before the step.
    With DTensor parameters each block of the normal equations (`UpdateProjector.blocks`) is gathered whole, solved
    and applied shard by shard: every process computes the one-process update and keeps its own shard of it.
    """

    #: the state-dict entry holding the projection's settings and step count
    STATE_KEY = "symmetry_projection"

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, **projector_kwargs: Any) -> None:
        # Not calling Optimizer.__init__: the wrapped optimiser owns parameters, state and hooks.
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, ProjectedOptimizer):
            raise TypeError(
                f"optimizer: expected a torch.optim.Optimizer that is not already projected, got {type(optimizer)!r}"
            )
        self.optimizer = optimizer
        self.model = model
        self._projector_kwargs = projector_kwargs
        self._owned_ids = self._owned()
        self.projector = UpdateProjector(model, allowed_params=self._owned_params(), **projector_kwargs)
        self.projected_steps = 0
        self._old: ParamDict | None = None
        self._handles = [
            optimizer.register_step_pre_hook(self._snapshot),
            optimizer.register_step_post_hook(self._project),
            optimizer.register_state_dict_post_hook(self._add_state),
            optimizer.register_load_state_dict_pre_hook(self._read_state),
        ]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def last_stats(self) -> ProjectionStats | None:
        return self.projector.last_stats

    # --- the projection, as hooks of the wrapped optimiser ------------------------------------------------------
    def _owned_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _owned(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self._owned_params())

    def _rebind(self) -> None:
        """Rebuild the projector when the wrapped optimiser's parameters were replaced (e.g. by Accelerate's FSDP2
        preparation, which shards `model` in place and gives the optimiser the sharded parameters)."""
        owned = self._owned()
        if owned == self._owned_ids:
            return
        before = len(self.projector.groups)
        self._owned_ids = owned
        self.projector = UpdateProjector(self.model, allowed_params=self._owned_params(), **self._projector_kwargs)
        if len(self.projector.groups) < before:
            logger.warning(
                "update projection: the optimizer's parameters changed and only %d of %d symmetry groups act on "
                "them now; the others are no longer projected",
                len(self.projector.groups),
                before,
            )

    @torch.no_grad()
    def _snapshot(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: remember theta_old (this process's shards of sharded parameters)."""
        self._rebind()
        self._old = {k: p.detach().clone() for k, p in self.projector.params.items()}

    @torch.no_grad()
    def _project(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step post-hook: theta_new -> theta_old + delta - P_V(delta), P_V taken at theta_old (DESIGN 2.3), one
        block of the normal equations at a time (sharded parameters gathered whole for their block only)."""
        old, self._old = self._old, None
        if old is None:
            return
        projector = self.projector
        params, dtype = projector.params, projector.dtype
        parts = []
        for block in projector.blocks:
            at = {k: full_tensor(old[k]) for k in block.keys}
            delta = {k: full_tensor(params[k]).to(dtype) - at[k].to(dtype) for k in block.keys}
            vertical, stats = projector.block_vertical(block, delta, at=at)
            parts.append(stats)
            for k, v in vertical.items():
                p = params[k]
                if p.dtype == dtype:
                    p.sub_(shard_like(v, p))  # theta_old + delta - v
                else:
                    p.copy_(shard_like((at[k].to(dtype) + delta[k] - v).to(p.dtype), p))
        projector.last_stats = ProjectionStats.combine(parts)
        self.projected_steps += 1

    def _add_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """State-dict post-hook: add the projection's entry."""
        state_dict[self.STATE_KEY] = {
            "projected_steps": self.projected_steps,
            "tol": self.projector.tol,
            "max_iter": self.projector.max_iter,
            "eps": self.projector.eps,
            "groups": [g.key for g in self.projector.groups],
        }
        return state_dict

    def _read_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Load-state-dict pre-hook: take the projection's entry out (a plain optimiser's state dict has none)."""
        state_dict = dict(state_dict)
        extra = state_dict.pop(self.STATE_KEY, None)
        if extra is not None:
            self.projected_steps = int(extra.get("projected_steps", 0))
        return state_dict

    # --- delegation -----------------------------------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """The inner step; its hooks replace the update by the horizontal part."""
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def register_step_pre_hook(self, hook):  # type: ignore[override]
        """Registered on the wrapped optimiser: runs before its update (after the snapshot of theta_old)."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):  # type: ignore[override]
        """Registered on the wrapped optimiser: runs after the projection."""
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook, prepend: bool = False):  # type: ignore[override]
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook, prepend: bool = False):  # type: ignore[override]
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):  # type: ignore[override]
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):  # type: ignore[override]
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def unwrap(self) -> torch.optim.Optimizer:
        """Remove the projection's hooks and return the wrapped optimiser (which then steps unprojected)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return self.optimizer

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ProjectedOptimizer({self.optimizer!r}, groups={len(self.projector.groups)})"


__all__ = ["ProjectedOptimizer"]
