"""Relational checkpoints -> Gemma 3 (text): Transformers' `Gemma3ForCausalLM` (model_type `gemma3_text`).

A converted Gemma 3 (`convert.gemma`) holds every part of Gemma's forward pass as a relational option; the export
writes each back, exactly:

- norms: Gemma's norms multiply by 1 + w, computed in fp32. The gain-free pre-norms (their gains folded into q/k/v and
  gate/up at conversion) export as w = 0 (unit); every stored gain g (the sandwich norms', the QK-norms', the final
  one in front of a tied head) as w = g - 1; a final gain folded into an untied head as w = 0;
- the attention scale: the relational scale is head_dim^-1/2 (Gemma's query_pre_attn_scalar^-1/2 was carried into
  the query-norm gain at conversion), so the export writes query_pre_attn_scalar = head_dim and the query gain as it
  is stored: the same scores, re-expressed rather than undone (the source's scalar is not recorded);
- the embedding scale: Gemma multiplies the embedded input by sqrt(hidden_size) in the embedding's dtype, as
  `embedding_scale` does; another scale has no Gemma form;
- the sliding-window layers: `layer_types`, `sliding_window`, and the rotary tables of both kinds of layer
  (`rope_parameters` by layer type; without sliding layers both entries are the model's one table);
- per-layer widths of a compressed model: a VO rank r_v below the head width becomes zero rows of W_V (and of its
  bias) and zero columns of W_O, an MLP narrower than the widest layer zero rows of W_gate and W_up and zero columns
  of W_down (gelu(0) * 0 = 0): exact, at the widest layer's size. A QK rank below the head width cannot be padded
  behind the per-head QK-norm (the norm runs over the whole head) and is refused, as is everything else Gemma 3
  does not compute, in one line naming the field.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from transformers.initialization import no_init_weights

from ..modeling import RelationalForCausalLM

TARGET = "gemma3"


def _refuse(reason: str) -> ValueError:
    from .export import ExportError

    return ExportError(f"--to {TARGET}: {reason}")


def _check_gemma(model: nn.Module) -> None:
    """`ExportError` in one line naming the first field of `model` that Gemma3ForCausalLM does not hold."""
    if not isinstance(model, RelationalForCausalLM):
        raise _refuse(f"export takes a relational causal LM, got {type(model).__name__}")
    c = model.config
    d = c.hidden_size
    scale = c.embedding_scale
    needed = {  # field: (held, why)
        "qk_norm=False": (c.qk_norm, "Gemma 3 normalises every query and key head"),
        "sandwich_norms=False": (c.sandwich_norms, "Gemma 3 normalises both sublayers' outputs"),
        f"embedding_scale={scale!r}": (
            scale is not None and math.isclose(scale, d**0.5, rel_tol=1e-9),
            f"Gemma 3 scales the embedded input by sqrt(hidden_size) = {d**0.5:g}",
        ),
        "mlp_gated=False": (c.mlp_gated, "Gemma 3's MLP is gated"),
        "mlp_bias=True": (not c.mlp_bias, "Gemma 3's MLP has no biases"),
        "parallel_residual=True": (not c.parallel_residual, "Gemma 3's sublayers are sequential"),
        f"position_encoding={c.position_encoding!r}": (c.position_encoding == "rope", "Gemma 3 has rotary positions"),
        "embedding_centring=True": (not c.embedding_centring, "Gemma 3 does not centre its input"),
        "final_norm_bias=True": (not c.final_norm_bias, "Gemma 3's final norm has no bias"),
        "value_parallel_removal=True": (not c.value_parallel_removal, "no equivalent there"),
        "rope_layers": (c.rope_layers is None or all(c.rope_layers), "every Gemma 3 layer has rotary positions"),
        "partial rotary (partial_rotary_factor < 1)": (
            not 0 < c.rotary_dim < c.qk_rank,
            "Gemma 3 turns the whole head",
        ),
        f"attention_bias={c.attention_bias}, attention_output_bias={c.attention_output_bias}": (
            c.attention_bias == c.attention_output_bias,
            "Gemma 3's attention_bias puts biases on q, k, v and o together",
        ),
    }
    for field, (held, why) in needed.items():
        if not held:
            raise _refuse(f"{field} has no equivalent there ({why})")
    ranks = [c.layer_qk_rank(i) for i in range(c.num_hidden_layers)]
    if c.qk_rank != c.head_dim or any(r != c.head_dim for r in ranks):
        field = "layer_qk_ranks" if c.layer_qk_ranks is not None else "qk_rank"
        raise _refuse(f"{field} below the head width {c.head_dim} does not fit (the QK-norm runs over the whole head)")
    for i, layer in enumerate(model.model.layers):
        pairs = getattr(layer.self_attn, "rope_pair_index", None)
        if pairs is not None and not torch.equal(pairs.cpu(), torch.arange(pairs.shape[1]).expand_as(pairs.cpu())):
            raise _refuse(f"layer {i}'s rope_pair_index (rotary pairs reordered) has no equivalent there")


def gemma3_config(config) -> Gemma3TextConfig:
    """The Gemma3TextConfig of the relational `config` (uniform head width; `intermediate_size` the widest layer's)."""
    layers = range(config.num_hidden_layers)
    types = list(config.layer_types) if config.layer_types is not None else ["full_attention"] * len(layers)
    full = copy.deepcopy(dict(config.rope_parameters))
    local = copy.deepcopy(dict(config.sliding_rope_parameters or config.rope_parameters))
    return Gemma3TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=max(config.layer_intermediate_size(i) for i in layers),
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_activation=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters={"full_attention": full, "sliding_attention": local},
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
        query_pre_attn_scalar=config.head_dim,  # the relational scale head_dim^-1/2 (module docstring)
        sliding_window=config.sliding_window if config.sliding_window is not None else config.max_position_embeddings,
        layer_types=types,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    )


