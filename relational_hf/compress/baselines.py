"""Baselines for compression at a given share of stored parameters removed: magnitude pruning, Wanda, SliceGPT.

Pruning ("A Simple and Effective Pruning Approach for Large Language Models", arXiv 2306.11695, for Wanda) zeroes
weights of the decoder layers' linear maps; the maths (scores |W_ij| and |W_ij| ||x_j||_2, unstructured and N:M
masks) has its one home in `compress.ops`. A pruned model keeps its dense storage; its non-zeros are what a
sparse format would store. `prune_to_target` picks the sparsity whose non-zeros remove the asked share of the
stored parameters.

SliceGPT ("SliceGPT: Compress Large Language Models by Deleting Rows and Columns", arXiv 2401.15024), written from
the paper for Llama-style decoders (pre-norm RMSNorm, attention and gated MLP blocks):
1. the RMSNorm gains g are folded into the linear maps that read the norm (W <- W diag(g)); what is left is the
   gain-free n(x) = x / sqrt(|x|^2 / d + eps), and n(x Q) = n(x) Q for every orthogonal Q (the denominator keeps the
   source width d after slicing, so a sliced stream is normalised as the full one was);
2. each block (attention, MLP) b reads the residual stream in its own orthonormal basis Q_b (d x d'): the d' leading
   eigenvectors of C_b = sum over calibration tokens of n(x)^T n(x), x the block's residual input;
3. calibration is sequential: the signals of block b are computed by the already sliced blocks before it, on the
   sliced stream, so each PCA sees the errors slicing has already made;
4. block b reads W Q_b, writes Q_{b+1}^T W (the basis of the next block), and the residual path carries the
   shortcut S_b = Q_b^T Q_{b+1} (d' x d'): x_{b+1} = x_b S_b + block(x_b). Parameters counted include the shortcuts.
The head: `head="untied"`: head <- W_head diag(g_final) Q_last, the head sliced in the last block's basis as the
paper does; for a tied model that separates it from the embedding E Q_first (+V d' parameters, counted).
`head="tied"` keeps it tied: the logits
n(y) Q_last^T diag(g) Q_first (E Q_first)^T need the d' x d' map M = Q_last^T diag(g) Q_first = U diag(sigma) V^T;
the free rotations inside the first and last bases (Q_first <- Q_first V, Q_last <- Q_last U) turn M into the gain
vector sigma on the final norm, so the head stays the embedding and only d' values are added. Exact at d' = d in
both cases; the tied variant loses the part of E outside span(Q_first) in the head.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from .eval import check_not_grown, stored_parameters
from .ops import (
    PRUNING_PATTERNS,
    PRUNING_SCORES,
    input_feature_norms,
    prune_weights,
    weight_matrices,
)

logger = logging.getLogger(__name__)

SLICEGPT_HEADS: tuple[str, ...] = ("auto", "tied", "untied")


# ----------------------------------------------------------------------------------------------------------------
# Magnitude pruning and Wanda
# ----------------------------------------------------------------------------------------------------------------


def prunable_parameters(model: nn.Module) -> int:
    """Entries of the decoder layers' linear weights (what magnitude pruning and Wanda may zero)."""
    return sum(m.rows.numel() for m in weight_matrices(model))


def prune_to_target(
    model: nn.Module,
    score: str = "magnitude",
    pattern: str = "unstructured",
    remove: float | None = None,
    calibration: torch.Tensor | None = None,
    feature_norms: list[torch.Tensor] | None = None,
) -> tuple[nn.Module, dict]:
    """Prune `model`'s decoder-layer weights (a deep copy) with `compress.ops.prune_weights`.

    Unstructured: the sparsity s = remove * P / P_prunable makes the zeros a share `remove` of all P stored
    parameters (embeddings included); N:M patterns have their fixed sparsity 1 - N/M (`remove` ignored). Wanda
    (`score="wanda"`) needs `calibration` (n, T) token ids. Returns (model, report) with the dense storage, the
    non-zeros and the share of stored parameters the non-zeros remove. `feature_norms`: Wanda's input-feature norms
    from `wanda_feature_norms(model, calibration)`, to prune at several targets with one calibration pass."""
    if score not in PRUNING_SCORES:
        raise ValueError(f"unknown pruning score {score!r}; allowed: {', '.join(PRUNING_SCORES)}")
    if pattern not in PRUNING_PATTERNS:
        raise ValueError(f"unknown pruning pattern {pattern!r}; allowed: {', '.join(PRUNING_PATTERNS)}")
    before = stored_parameters(model)
    prunable = prunable_parameters(model)
    if pattern == "unstructured":
        if remove is None or not 0.0 <= remove < 1.0:
            raise ValueError(f"remove must be a share of stored parameters in [0, 1), got {remove!r}")
        sparsity = remove * before["total"] / prunable
        if sparsity > 1.0:
            raise ValueError(
                f"removing {remove:.0%} of {before['total']:,} parameters needs more than the {prunable:,} "
                "prunable decoder weights"
            )
    else:
        n, m = (int(p) for p in pattern.split(":"))
        sparsity = 1.0 - n / m
    norms = feature_norms if score == "wanda" else None
    pruned = prune_weights(model, score, pattern, sparsity, calibration_ids=calibration, feature_norms=norms)
    after = stored_parameters(pruned)
    report = {
        "method": score if pattern == "unstructured" else f"{score}-{pattern}",
        "sparsity_of_decoder_weights": sparsity,
        "stored_parameters": after["total"],
        "nonzero_parameters": after["nonzero"],
        "removed_share_nonzero": 1.0 - after["nonzero"] / before["total"],
        "removed_share_stored": 1.0 - after["total"] / before["total"],
    }
    return pruned, report


