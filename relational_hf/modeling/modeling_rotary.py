"""Rotary helpers of the relational attention (split out of `modeling_relational.py`, which imports them; this file
travels to the Hub with it): rotate-half on pairs (j, j + r/2), rotary tables for layers that keep a subset of the
frequency pairs, and the partial rotary of GPT-NeoX (only the first `rotary_dim` coordinates of each head turn)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension (pairs j, j + r/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate q (B, H, T, r) and k (B, H_kv, T, r) by the angles cos/sin (B, T, r): a layer that keeps every rotary
    pair of the model's table, in order, over several positions."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def apply_rotary_pair_subset(q, k, cos, sin, columns, sign):
    """Rotate q (B, H, T, r) and k (B, H_kv, T, r) when key head h keeps only some of the rotary pairs of the model's
    table cos/sin (B, T, R), over several positions: columns, sign are the key heads' part of the layer's
    `rotary_layout` (its last H_kv r entries); each query head turns with its key head's angles, which are gathered
    once for the group (B, H_kv, T, r) and broadcast over its query heads."""
    b, h, t, r = q.shape
    h_kv = k.shape[1]
    cos_k = cos.index_select(-1, columns).unflatten(-1, (h_kv, r)).transpose(1, 2)  # (B, H_kv, T, r)
    sin_k = (sin.index_select(-1, columns) * sign).unflatten(-1, (h_kv, r)).transpose(1, 2)
    q = q.reshape(b, h_kv, h // h_kv, t, r)
    q = q * cos_k[:, :, None] + q.roll(r // 2, -1) * sin_k[:, :, None]
    return q.reshape(b, h, t, r), k * cos_k + k.roll(r // 2, -1) * sin_k


def rotary_layout(pairs: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotary embedding of a layer as three vectors over its flat projections [q | k] (..., (H + H_kv) r), for
    key heads that keep the frequency pairs pairs (H_kv, r/2) of the model's table (pairs[h] = 0 .. r/2 - 1 for a
    layer that keeps them all, in order). Coordinates j and j + r/2 of key head h turn with the angle of pair
    pairs[h, j], and each query head with its key head's pairs:

    - columns: the column of the model's cos/sin table (B, T, R) that gives each coordinate its angle;
    - swap: the coordinate it turns with (j <-> j + r/2 within its head);
    - sign: -1 on the first half of each head, +1 on the second (int8: it never promotes the dtype).

    `apply_rotary` turns x into x cos + rotate_half(x) sin, head by head, with these at a decoding step: two gathers of
    the table, one of x, no reshapes, the same few operators for every layer whatever it keeps (over many positions,
    gathers along the last dimension are slow on CPUs: `apply_rotary_pair_subset` and `apply_rotary_pos_emb` there)."""
    h_kv, half = pairs.shape
    key_columns = torch.cat((pairs, pairs), dim=-1)  # (H_kv, r)
    columns = torch.cat((key_columns.repeat_interleave(num_heads // h_kv, 0).reshape(-1), key_columns.reshape(-1)))
    heads, r = num_heads + h_kv, 2 * half
    within = torch.arange(r, device=pairs.device).roll(half)
    swap = (within + r * torch.arange(heads, device=pairs.device)[:, None]).reshape(-1)
    sign = torch.ones(heads, 2, half, dtype=torch.int8, device=pairs.device)
    sign[:, 0] = -1
    return columns, swap, sign.reshape(-1)


def apply_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout) -> torch.Tensor:
    """The rotary embedding of the flat projections qk = [q | k] (B, T, (H + H_kv) r) at the angles of the model's
    table cos/sin (B, T, R), for the `rotary_layout` of the layer (meant for few positions T)."""
    columns, swap, sign = layout
    return qk * cos.index_select(-1, columns) + qk.index_select(-1, swap) * (sin.index_select(-1, columns) * sign)


def apply_partial_rotary(q, k, cos, sin, rotary_dim: int):
    """Partial rotary (GPT-NeoX's `rotary_pct`): the first `rotary_dim` coordinates of each head of q (B, H, T, r)
    and k (B, H_kv, T, r) turn in the rotate-half layout (pairs j, j + rotary_dim / 2) at the angles cos/sin
    (B, T, rotary_dim); the others pass unchanged."""
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
    return torch.cat((q_rot, q[..., rotary_dim:]), -1), torch.cat((k_rot, k[..., rotary_dim:]), -1)