def _offset(norm: nn.Module, gain: torch.Tensor | None) -> None:
    """Write Gemma's w = g - 1 into `norm` (gain g; None: a unit gain, w = 0)."""
    if gain is None:
        norm.weight.zero_()
    else:
        norm.weight.copy_(gain.detach().double() - 1.0)


@torch.no_grad()
def _copy_layers(source: RelationalForCausalLM, target: Gemma3ForCausalLM) -> int:
    """Every layer's maps and gains into `target`, narrower VO and MLP widths padded with zeros; the zeros added."""
    from .export import _pad_heads

    c = source.config
    h, h_kv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    zeros = 0
    for src, dst in zip(source.model.layers, target.model.layers, strict=True):
        w, m = src.self_attn.full_weights(), src.mlp.full_weights()
        attn, mlp = dst.self_attn, dst.mlp
        rv = src.self_attn.head_dim  # the layer's VO rank
        kept = torch.arange(rv)
        attn.q_proj.weight.copy_(w["q"])
        attn.k_proj.weight.copy_(w["k"])
        attn.v_proj.weight.copy_(_pad_heads(w["v"], h_kv, dh, kept))
        attn.o_proj.weight.copy_(_pad_heads(w["o"].double().T, h, dh, kept).T)
        for key, proj, padded in (("q", attn.q_proj, False), ("k", attn.k_proj, False), ("v", attn.v_proj, True)):
            if proj.bias is not None:
                bias = w.get(f"{key}_bias")
                if bias is None:
                    proj.bias.zero_()
                else:
                    proj.bias.copy_(_pad_heads(bias, h_kv, dh, kept) if padded else bias)
        if attn.o_proj.bias is not None:
            attn.o_proj.bias.copy_(w["o_bias"] if w.get("o_bias") is not None else torch.zeros_like(attn.o_proj.bias))
        f = m["gate"].shape[0]
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.weight.zero_()
        mlp.gate_proj.weight[:f].copy_(m["gate"])
        mlp.up_proj.weight[:f].copy_(m["up"])
        mlp.down_proj.weight[:, :f].copy_(m["down"])
        zeros += 3 * c.hidden_size * (mlp.gate_proj.weight.shape[0] - f) + 2 * c.hidden_size * (h_kv + h) * (dh - rv)
        _offset(attn.q_norm, w["q_norm"])
        _offset(attn.k_norm, w["k_norm"])
        _offset(dst.input_layernorm, None)
        _offset(dst.pre_feedforward_layernorm, None)
        _offset(dst.post_attention_layernorm, src.attention_output_norm.weight)
        _offset(dst.post_feedforward_layernorm, src.mlp_output_norm.weight)
    return zeros


def to_gemma3(model: nn.Module, *, tolerance: float = 1e-4, verify_length: int = 16):
    """(Gemma3ForCausalLM with the same function as the relational `model`, ExportReport); `ExportError` in one line
    for a model Gemma 3 does not hold (`_check_gemma`) or that fails the logit check (fp32, float64 where rounding
    misses it)."""
    from .export import copy_head, verified_family_report

    _check_gemma(model)
    c = model.config
    source = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    was_training = source.training
    source.eval()
    with no_init_weights():
        exported = Gemma3ForCausalLM(gemma3_config(c))
    exported = exported.float().eval().to(next(source.parameters()).device)
    with torch.no_grad():
        zeros = _copy_layers(source, exported)
        exported.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
        _offset(exported.model.norm, source.model.norm.weight)  # None: folded into an untied head
        copy_head(source, exported)
    notes = ["query_pre_attn_scalar = head_dim: the attention scale the relational model computes (the query gain "
             "carries the source's scalar)"]  # fmt: skip
    if zeros:
        notes.append(
            f"per-layer widths (a compressed model): narrower VO ranks and MLPs padded with zeros to the head width "
            f"and d_ff {exported.config.intermediate_size}; the checkpoint stores {zeros:,} zeros more"
        )
    try:
        report = verified_family_report(
            model, source, exported, TARGET, tolerance=tolerance, verify_length=verify_length, padding_zeros=zeros,
            notes=notes,
        )  # fmt: skip
    finally:
        source.train(was_training)
    return exported, report


__all__ = ["gemma3_config", "to_gemma3"]
