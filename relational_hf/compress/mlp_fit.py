"""The MLP half of a layer's compression (`compress.lowrank`): the hidden units of a SwiGLU or of a plain MLP with
biases (GPT-2 and GPT-NeoX conversions), the refit's samples and its refinement, and the first state of the stream.

A plain unit i computes z_i = act(x w_up,i + b_up,i) and writes z_i w_down,i; the down bias is written whatever units
are kept, so it stays as it is and the refit's target is the MLP's output without it. Removing unit i removes a row of
W_up with its bias and a column of W_down, as for a SwiGLU unit (whose z_i = act(x w_gate,i) (x w_up,i)); the
importance sqrt(E z_i^2) ||w_down,i|| and the least-squares refit of W_down are the same functions of Z (a plain MLP
has no scale gauge, so its importance needs no balancing). A write that was mean-free (a converted LayerNorm model's:
every write centred) stays mean-free: the refitted W_down is centred, C W_down, which for the mean-free targets of
such a model can only lower the error (C is an orthogonal projector), and the model stays exportable to its family's
class (`convert.export_layernorm`). The refinement by gradient descent (`compress.refine`) trains SwiGLU maps only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..modeling.modeling_blocks import embed_input
from .layer_inputs import combined, output_norm_weights
from .refine import refine_mlp

#: largest |column mean| of a write, relative to its largest entry, taken as mean-free (float32 rounding)
MEAN_FREE_TOLERANCE = 1e-5


def _token_weights(h: torch.Tensor, sensitivity: str) -> torch.Tensor | None:
    """Per-token weights d / |h_t|^2 (B, T) for sensitivity 'token' or 'fisher' (errors relative to each token's
    residual energy, as the next RMS norm sees them: the weights of the fits), None otherwise."""
    if sensitivity not in ("token", "fisher"):
        return None
    return h.shape[-1] / h.double().pow(2).sum(-1).clamp_min(1e-12)


def _batches(n: int, size: int):
    for i in range(0, n, size):
        yield slice(i, min(n, i + size))


@torch.no_grad()
def embedded(model, ids: torch.Tensor) -> torch.Tensor:
    """The stream's first state for token ids (N, T): token embeddings plus the learned position table's rows, centred
    with `embedding_centring` (`modeling_blocks.embed_input`, what the model's forward computes)."""
    base = model.model
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    return embed_input(model.config, base.embed_tokens(ids), base.embed_positions, positions)


def mlp_units(mlp, m: dict, x: torch.Tensor) -> torch.Tensor:
    """The hidden units Z (..., d_ff) of `mlp` with full weights `m` on normed inputs x: act(x W_gate) * (x W_up) for a
    SwiGLU, act(x W_up + b_up) for a plain MLP."""
    if "gate" in m:
        return mlp.act_fn(F.linear(x, m["gate"])) * F.linear(x, m["up"])
    return mlp.act_fn(F.linear(x, m["up"], m.get("up_bias")))


def kept_mlp(m: dict, keep: torch.Tensor, down: torch.Tensor) -> dict:
    """The full weights of the units `keep` with the refitted W_down `down` (d, k); biases follow their units (the down
    bias is kept as it is)."""
    out = {key: m[key][keep] for key in ("gate", "up", "up_bias") if m.get(key) is not None}
    out["down"] = down
    if m.get("down_bias") is not None:
        out["down_bias"] = m["down_bias"]
    return out


def mean_free_columns(w: torch.Tensor) -> bool:
    """Whether every column of the Linear-layout write `w` (d, k) sums to zero (to float32 rounding)."""
    w = w.detach().double()
    return float(w.mean(0).abs().max()) <= MEAN_FREE_TOLERANCE * max(float(w.abs().max()), 1e-30)


def centred_columns(w: torch.Tensor) -> torch.Tensor:
    """C W: every column of `w` (d, k) made mean-free (float64 arithmetic), in w's dtype."""
    x = w.double()
    return (x - x.mean(0, keepdim=True)).to(w.dtype)


def _accumulate_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block: int = 512) -> None:
    """out += a^T b, with the product in a's precision (fp32 is twice as fast as fp64 on CPUs) and the sum in out's
    (fp64), `block` columns at a time: the temporaries are (a.shape[1], block), not a second and third copy of out
    (at d_ff 11008 that is 1.4 GB less at the peak of a layer's compression)."""
    for i in range(0, b.shape[1], block):
        out[:, i : i + block] += (a.T @ b[:, i : i + block]).to(out.dtype)


