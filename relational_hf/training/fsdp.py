"""Saving a model that FSDP2 sharded in place (the Trainer's `fsdp` option, Accelerate's FSDP plugin).

`fully_shard` turns every parameter into a DTensor shard and changes the model's class to a subclass it creates,
`FSDP<Name>`, defined in a torch module. Two things then go wrong when such a model is saved with
`save_pretrained`: its own `state_dict()` holds shards (and reading them is a collective that only the writing
process would enter), and Transformers writes the class's module file, a torch file, as the model's code with
`auto_map` pointing at it, so the checkpoint does not load with `trust_remote_code` nor carry the model's code.

- `is_sharded_model(model)`: whether FSDP2 manages some module of `model`;
- `unsharded_class(model)`: a context in which `model.__class__` is the class FSDP2 wrapped, so `save_pretrained`
  copies the model's own code files and writes an `auto_map` naming them;
- `gathered_for_saving(trainer, model)`: a collective every process enters; returns what the writing process
  passes to `save_checkpoint` or calls `save_pretrained` on: the model itself when it is not sharded, otherwise a
  `GatheredModel` holding the whole state dict (Accelerate's `get_state_dict`: gathered into the main process's
  CPU memory) whose `save_pretrained` writes it through `unsharded_class`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch built without distributed support
    FSDPModule = None  # type: ignore[assignment,misc]


def is_sharded_model(model: nn.Module) -> bool:
    """True when FSDP2 (`fully_shard`) manages `model` or one of its submodules."""
    return FSDPModule is not None and any(isinstance(m, FSDPModule) for m in model.modules())


def _wrapped_class(cls: type) -> type:
    """The class `fully_shard` derived `cls` from (its first base that is not an FSDP class), or `cls` itself."""
    if FSDPModule is None or not issubclass(cls, FSDPModule):
        return cls
    return next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))


@contextmanager
def unsharded_class(model: nn.Module) -> Iterator[nn.Module]:
    """Within the context `model.__class__` is the class FSDP2 wrapped (no change for a model FSDP2 does not
    manage at the top), so Transformers' `save_pretrained` writes the model's own code files and `auto_map`. Only
    for saving: FSDP2's hooks and methods are not reachable through the class meanwhile."""
    sharded_cls = type(model)
    plain_cls = _wrapped_class(sharded_cls)
    if plain_cls is sharded_cls:
        yield model
        return
    model.__class__ = plain_cls
    try:
        yield model
    finally:
        model.__class__ = sharded_cls


class GatheredModel:
    """A sharded model's whole state dict, saved through the model's own class: `save_pretrained(folder, ...)` is
    `model.save_pretrained(folder, state_dict=state_dict, ...)` under `unsharded_class`. Exists on the process
    that received the gathered tensors (the main process)."""

    def __init__(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any):
        with unsharded_class(self.model) as model:
            return model.save_pretrained(save_directory, state_dict=self.state_dict, **kwargs)


def gathered_for_saving(trainer, model: nn.Module) -> nn.Module | GatheredModel:
    """What the main process saves after `trainer.train()`: `model` itself unless FSDP2 sharded it; then a
    `GatheredModel` with the whole state dict (`trainer.accelerator.get_state_dict`, a collective: every process
    must call this, only the main process receives the tensors)."""
    if not is_sharded_model(model):
        return model
    return GatheredModel(model, trainer.accelerator.get_state_dict(trainer.model))


__all__ = ["GatheredModel", "gathered_for_saving", "is_sharded_model", "unsharded_class"]