def wanda_feature_norms(model: nn.Module, calibration: torch.Tensor, batch_size: int = 2) -> list[torch.Tensor]:
    """||x_j||_2 over the calibration tokens for every input feature of every decoder weight (one forward pass),
    `compress.ops.input_feature_norms`."""
    return input_feature_norms(model, calibration, batch_size=batch_size)


# ----------------------------------------------------------------------------------------------------------------
# SliceGPT
# ----------------------------------------------------------------------------------------------------------------


class FullWidthRMSNorm(nn.Module):
    """Gain-free RMS norm over a (possibly sliced) stream that divides by the source width d:
    x / sqrt(|x|^2 / d + eps), times an optional gain vector."""

    def __init__(self, full_width: int, eps: float, gain: torch.Tensor | None = None) -> None:
        super().__init__()
        self.full_width, self.variance_epsilon = full_width, eps
        self.weight = nn.Parameter(gain.clone()) if gain is not None else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / self.full_width + self.variance_epsilon)
        h = h.to(hidden_states.dtype)
        return h if self.weight is None else self.weight * h

    def extra_repr(self) -> str:
        return f"full_width={self.full_width}, gain={self.weight is not None}, eps={self.variance_epsilon}"


class SlicedDecoderLayer(nn.Module):
    """A sliced pre-norm decoder layer: x <- x S_attn + attn(n(x)), x <- x S_mlp + mlp(n(x)), the shortcuts S
    (d' x d') changing the residual basis from block to block."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, width: int, full_width: int, eps: float) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = FullWidthRMSNorm(full_width, eps)
        self.post_attention_layernorm = FullWidthRMSNorm(full_width, eps)
        self.attn_shortcut = nn.Parameter(torch.eye(width))
        self.mlp_shortcut = nn.Parameter(torch.eye(width))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, **kwargs):
        kwargs.pop("past_key_values", None)
        attn, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = hidden_states @ self.attn_shortcut + attn
        return hidden_states @ self.mlp_shortcut + self.mlp(self.post_attention_layernorm(hidden_states))


@dataclass
class SliceGPTReport:
    """What `slicegpt` did: widths, head handling, stored parameters (shortcuts and head included), the share of
    each block's calibration variance kept, the share of each block's kept subspace that the next block's keeps
    (||S_b||_F^2 / d', 1 when consecutive bases span the same subspace), time."""

    hidden_size: int
    width: int
    head: str
    parameters_before: int
    parameters_after: int
    shortcut_parameters: int
    calibration_tokens: int
    seconds: float = 0.0
    variance_kept: list[float] = field(default_factory=list)
    shortcut_overlap: list[float] = field(default_factory=list)  # ||Q_b^T Q_{b+1}||_F^2 / d' per block

    @property
    def slicing_fraction(self) -> float:
        return 1.0 - self.width / self.hidden_size

    @property
    def removed_share(self) -> float:
        return 1.0 - self.parameters_after / self.parameters_before

    def to_dict(self) -> dict:
        return {**asdict(self), "slicing_fraction": self.slicing_fraction, "removed_share": self.removed_share}


def _decoder_parts(model: nn.Module):
    """(inner model, layers) of a Llama-style causal LM, or ValueError naming what is missing."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    needed = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    if layers is None or not all(hasattr(layers[0], n) for n in needed) or not hasattr(model, "lm_head"):
        raise ValueError(
            "SliceGPT here supports Llama-style causal LMs (model.layers[i].input_layernorm, self_attn, "
            f"post_attention_layernorm, mlp; lm_head); got {type(model).__name__}"
        )
    for layer in layers:
        if type(layer.input_layernorm).__name__.endswith("LayerNorm") and hasattr(layer.input_layernorm, "bias"):
            raise ValueError("SliceGPT here needs RMSNorm blocks (LayerNorm models need mean removal first)")
    attn = layers[0].self_attn
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise ValueError("SliceGPT here needs attention with q_proj, k_proj, v_proj, o_proj")
    mlp = layers[0].mlp
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError("SliceGPT here needs a gated MLP with gate_proj, up_proj, down_proj")
    return inner, layers


def _resolve_head(model: nn.Module, head: str) -> str:
    if head not in SLICEGPT_HEADS:
        raise ValueError(f"head must be one of {', '.join(SLICEGPT_HEADS)}, got {head!r}")
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    if head == "auto":
        return "tied" if tied else "untied"
    if head == "tied" and not tied:
        raise ValueError("head='tied' needs a model whose head is tied to its embedding")
    return head


def slicegpt_parameter_count(model: nn.Module, width: int, head: str = "auto") -> int:
    """Stored parameters of `slicegpt(model, ..., width=width, head=head)` without running it: every map reading or
    writing the stream has d' instead of d columns/rows, norms are folded (none stored), two d' x d' shortcuts per
    layer, the embedding V d', the head V d' when untied or a d' final gain when tied."""
    _, layers = _decoder_parts(model)
    head = _resolve_head(model, head)
    vocab = model.get_input_embeddings().weight.shape[0]
    total = vocab * width * (1 if head == "tied" else 2) + (width if head == "tied" else 0)
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):  # readers
            total += lin.out_features * width + (lin.bias.numel() if lin.bias is not None else 0)
        for lin in (a.o_proj, m.down_proj):  # writers
            total += lin.in_features * width + (width if lin.bias is not None else 0)
        total += 2 * width * width
    return total