def _fit_weights(h_mid, z, m, output_norm, sensitivity: str) -> torch.Tensor | None:
    """The refit's token weights (tokens, 1) in fp32, or None: the plan's sensitivity (`_token_weights` of the
    compressed stream h_mid), times, behind a sandwich norm `output_norm`, what the norm gives an error in the dense
    MLP's output (`layer_inputs.output_norm_weights`; z: the dense units on these tokens)."""
    behind = None
    if output_norm is not None:
        bias = m.get("down_bias")
        behind = output_norm_weights(output_norm, F.linear(z, m["down"].float(), None if bias is None else bias.float()))
    tw = combined(_token_weights(h_mid, sensitivity), None if behind is None else behind.reshape(h_mid.shape[:-1]))
    return None if tw is None else tw.reshape(-1, 1).float()


def _mlp_samples(mlp, m, norm, h_in, h_mid, dense_out, windows: range, opts, output_norm=None):
    """Per batch of the calibration `windows`: Z (tokens, d_ff) the units on the stream h_in the MLP reads (h_mid, the
    compressed stream after the attention; the layer input with the parallel residual), Z times the tokens' weights
    (the plan's sensitivity), the refit's target Y (tokens, d: the dense trajectory's step from h_mid with `dense_out`,
    less the down bias, blended with the dense MLP's output by `refit_blend`, else the dense MLP's output alone, without
    its bias) and the weighted energy of Y; Z, Y in fp32. output_norm: the layer's sandwich norm behind the MLP
    (`_fit_weights`)."""
    f, d = m["down"].shape[1], h_mid.shape[-1]
    down = m["down"].float()
    bias = m.get("down_bias")
    blend = opts.target_blend()  # share of the dense trajectory's step in the target (with dense_out)
    for b in _batches(len(windows), opts.batch_size):
        s = slice(windows.start + b.start, windows.start + b.stop)
        z = mlp_units(mlp, m, norm(h_in[s])).reshape(-1, f).float()
        tw = _fit_weights(h_mid[s], z, m, output_norm, opts.sensitivity)
        if dense_out is None:
            y = F.linear(z, down)
        else:
            y = (dense_out[s] - h_mid[s]).reshape(-1, d).float()
            y = y if bias is None else y - bias.float()
        if dense_out is not None and blend != 1.0:  # blended per token: no statistics beyond the refit's own
            y = blend * y + (1 - blend) * F.linear(z, down)
        yield z, (z if tw is None else z * tw), y, float((y.double().pow(2) * (1 if tw is None else tw.double())).sum())


def _refine(mlp, dense_mlp, kept, norm, h_in, h_mid, dense_out, opts, record: dict | None, output_norm=None) -> dict:
    """`refine.refine_mlp` of the kept SwiGLU maps on the refit's own target and token weights (the blend chosen on
    held-back windows, with refit_holdout), every calibration window's rows at once (two copies of h_mid)."""
    n = h_mid.shape[0]
    record = record if record is not None else {}
    if "blend" in record:  # refit_holdout chose this layer's target
        opts = dataclasses.replace(opts, refit_holdout=0, refit_blend=record["blend"])
    x = torch.cat([norm(h_in[s]).reshape(-1, h_in.shape[-1]) for s in _batches(n, opts.batch_size)])
    samples = _mlp_samples(mlp, dense_mlp, norm, h_in, h_mid, dense_out, range(0, n), opts)
    y = torch.cat([y for _, _, y, _ in samples])
    weights = _token_weights(h_mid, opts.sensitivity)
    if output_norm is not None:  # behind a sandwich norm (`_fit_weights`)
        f = dense_mlp["down"].shape[1]
        weights = torch.cat([
            _fit_weights(h_mid[s], mlp_units(mlp, dense_mlp, norm(h_in[s])).reshape(-1, f).float(), dense_mlp,
                         output_norm, opts.sensitivity)
            for s in _batches(n, opts.batch_size)
        ]).reshape(n, -1)  # fmt: skip
    refine_opts = opts.refine_options(n)
    kept, done = refine_mlp(kept, mlp.act_fn, x, y, None if weights is None else weights.reshape(-1), n, refine_opts)
    record.update(done)
    return kept


__all__ = ["centred_columns", "embedded", "kept_mlp", "mean_free_columns", "mlp_units"]
