"""Principal gauge of the residual stream and slicing (DESIGN.md 2.2), for relational models.

A relational model's norms are gain-free, so x -> x R (R in O(d)) is an exact symmetry: embeddings and writers
rotate, readers see n(x R) = n(x) R. The principal gauge takes R = eigenvectors of the calibration covariance
C = sum over norm sites and tokens of n n^T (n = x / rms(x), what the readers read), descending, signs fixed.
Slicing keeps the first d' columns Q_s of R: E <- E Q_s, writers <- Q_s^T W, readers <- W Q_s. Because an RMS norm
over d' coordinates is sqrt(d'/d) times the one over d when the dropped directions carry little energy, readers are
scaled by sqrt(d/d'); with a tied head the embedding and all writers are scaled by the same factor instead, which
the norms do not see (scale invariance) and which gives the head its factor. At d' = d this is exact.
A final norm gain g (`final_norm_gain`) in front of a tied head: the logits n(x) diag(g) E^T become, in the sliced
stream y = x Q_s, n(y) M (E Q_s)^T with M = Q_s^T diag(g) Q_s (d' x d', symmetric; exact at d' = d). The basis inside
the kept subspace is free (the gain-free norms commute with any rotation of the sliced stream), so Q_s is replaced by
Q_s P with M = P diag(lambda) P^T: M becomes the diagonal gain lambda (d' values) and the head stays tied (Rayleigh-Ritz
of the gain on the kept subspace). A constant gain is the special case P = I. An untied head absorbs the gain.
One rotation serves the whole stream (the relational architecture has no per-layer shortcut maps, unlike SliceGPT).
A slice never stores more parameters than its source (`compress.eval.check_not_grown`). Callers:
`convert.to_relational(slice_fraction=...)`, `jobs.compress_model(method="slice")` and its `slice_fraction` option.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.initialization import no_init_weights

from ..architectures import get_adapter
from ..modeling import RelationalConfig
from ..modeling.modeling_relational import RelationalRMSNorm
from ..params import check_not_grown, stored_parameters
from ..symmetry.algebra import principal_rotation


@dataclass
class SliceReport:
    """Slicing outcome: widths, stored parameters before/after, the share of calibration variance kept, and the
    perplexity on held-out tokens before/after (None when no evaluation data was given)."""

    fraction: float
    hidden_size_before: int
    hidden_size_after: int
    parameters_before: int
    parameters_after: int
    variance_kept: float
    perplexity_before: float | None = None
    perplexity_after: float | None = None
    head_untied: bool = False  # kept for compatibility: slicing never unties a tied head any more

    @property
    def parameter_reduction(self) -> float:
        """Share of stored parameters removed, in [0, 1)."""
        return 1.0 - self.parameters_after / self.parameters_before

    def to_markdown(self) -> str:
        lines = [
            f"Slicing {self.fraction:.0%} of the residual stream: d {self.hidden_size_before} -> {self.hidden_size_after},"
            f" parameters {self.parameters_before:,} -> {self.parameters_after:,} ({self.parameter_reduction:.1%} fewer),"
            f" calibration variance kept {self.variance_kept:.1%}" + (" (head untied)" if self.head_untied else ""),
        ]
        if self.perplexity_before is not None:
            lines.append(f"- held-out perplexity {self.perplexity_before:.3f} -> {self.perplexity_after:.3f}")
        return "\n".join(lines)


def _batches(data: torch.Tensor | Sequence[torch.Tensor], batch_size: int):
    if isinstance(data, torch.Tensor):
        data = data if data.dim() == 2 else data[None]
        for i in range(0, data.shape[0], batch_size):
            yield data[i : i + batch_size]
    else:
        for seq in data:
            yield seq.reshape(1, -1)


def _num_batches(data: torch.Tensor | Sequence[torch.Tensor], batch_size: int) -> int:
    if isinstance(data, torch.Tensor):
        return math.ceil((data.shape[0] if data.dim() == 2 else 1) / batch_size)
    return len(data)


@torch.no_grad()
def residual_covariance(
    model: nn.Module, calibration_data: torch.Tensor | Sequence[torch.Tensor], batch_size: int = 8
) -> torch.Tensor:
    """C = sum over every norm site (before attention, before the MLP, final) and token of n n^T, n the normalised
    residual vector (before any final gain); (d, d) float64."""
    norms = [m for m in model.modules() if isinstance(m, RelationalRMSNorm)]
    d = model.config.hidden_size
    cov = torch.zeros(d, d, dtype=torch.float64)
    device = next(model.parameters()).device

    def hook(module, inputs, _output):
        flat = module.normalize(inputs[0].detach()).reshape(-1, d).double().cpu()
        cov.add_(flat.T @ flat)

    handles = [m.register_forward_hook(hook) for m in norms]
    try:
        was_training = model.training
        model.eval()
        for batch in tqdm(
            _batches(calibration_data, batch_size),
            total=_num_batches(calibration_data, batch_size),
            desc="calibration (residual covariance)",
            leave=False,
        ):
            model(batch.to(device))
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    return cov


def principal_basis(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors of the covariance as columns (descending eigenvalues, largest entry of each column positive)
    and the eigenvalues."""
    rot, _ = principal_rotation(cov, torch.eye(cov.shape[0], dtype=torch.float64))
    evals = torch.einsum("ij,ik,kj->j", rot, cov.double(), rot)
    return rot, evals