def slicegpt_width_for(model: nn.Module, remove: float, head: str = "auto") -> int:
    """The largest width d' whose SliceGPT model stores at most (1 - remove) of `model`'s stored parameters
    (bisection on the count, which increases with d'). ValueError when even d' = 1 is too large."""
    if not 0.0 <= remove < 1.0:
        raise ValueError(f"remove must be a share of stored parameters in [0, 1), got {remove}")
    budget = (1.0 - remove) * stored_parameters(model)["total"]
    lo, hi = 0, model.get_input_embeddings().weight.shape[1]
    if slicegpt_parameter_count(model, 1, head) > budget:
        raise ValueError(f"SliceGPT cannot remove {remove:.0%} of the stored parameters")
    while lo < hi:  # invariant: count(lo) <= budget (or lo = 0), count(hi + 1) > budget
        mid = (lo + hi + 1) // 2
        if slicegpt_parameter_count(model, mid, head) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _top_eigenvectors(cov: torch.Tensor, width: int) -> tuple[torch.Tensor, float]:
    """The `width` leading eigenvectors (d, d') of a symmetric covariance and the share of its trace they keep."""
    evals, evecs = torch.linalg.eigh(cov)
    order = torch.argsort(evals, descending=True)
    evals, evecs = evals[order], evecs[:, order]
    total = float(evals.clamp_min(0).sum())
    return evecs[:, :width].contiguous(), float(evals[:width].clamp_min(0).sum()) / total if total > 0 else 1.0


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Linear) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device)
    dtype = like.weight.dtype
    out.weight = nn.Parameter(weight.to(dtype))
    if bias is not None:
        out.bias = nn.Parameter(bias.to(dtype))
    return out


def _normalise(x: torch.Tensor, full_width: int, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / full_width + eps)


