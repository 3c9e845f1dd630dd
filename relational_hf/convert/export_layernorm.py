"""Relational checkpoints converted from GPT-2 or GPT-NeoX (Pythia) -> `GPT2LMHeadModel` / `GPTNeoXForCausalLM`.

Why it is exact: a LayerNorm with unit gain and zero bias computes C x / sqrt(|C x|^2 / d + eps) (C = I - 11^T / d, the
centring projector), which on a mean-free x is the gain-free RMS norm with the same eps. The converted model keeps
every write into its residual stream mean-free (the output maps and the MLP's down map centred, the embedded input
centred in storage or by the model itself, `embedding_centring`), so the family's stream differs from the relational
one by a multiple of the all-ones vector that every LayerNorm removes: unit gains and zero biases in every layer's
LayerNorms, the final norm's gain and bias (kept by the converted model, or 1 and 0) in the final LayerNorm. The
QK and VO forms are multiplied back out into per-head q/k/v/o with their biases (`full_weights`), GPT-2's into the
fused Conv1D `c_attn` (rows [q | k | v], stored (in, out)), GPT-NeoX's into `query_key_value` laid out per head
([q_h | k_h | v_h]); learned positions go to GPT-2's `wpe`; GPT-NeoX keeps its partial rotary and parallel or
sequential residual; the head stays tied (GPT-2) or untied (GPT-NeoX) as the checkpoint has it.

Per-layer widths of a compressed model are padded with zeros where that is exact, as for `--to llama`: a QK width
r_l < d_h becomes zero query/key coordinates (without rotary positions any r_l coordinates; with full rotary each kept
pair at its own frequency's place) with W_Q, b_Q scaled by sqrt(d_h / r_l) to turn the family's 1 / sqrt(d_h) into
the relational 1 / sqrt(r_l); a value width r_v < d_h zero rows of W_V and columns of W_O; MLP units up to the widest
layer, zero rows of W_up and b_up and zero columns of W_down (they write nothing whatever act(0) is). The exported
checkpoint then stores the zeros (about the dense size). Refused in one line naming the config field: what the class
has no place for (a SwiGLU MLP, QK-norm, grouped key/value heads, a head width other than d / H, rotary positions in
GPT-2 or none in GPT-NeoX, GPT-2 with the parallel residual, a QK rank below the head width with partial rotary) and
writes that are not mean-free (a converted model fine-tuned afterwards: a LayerNorm would remove what its RMS norm
reads).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.initialization import no_init_weights

from ..modeling import RelationalForCausalLM

#: family name -> (config class, model class)
LAYERNORM_TARGETS = {"gpt2": (GPT2Config, GPT2LMHeadModel), "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM)}
#: largest |mean| of a write into the stream, relative to its largest entry, taken as mean-free (float32 rounding)
MEAN_FREE_TOLERANCE = 1e-5


def _refuse(target: str, reason: str):
    from .export import ExportError

    return ExportError(f"--to {target}: {reason}")


def _check(model: nn.Module, target: str) -> None:
    """`ExportError` in one line naming the config field the `target` class has no place for."""
    if not isinstance(model, RelationalForCausalLM):
        raise _refuse(target, f"export takes a relational causal LM, got {type(model).__name__}")
    c = model.config
    name = {"gpt2": "GPT-2", "gpt_neox": "GPT-NeoX"}[target]
    fields = [
        ("value_parallel_removal=True", c.value_parallel_removal, "a nonlinear per-head edit"),
        ("mlp_gated=True", c.mlp_gated, f"a SwiGLU MLP; {name}'s MLP is act(x W_up + b_up) W_down + b_down"),
        ("qk_norm=True", c.qk_norm, "a per-head QK-norm"),
        (
            f"num_key_value_heads={c.num_key_value_heads}",
            c.num_key_value_heads != c.num_attention_heads,
            f"grouped key/value heads; {name} has one key/value head per query head",
        ),
        (
            f"head_dim={c.head_dim}",
            c.head_dim * c.num_attention_heads != c.hidden_size,
            f"a head width other than hidden_size / num_attention_heads = {c.hidden_size / c.num_attention_heads:g}",
        ),
    ]
    if target == "gpt2":
        fields += [
            (
                f"position_encoding={c.position_encoding!r}",
                c.position_encoding != "learned",
                "GPT-2 has learned absolute positions",
            ),
            ("parallel_residual=True", c.parallel_residual, "GPT-2 runs attention and MLP in sequence; use --to gpt_neox"),
        ]
    else:
        fields += [
            (f"position_encoding={c.position_encoding!r}", c.position_encoding != "rope", "GPT-NeoX has rotary positions"),
            (
                "rope_layers (layers without rotary)",
                c.rope_layers is not None and not all(c.rope_layers),
                "GPT-NeoX rotates in every layer",
            ),
            (f"qk_rank={c.qk_rank}", c.qk_rank != c.head_dim, f"a QK rank below the head width {c.head_dim}"),
        ]
    for field, present, why in fields:
        if present:
            raise _refuse(target, f"{field} has no equivalent in {name}'s class ({why})")
    with torch.device("meta"), no_init_weights():
        reference = RelationalForCausalLM(copy.deepcopy(c))
    extra = sorted(set(model.state_dict()) - set(reference.state_dict()))
    if extra:
        raise _refuse(target, f"the model holds tensors a {name} model has no place for: {extra[:3]}")
    _check_mean_free(model, target)


@torch.no_grad()
def _check_mean_free(model: RelationalForCausalLM, target: str) -> None:
    """Every write into the stream mean-free (what makes a LayerNorm the relational RMS norm), else one line naming it."""

    def off(name: str, w: torch.Tensor | None, dim: int) -> str | None:
        if w is None:
            return None
        w = w.detach().double()
        scale = max(float(w.abs().max()), 1e-30)
        return name if float(w.mean(dim).abs().max()) > MEAN_FREE_TOLERANCE * scale else None

    c = model.config
    found = []
    if not c.embedding_centring:  # stored centred, or nothing centres the input
        found.append(off("embed_tokens", model.model.embed_tokens.weight, -1))
        if model.model.embed_positions is not None:
            found.append(off("embed_positions", model.model.embed_positions.weight, -1))
    for i, layer in enumerate(model.model.layers):
        for name, lin in (("self_attn.o_proj", layer.self_attn.o_proj), ("mlp.down_proj", layer.mlp.down_proj)):
            found += [off(f"layers.{i}.{name}.weight", lin.weight, 0), off(f"layers.{i}.{name}.bias", lin.bias, 0)]
    found = [f for f in found if f is not None]
    if found:
        raise _refuse(
            target,
            f"{found[0]} writes into the residual stream with a non-zero mean (fine-tuned after conversion?): a "
            "LayerNorm removes the mean its gain-free RMS norm reads, so no exact form exists",
        )


def _widths(model: RelationalForCausalLM) -> int:
    return max(layer.mlp.up_proj.out_features for layer in model.model.layers)


def layernorm_family_config(model: RelationalForCausalLM, target: str):
    """The GPT2Config / GPTNeoXConfig that holds the relational `model` (dropouts off but attention's, as its own)."""
    c = model.config
    tokens = dict(pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    if target == "gpt2":
        return GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size,
            n_layer=c.num_hidden_layers, n_head=c.num_attention_heads, n_inner=_widths(model),
            activation_function=c.hidden_act, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=c.attention_dropout,
            layer_norm_epsilon=c.rms_norm_eps, initializer_range=c.initializer_range,
            tie_word_embeddings=c.tie_word_embeddings, **tokens,
        )  # fmt: skip
    rope = copy.deepcopy(dict(c.rope_parameters))
    rope.setdefault("partial_rotary_factor", 1.0)  # GPTNeoXConfig's own default is 0.25
    return GPTNeoXConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=_widths(model), hidden_act=c.hidden_act,
        rope_parameters=rope, max_position_embeddings=c.max_position_embeddings, layer_norm_eps=c.rms_norm_eps,
        use_parallel_residual=c.parallel_residual, attention_bias=True, hidden_dropout=0.0,
        attention_dropout=c.attention_dropout, initializer_range=c.initializer_range,
        tie_word_embeddings=c.tie_word_embeddings, **tokens,
    )  # fmt: skip