@torch.no_grad()
def slice_relational(
    model: nn.Module, fraction: float, calibration_data: torch.Tensor | Sequence[torch.Tensor]
) -> tuple[nn.Module, SliceReport]:
    """Rotate `model` (a relational causal LM) into the principal gauge of the calibration covariance and keep the
    d' = d - round(fraction d) highest-variance directions. Returns (new model, SliceReport). d' must stay >= the
    head width (the pivot gauge needs head_dim <= hidden_size). A tied head stays tied: a final gain becomes the
    diagonal of Q_s^T diag(g) Q_s in its own eigenbasis of the kept subspace (module docstring); an untied head
    absorbs the gain. Raises ValueError if the result would store more parameters than `model`."""
    config: RelationalConfig = model.config
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"slicing fraction must be in [0, 1), got {fraction}")
    if config.sandwich_norms or config.embedding_scale is not None or config.layer_types is not None:
        raise ValueError(
            "slicing: sandwich norms, the embedding scale and sliding-window layers (a converted Gemma 3) are not "
            "sliced yet; --method relational without --slice-fraction compresses it"
        )
    layernorm = {
        "mlp_gated=False": not config.mlp_gated,
        "embedding_centring=True": config.embedding_centring,
        "final_norm_bias=True": config.final_norm_bias,
        "position_encoding='learned'": config.position_encoding == "learned",
    }
    found = [name for name, present in layernorm.items() if present]
    if found:
        raise ValueError(
            f"slicing: {found[0]} (a converted GPT-2 or GPT-NeoX: LayerNorm centring, biases, a plain MLP) is not "
            "sliced yet; --method relational without --slice-fraction compresses it"
        )
    d = config.hidden_size
    d_new = d - int(round(fraction * d))
    if d_new < max(config.head_dim, config.qk_rank) or d_new < 1:
        raise ValueError(f"slicing {fraction} of d={d} leaves {d_new} < head_dim {config.head_dim}")
    rot, evals = principal_basis(residual_covariance(model, calibration_data))
    qs = rot[:, :d_new]  # (d, d')
    rho = math.sqrt(d / d_new)  # reader factor
    gain = model.model.norm.weight
    tied = bool(config.tie_word_embeddings)
    keep_gain = gain is not None and tied  # a gain in front of a tied head stays a gain (in the rotated basis)
    fold_gain = gain is not None and not tied  # an untied head absorbs it
    new_gain = None
    if keep_gain:
        compressed = qs.T @ (gain.detach().double().cpu()[:, None] * qs)  # M = Q_s^T diag(g) Q_s, (d', d')
        if bool((gain == gain[0]).all()):
            new_gain = torch.full((d_new,), float(gain[0]), dtype=torch.float64)  # M = g I: any basis
        else:
            lam, p = torch.linalg.eigh(0.5 * (compressed + compressed.T))
            order = torch.argsort(lam, descending=True)
            qs, new_gain = qs @ p[:, order], lam[order]
    beta = rho if tied else 1.0  # embedding/writer factor (tied head)
    new_config = copy.deepcopy(config)
    new_config.hidden_size = d_new
    new_config.tie_word_embeddings = tied
    new_config.final_norm_gain = keep_gain
    with no_init_weights():
        sliced = type(model)(new_config)
    if tied and sliced.lm_head.weight is not sliced.model.embed_tokens.weight:
        sliced.lm_head.weight = sliced.model.embed_tokens.weight
    sliced.to(device=next(model.parameters()).device, dtype=next(model.parameters()).dtype).eval()
    src, dst = get_adapter(model), get_adapter(sliced)
    q = qs.to(next(model.parameters()).device)

    def readers(w: torch.Tensor) -> torch.Tensor:
        return (w.double() @ q) * rho  # (out, d) -> (out, d')

    def writers(w: torch.Tensor) -> torch.Tensor:
        return (q.T @ w.double()) * beta  # (d, in) -> (d', in)

    for ls, ld in zip(src.layers(), dst.layers(), strict=True):
        w = ls.attention.full_weights()
        new = {"q": readers(w["q"]), "k": readers(w["k"]), "v": readers(w["v"]), "o": writers(w["o"])}
        for key in ("q_bias", "k_bias", "v_bias", "q_norm", "k_norm"):  # head-space tensors: not rotated
            if key in w:
                new[key] = w[key].double()
        if "o_bias" in w:
            new["o_bias"] = (w["o_bias"].double() @ q) * beta
        ld.attention.set_full_weights({k: v.float() for k, v in new.items()})
        m = ls.mlp.full_weights()
        ld.mlp.set_full_weights(
            {"gate": readers(m["gate"]).float(), "up": readers(m["up"]).float(), "down": writers(m["down"]).float()}
        )
    dst.embedding().weight.copy_((src.embedding().weight.double() @ q) * beta)
    if keep_gain:
        sliced.model.norm.weight.copy_(new_gain.to(sliced.model.norm.weight))
    if not tied:
        head = model.lm_head.weight.double() * (gain.double() if fold_gain else 1.0)
        sliced.lm_head.weight.copy_(readers(head))
    total = float(evals.clamp_min(0).sum())
    report = SliceReport(
        fraction=fraction,
        hidden_size_before=d,
        hidden_size_after=d_new,
        parameters_before=stored_parameters(model)["total"],
        parameters_after=stored_parameters(sliced)["total"],
        variance_kept=float(evals[:d_new].clamp_min(0).sum()) / total if total > 0 else 1.0,
        head_untied=False,
    )
    check_not_grown(report.parameters_before, report.parameters_after, f"slicing {fraction}")
    return sliced, report


__all__ = ["SliceReport", "principal_basis", "residual_covariance", "slice_relational"]