@torch.no_grad()
def slicegpt(
    model: nn.Module,
    calibration: torch.Tensor,
    *,
    width: int | None = None,
    remove: float | None = None,
    head: str = "auto",
    batch_size: int = 4,
    progress: bool = True,
    allow_growth: bool = False,
) -> tuple[nn.Module, SliceGPTReport]:
    """SliceGPT (arXiv 2401.15024) of a Llama-style causal LM: fold the RMSNorm gains, per block PCA of the
    normalised residual inputs on `calibration` (n, T) token ids, computed block by block through the already
    sliced blocks, slice to `width` (or the widest d' storing at most 1 - `remove` of the parameters), shortcut
    matrices Q_b^T Q_{b+1} on the residual path. `head`: "untied" (as the paper), "tied" (keep a tied head tied;
    module docstring), "auto" (tied when the source's is). The source model is left unchanged; memory is one copy
    of the model plus the calibration activations. Returns (a causal LM with the usual forward and .logits,
    SliceGPTReport); raises ModelGrewError if the result stores more than the source (the shortcuts make d' = d
    larger than the source: `allow_growth=True` permits it, for checking that construction is exact)."""
    start = time.perf_counter()
    inner, layers = _decoder_parts(model)
    head = _resolve_head(model, head)
    d = model.get_input_embeddings().weight.shape[1]
    if (width is None) == (remove is None):
        raise ValueError("give exactly one of width (d') and remove (share of stored parameters)")
    if width is None:
        width = slicegpt_width_for(model, remove, head)
    if not isinstance(width, int) or not 1 <= width <= d:
        raise ValueError(f"width must be an integer in [1, {d}], got {width!r}")
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.dtype != torch.long:
        raise ValueError("calibration must be a LongTensor (n, T) of token ids")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    parameters_before = stored_parameters(model)["total"]
    eps = float(layers[0].input_layernorm.variance_epsilon)
    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    config = model.config

    # the shell of the source (config, rotary embedding) without its layers, embedding and head, which are rebuilt
    memo = {id(inner.layers): nn.ModuleList(), id(model.get_input_embeddings()): nn.Identity()}
    memo[id(model.lm_head)] = nn.Identity()
    sliced = copy.deepcopy(model, memo).eval()
    s_inner, s_layers = sliced.model, sliced.model.layers
    n, length = calibration.shape
    position_ids = torch.arange(length, device=device)[None]
    from transformers.masking_utils import create_causal_mask

    def batches():
        return range(0, n, batch_size)

    def rotary_and_mask(x: torch.Tensor):
        pos = position_ids.expand(x.shape[0], -1)
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        return s_inner.rotary_emb(x, position_ids=pos), mask

    def covariance(stream: torch.Tensor) -> torch.Tensor:
        cov = torch.zeros(d, d, dtype=torch.float64, device=device)
        for i in batches():
            flat = _normalise(stream[i : i + batch_size].double(), d, eps).reshape(-1, d)
            cov += flat.T @ flat
        return cov

    # embedding and the first basis
    emb = model.get_input_embeddings().weight.detach().double()  # (V, d)
    stream = torch.cat([emb[calibration[i : i + batch_size].to(device)] for i in batches()])  # (n, T, d)
    basis, kept = _top_eigenvectors(covariance(stream), width)  # Q_first (d, d')
    first_basis = basis
    stream = (stream @ basis).float()  # the sliced stream, (n, T, d')
    variance_kept, overlaps = [kept], []

    def sliced_block(block_fn, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a block on the sliced stream; returns the full-width residual R = y Q^T + block(n(y)) and its
        covariance."""
        out = torch.empty(n, length, d, dtype=torch.float32, device=device)
        cov = torch.zeros(d, d, dtype=torch.float64, device=device)
        back = basis.T.float()  # activations in fp32, covariance accumulated in fp64
        for i in batches():
            y = stream[i : i + batch_size]
            r = y @ back + block_fn(_normalise(y, d, eps).to(dtype)).float()
            out[i : i + batch_size] = r
            flat = _normalise(r, d, eps).reshape(-1, d)
            cov += (flat.T @ flat).double()
        return out, cov

    iterator = tqdm(range(len(layers)), desc="SliceGPT (sequential calibration)", disable=not progress, leave=False)
    for index in iterator:
        src = layers[index]
        attn = copy.deepcopy(src.self_attn).eval()
        mlp = copy.deepcopy(src.mlp).eval()
        g_in = src.input_layernorm.weight.detach().double()
        g_post = src.post_attention_layernorm.weight.detach().double()
        for name in ("q_proj", "k_proj", "v_proj"):
            lin = getattr(attn, name)
            w = lin.weight.detach().double() * g_in @ basis  # (out, d')
            setattr(attn, name, _linear(w, None if lin.bias is None else lin.bias.detach(), lin))

        def run_attention(x: torch.Tensor, attn=attn) -> torch.Tensor:
            pe, mask = rotary_and_mask(x)
            return attn(hidden_states=x, attention_mask=mask, position_embeddings=pe)[0]

        residual, cov = sliced_block(run_attention, basis)
        mid_basis, kept = _top_eigenvectors(cov, width)
        variance_kept.append(kept)
        o = attn.o_proj
        attn.o_proj = _linear(
            mid_basis.T @ o.weight.detach().double(), None if o.bias is None else mid_basis.T @ o.bias.double(), o
        )
        attn_shortcut = basis.T @ mid_basis
        overlaps.append(float(attn_shortcut.square().sum()) / width)
        stream = residual @ mid_basis.float()
        del residual
        for name in ("gate_proj", "up_proj"):
            lin = getattr(mlp, name)
            w = lin.weight.detach().double() * g_post @ mid_basis
            setattr(mlp, name, _linear(w, None if lin.bias is None else lin.bias.detach(), lin))
        residual, cov = sliced_block(mlp, mid_basis)
        basis, kept = _top_eigenvectors(cov, width)
        variance_kept.append(kept)
        down = mlp.down_proj
        mlp.down_proj = _linear(
            basis.T @ down.weight.detach().double(), None if down.bias is None else basis.T @ down.bias.double(), down
        )
        mlp_shortcut = mid_basis.T @ basis
        overlaps.append(float(mlp_shortcut.square().sum()) / width)
        stream = residual @ basis.float()
        del residual
        layer = SlicedDecoderLayer(attn, mlp, width, d, eps).to(device=device, dtype=dtype)
        layer.attn_shortcut.copy_(attn_shortcut)
        layer.mlp_shortcut.copy_(mlp_shortcut)
        s_layers.append(layer)

    g_final = inner.norm.weight.detach().double() if getattr(inner.norm, "weight", None) is not None else None
    g_final = torch.ones(d, dtype=torch.float64, device=device) if g_final is None else g_final
    new_embedding = emb @ first_basis  # (V, d')
    if head == "tied":
        # M = Q_last^T diag(g) Q_first = U diag(sigma) V^T; rotate the first basis by V and the last by U
        u, sigma, vh = torch.linalg.svd(basis.T @ (g_final[:, None] * first_basis))
        v = vh.T
        new_embedding = new_embedding @ v
        first = s_layers[0]
        for lin in (first.self_attn.q_proj, first.self_attn.k_proj, first.self_attn.v_proj):
            lin.weight.copy_(lin.weight.double() @ v)
        first.attn_shortcut.copy_(v.T @ first.attn_shortcut.double())
        last = s_layers[-1]
        last.mlp.down_proj.weight.copy_(u.T @ last.mlp.down_proj.weight.double())
        if last.mlp.down_proj.bias is not None:
            last.mlp.down_proj.bias.copy_(u.T @ last.mlp.down_proj.bias.double())
        last.mlp_shortcut.copy_(last.mlp_shortcut.double() @ u)
        s_inner.norm = FullWidthRMSNorm(d, eps, sigma.to(dtype))
    else:
        s_inner.norm = FullWidthRMSNorm(d, eps)
    s_inner.embed_tokens = nn.Embedding(new_embedding.shape[0], width, device=device, dtype=dtype)
    s_inner.embed_tokens.weight.copy_(new_embedding)
    if head == "tied":
        sliced.lm_head = nn.Linear(width, new_embedding.shape[0], bias=False, device=device, dtype=dtype)
        sliced.lm_head.weight = s_inner.embed_tokens.weight
    else:
        w_head = model.lm_head.weight.detach().double() * g_final @ basis
        bias = None if model.lm_head.bias is None else model.lm_head.bias.detach()
        sliced.lm_head = _linear(w_head, bias, model.lm_head)
        sliced.config.tie_word_embeddings = False
    sliced.config.slicegpt = {"width": width, "head": head}
    after = stored_parameters(sliced)
    if not allow_growth:
        check_not_grown(parameters_before, after["total"], f"SliceGPT at width {width}")
    report = SliceGPTReport(
        hidden_size=d,
        width=width,
        head=head,
        parameters_before=parameters_before,
        parameters_after=after["total"],
        shortcut_parameters=after["by_kind"]["other"],
        calibration_tokens=calibration.numel(),
        seconds=time.perf_counter() - start,
        variance_kept=variance_kept,
        shortcut_overlap=overlaps,
    )
    if after["total"] != slicegpt_parameter_count(model, width, head):
        logger.warning(
            "SliceGPT stored %d parameters, the closed form says %d",
            after["total"],
            slicegpt_parameter_count(model, width, head),
        )
    return sliced, report


__all__ = [
    "SLICEGPT_HEADS",
    "FullWidthRMSNorm",
    "SliceGPTReport",
    "SlicedDecoderLayer",
    "prunable_parameters",
    "prune_to_target",
    "wanda_feature_norms",
    "slicegpt",
    "slicegpt_parameter_count",
    "slicegpt_width_for",
]