@torch.no_grad()
def _padded_attention(attn: nn.Module, width: int) -> tuple[dict[str, torch.Tensor], int]:
    """The layer's q/k/v/o and biases (float64, Linear layout) in heads of `width` (zeros where the relational layer is
    narrower; module docstring), and the zeros added."""
    from .export import _layer_qk_coordinates, _pad_heads

    w = attn.full_weights()
    h, r, rv = attn.num_heads, attn.qk_rank, attn.head_dim
    d = w["q"].shape[1]
    if attn.rope:  # each kept rotary pair at its frequency's place (pair p: coordinates p, p + width / 2)
        qk = _layer_qk_coordinates(attn, attn.config.qk_rank, width)
    else:
        qk = torch.arange(r).expand(h, -1)
    vo, scale = torch.arange(rv), math.sqrt(width / r)
    zero = torch.zeros(h * r, dtype=torch.float64)
    out = {
        "q": _pad_heads(w["q"], h, width, qk, scale),
        "k": _pad_heads(w["k"], h, width, qk),
        "v": _pad_heads(w["v"], h, width, vo),
        "o": _pad_heads(w["o"].double().T, h, width, vo).T,
        "q_bias": _pad_heads(w.get("q_bias", zero), h, width, qk, scale),
        "k_bias": _pad_heads(w.get("k_bias", zero), h, width, qk),
        "v_bias": _pad_heads(w.get("v_bias", torch.zeros(h * rv, dtype=torch.float64)), h, width, vo),
        "o_bias": w["o_bias"].double() if "o_bias" in w else torch.zeros(d, dtype=torch.float64),
    }
    return out, 2 * h * (width - r) * (d + 1) + h * (width - rv) * (2 * d + 1)


