"""Relational (invariant) descriptors of DESIGN.md 2.1: per-head G_QK = W_Q W_K^T and G_VO = W_V W_O, their
numerical ranks and head-to-head similarities <G^a, G^b>_F / (|G^a| |G^b|).

Readers are taken with their norm gain folded in (W diag(g)), so the descriptors are invariant under the norm-gain
group as well as under the QK/VO gauges and the residual rotation. Everything is computed from r x r (or d_h x d_h)
products of the factors, never from the d x d forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..architectures import get_adapter


@dataclass
class HeadDescriptors:
    """One layer's invariant descriptors: effective ranks (H,) of G_QK and G_VO per query head at relative tolerance
    `rank_tol` (singular values > rank_tol * largest), their singular values, and the (H, H) cosine similarity
    matrices of the forms."""

    layer: int
    qk_rank: list[int]
    vo_rank: list[int]
    qk_singular_values: torch.Tensor
    vo_singular_values: torch.Tensor
    qk_similarity: torch.Tensor
    vo_similarity: torch.Tensor

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "qk_effective_rank": self.qk_rank,
            "vo_effective_rank": self.vo_rank,
            "qk_similarity": self.qk_similarity.tolist(),
            "vo_similarity": self.vo_similarity.tolist(),
        }


def _core_singular_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Singular values of A B^T for batches A (H, m, k), B (H, n, k), through QR: svdvals(R_A R_B^T)."""
    ra = torch.linalg.qr(a, mode="r")[1]
    rb = torch.linalg.qr(b, mode="r")[1]
    return torch.linalg.svdvals(ra @ rb.transpose(-1, -2))


def _similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity matrix of the forms G^h = A^h B^h^T (A (H, m, k), B (H, n, k)):
    <G^x, G^y>_F = sum_ij (A^x^T A^y)_ij (B^x^T B^y)_ij. Row x of the head Gram blocks A^x^T A^y (y >= x) is one
    matrix product A^x^T [A^x ... A^H]; the lower triangle is its mirror image, so each form costs m (H k)^2 flops."""
    h, k = a.shape[0], a.shape[-1]
    flat_a = a.transpose(0, 1).reshape(a.shape[1], h * k)  # (m, H k), head-major columns
    flat_b = b.transpose(0, 1).reshape(b.shape[1], h * k)
    inner = torch.empty(h, h, dtype=a.dtype, device=a.device)
    for x in range(h):
        cols = slice(x * k, (x + 1) * k)
        row_a = flat_a[:, cols].T @ flat_a[:, x * k :]  # (k, (H - x) k): A^x^T A^y for y >= x
        row_b = flat_b[:, cols].T @ flat_b[:, x * k :]
        inner[x, x:] = (row_a * row_b).view(k, h - x, k).sum((0, 2))
        inner[x + 1 :, x] = inner[x, x + 1 :]
    norms = inner.diagonal().clamp_min(0).sqrt()
    return inner / (norms[:, None] * norms[None, :]).clamp_min(torch.finfo(inner.dtype).tiny)


def _rank(values: torch.Tensor, rtol: float) -> list[int]:
    top = values.max(-1, keepdim=True).values
    return ((values > rtol * top) & (top > 0)).sum(-1).tolist()


@torch.no_grad()
def layer_descriptors(adapter, layer, rank_tol: float = 1e-3) -> HeadDescriptors:
    """The descriptors of one layer (a LayerRoles of `adapter`): only that layer's attention factors and attention
    norm gain are read, so a streaming caller may materialise one layer at a time."""
    w = adapter.attention_weights(layer)
    slots = adapter.attention_slots(layer)
    h, hkv, r, dh = slots.num_heads, slots.num_kv_heads, slots.qk_dim, slots.head_dim
    gain = adapter.norm_slots(layer.attention_norm).gain
    dtype = torch.float64 if w.q.shape[1] <= 2048 else torch.float32
    g = torch.ones(w.q.shape[1], dtype=dtype) if gain is None else gain.get().to(dtype)
    g = g.to(w.q.device)
    group = h // hkv
    q = (w.q.to(dtype) * g).reshape(h, r, -1).transpose(1, 2)  # (H, d, r) = W_Q diag-folded
    k = (w.k.to(dtype) * g).reshape(hkv, r, -1).transpose(1, 2).repeat_interleave(group, 0)
    v = (w.v.to(dtype) * g).reshape(hkv, dh, -1).transpose(1, 2).repeat_interleave(group, 0)  # (H, d, d_h)
    o = w.o.to(dtype).reshape(w.o.shape[0], h, dh).permute(1, 0, 2)  # (H, d, d_h) = W_O^h^T
    sv_qk, sv_vo = _core_singular_values(q, k), _core_singular_values(v, o)
    return HeadDescriptors(
        layer=layer.index,
        qk_rank=_rank(sv_qk, rank_tol),
        vo_rank=_rank(sv_vo, rank_tol),
        qk_singular_values=sv_qk.float().cpu(),
        vo_singular_values=sv_vo.float().cpu(),
        qk_similarity=_similarity(q, k).float().cpu(),
        vo_similarity=_similarity(v, o).float().cpu(),
    )


@torch.no_grad()
def head_descriptors(model: nn.Module, rank_tol: float = 1e-3) -> list[HeadDescriptors]:
    """Per layer: effective ranks of G_QK^h and G_VO^h for every query head h (numerical rank: singular values above
    rank_tol times the largest) and the head-to-head similarity matrices of both forms."""
    adapter = get_adapter(model)
    return [layer_descriptors(adapter, layer, rank_tol) for layer in adapter.layers()]


__all__ = ["HeadDescriptors", "head_descriptors", "layer_descriptors"]
