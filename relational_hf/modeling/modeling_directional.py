"""The directional split of an update (Disentangling Representation Evolution in Transformers through Directional
Decomposition, arXiv 2609.15975): y = y_par + y_perp with y_par = (y.z / |z|^2) z along a reference z.

One home for the formula: the attention's value-space parallel removal, the trainer's parallel suppression and the
directional analysis tools all use it. Travels to the Hub with the model file (``trust_remote_code``); imports only
torch.
"""

from __future__ import annotations

import torch


def parallel_coefficient(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """alpha = y.z / |z|^2 over the last dimension (computed in fp32, 0 where z = 0). Shape: y.shape[:-1] + (1,)."""
    yf, zf = y.float(), z.float()
    denom = (zf * zf).sum(-1, keepdim=True)
    return (yf * zf).sum(-1, keepdim=True) / denom.clamp_min(torch.finfo(torch.float32).tiny)


def parallel_component(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """y_par = (y.z / |z|^2) z, the part of y along the reference z (last dimension); y_perp = y - y_par."""
    return (parallel_coefficient(y, z) * z.float()).to(y.dtype)


def scale_parallel(y: torch.Tensor, z: torch.Tensor, parallel: float = 1.0, perpendicular: float = 1.0) -> torch.Tensor:
    """The component edit y~ = s_par y_par + s_perp y_perp with respect to the reference z."""
    y_par = parallel_component(y, z)
    return parallel * y_par + perpendicular * (y - y_par)