@torch.no_grad()
def _padded_mlp(mlp: nn.Module, units: int) -> tuple[dict[str, torch.Tensor], int]:
    m = mlp.full_weights()
    f, d = m["up"].shape
    up = torch.zeros(units, d, dtype=torch.float64)
    up[:f] = m["up"].double()
    down = torch.zeros(d, units, dtype=torch.float64)
    down[:, :f] = m["down"].double()
    up_bias = torch.zeros(units, dtype=torch.float64)
    if "up_bias" in m:
        up_bias[:f] = m["up_bias"].double()
    down_bias = m["down_bias"].double() if "down_bias" in m else torch.zeros(d, dtype=torch.float64)
    return {"up": up, "up_bias": up_bias, "down": down, "down_bias": down_bias}, (units - f) * (2 * d + 1)


@torch.no_grad()
def _copy_layer(src: nn.Module, dst: nn.Module, target: str, width: int, units: int) -> int:
    a, zeros = _padded_attention(src.self_attn, width)
    m, more = _padded_mlp(src.mlp, units)
    if target == "gpt2":
        dst.attn.c_attn.weight.copy_(torch.cat([a["q"], a["k"], a["v"]]).T)
        dst.attn.c_attn.bias.copy_(torch.cat([a["q_bias"], a["k_bias"], a["v_bias"]]))
        dst.attn.c_proj.weight.copy_(a["o"].T)
        dst.attn.c_proj.bias.copy_(a["o_bias"])
        dst.mlp.c_fc.weight.copy_(m["up"].T)
        dst.mlp.c_fc.bias.copy_(m["up_bias"])
        dst.mlp.c_proj.weight.copy_(m["down"].T)
        dst.mlp.c_proj.bias.copy_(m["down_bias"])
        norms = (dst.ln_1, dst.ln_2)
    else:
        h = src.self_attn.num_heads
        attn = dst.attention
        fused = torch.stack([a[k].view(h, width, -1) for k in ("q", "k", "v")], 1)  # (H, 3, width, d): per head
        attn.query_key_value.weight.copy_(fused.reshape(3 * h * width, -1))
        biases = torch.stack([a[f"{k}_bias"].view(h, width) for k in ("q", "k", "v")], 1)
        attn.query_key_value.bias.copy_(biases.reshape(-1))
        attn.dense.weight.copy_(a["o"])
        attn.dense.bias.copy_(a["o_bias"])
        dst.mlp.dense_h_to_4h.weight.copy_(m["up"])
        dst.mlp.dense_h_to_4h.bias.copy_(m["up_bias"])
        dst.mlp.dense_4h_to_h.weight.copy_(m["down"])
        dst.mlp.dense_4h_to_h.bias.copy_(m["down_bias"])
        norms = (dst.input_layernorm, dst.post_attention_layernorm)
    for norm in norms:  # unit gain, zero bias: the gain-free RMS norm on the mean-free stream
        norm.weight.fill_(1.0)
        norm.bias.zero_()
    return zeros + more


def to_layernorm_family(model: nn.Module, target: str, *, tolerance: float = 1e-4, verify_length: int = 16):
    """(GPT2LMHeadModel or GPTNeoXForCausalLM with the function of the relational `model`, ExportReport): module
    docstring; `ExportError` in one line for what the class cannot hold or a failed logit check (fp32, float64 where
    rounding misses it)."""
    from .export import ExportError, copy_head, verified_family_report

    if target not in LAYERNORM_TARGETS:
        raise ExportError(f"--to must be one of {tuple(LAYERNORM_TARGETS)} here, got {target!r}")
    _check(model, target)
    c = model.config
    source = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    was_training = source.training
    source.eval()
    with no_init_weights():
        exported = LAYERNORM_TARGETS[target][1](layernorm_family_config(source, target))
    exported = exported.float().eval().to(next(source.parameters()).device)
    body = exported.transformer if target == "gpt2" else exported.gpt_neox
    layers = body.h if target == "gpt2" else body.layers
    units = exported.config.n_inner if target == "gpt2" else exported.config.intermediate_size
    zeros = sum(_copy_layer(s, t, target, c.head_dim, units) for s, t in zip(source.model.layers, layers, strict=True))
    with torch.no_grad():
        (body.wte if target == "gpt2" else body.embed_in).weight.copy_(source.model.embed_tokens.weight)
        if target == "gpt2":
            body.wpe.weight.copy_(source.model.embed_positions.weight)
        final, norm = (body.ln_f if target == "gpt2" else body.final_layer_norm), source.model.norm
        final.weight.copy_(norm.weight if norm.weight is not None else torch.ones_like(final.weight))
        final.bias.copy_(norm.bias if norm.bias is not None else torch.zeros_like(final.bias))
        copy_head(source, exported)
    notes = []
    if zeros:
        notes.append(f"per-layer widths (a compressed model) padded with zeros to {target}'s uniform widths: {zeros:,}")
    try:
        report = verified_family_report(
            model, source, exported, target, tolerance=tolerance, verify_length=verify_length, padding_zeros=zeros,
            notes=notes,
        )
    finally:
        source.train(was_training)
    return exported, report


__all__ = ["LAYERNORM_TARGETS", "layernorm_family_config", "to_layernorm_family"]
