"""Whole tensors from sharded parameters, and shards back from whole tensors (FSDP2 / DTensor).

Under FSDP2 (`torch.distributed.fsdp.fully_shard`, also through Accelerate's FSDP plugin and the Trainer's `fsdp`
option) every parameter is a `DTensor`: each process holds one shard (a block of rows) of each matrix. The symmetry
groups solve small per-head systems on whole matrices (Grams W_Q^T W_Q, W_K^T W_K, ...), so they read parameters
through `full_tensor` (an all-gather across the mesh for a DTensor; the tensor itself otherwise) and an update
computed on whole tensors is applied to a process's own shard through `shard_like`, which cuts the same shard
locally (no communication). Every process then computes the same whole-tensor update and applies its own part of
it, which is the update one process would apply to the unsharded model.

`full_tensor` is a collective for a DTensor: every process of the mesh must call it, on the same parameters and in
the same order (true of the optimiser step, the balance read at logging steps, and the group builder, which every
process runs alike).
"""

from __future__ import annotations

import torch

try:  # public since torch 2.5; torch 2.4 has it as torch.distributed._tensor
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch built without distributed support, or too old for the public module
    DTensor = None  # type: ignore[assignment,misc]
    distribute_tensor = None  # type: ignore[assignment]


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a DTensor (e.g. an FSDP2 parameter), whose values are spread over processes."""
    return DTensor is not None and isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached: all-gathered for a DTensor (a collective), the tensor itself (no copy) otherwise."""
    tensor = tensor.detach()
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` (a whole tensor shaped like `like`) laid out as `like`: for a DTensor, a DTensor on the same mesh and
    placements whose local part is this process's shard of `full`, cut locally (`src_data_rank=None`: no
    communication; every process must pass the same `full`); otherwise `full` itself."""
    if not is_sharded(like):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


__all__ = ["full_tensor", "is_sharded", "shard_like"]
