"""Exact conversion of LayerNorm families (GPT-2, GPT-NeoX / Pythia) into the relational architecture.

LayerNorm(x) = g * C x / sqrt(|C x|^2 / d + eps) + beta, with the centring projector C = I - 11^T / d. When every write
into the residual stream is mean-free, C x = x and LayerNorm is the gain-free RMS norm (the same eps) followed by the
gain and the bias (SliceGPT, arXiv:2401.15024). So, per layer (nn.Linear layout, W: out x in):

- readers of a LayerNorm: W -> W diag(g), b -> b + W beta (q, k, v behind the first norm; the MLP's up map behind the
  second);
- writers into the stream: W_O -> C W_O, b_O -> C b_O, and the same for the MLP's down map (each column of the
  Linear-layout weight centred);
- the embedded input: centred in storage when the head is untied; with a head tied to the embedding (GPT-2), the
  embedding also makes the logits and cannot be centred, so the relational model centres the embedded input itself
  (`RelationalConfig.embedding_centring`, parameter-free) and keeps the position table as it is;
- the final LayerNorm: (g n + beta) W_head^T. With a tied head it keeps its gain and its bias in front of the head
  (`final_norm_gain`, `final_norm_bias`): neither folds into a matrix that is also the embedding, and the bias's
  effect on the logits, beta W_head^T, is not a constant shift. With an untied head the gain folds into the head
  (W_head diag(g)) and the bias becomes beta / g, still added after the norm: (n + beta / g) diag(g) W_head^T is the
  same map (a zero final gain is refused).

GPT-2's attention scale (1 / sqrt(d_h), none with `scale_attn_weights=False`, divided by layer + 1 with
`scale_attn_by_inverse_layer_idx`) becomes a factor on W_Q and b_Q (the relational scale is 1 / sqrt(d_h));
`reorder_and_upcast_attn` computes the same function (it changes only the order and precision of the eager kernel's
products). The QK and VO pairs then go to the pivot gauge as for Llama (a block pivot per head: no rotary positions);
the plain GELU MLP has no gauge. Refused, in one line naming the feature: cross-attention layers and activations the
relational MLP does not have.

GPT-NeoX adds the parallel residual (x + attn(ln1 x) + mlp(ln2 x), `RelationalConfig.parallel_residual`; both
sublayers' writes are centred, so each norm still reads a mean-free stream) and partial rotary (`rotary_pct`: the
first rot_dim coordinates of each head turn, in Llama's rotate-half layout; `rope_parameters["partial_rotary_factor"]`).
Partial rotary leaves GL on each head's non-rotated block, a group the relational pivot layout does not fix: the QK
pair is stored as it is (free, as Qwen3's QK-norm is) and its gauge is reported as left; VO goes to the pivot gauge.
The head is untied, so the token embedding is stored centred. Refused: attention without biases, rope types other
than the default with partial rotary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..architectures import UnsupportedModelError, get_adapter
from ..modeling import RelationalConfig

#: adapter families that convert through this module
LAYERNORM_FAMILIES = ("gpt2", "gpt_neox")
#: activations the relational MLP computes (GPT-2's `activation_function` names)
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu")
#: the source's groups that folding the LayerNorms removes (no LayerNorm is left to have them)
FOLDED_GROUPS = (
    "norm_gain",
    "layernorm_bias_shift",
    "reader_centring_translation",
    "centring_bias_exchange",
    "centring_translation",
)
#: the conversion report's note on a LayerNorm family
LAYERNORM_NOTE = (
    "LayerNorms folded: every write into the residual stream made mean-free, so each LayerNorm is a gain-free RMS "
    "norm whose gain and bias fold into its readers; the final norm keeps its gain and bias (counted as the kept final "
    "norm parameters), the position table is kept, and with a tied head the embedded input is centred by the model "
    "(embedding_centring)"
)
#: the per-layer tensors of a LayerNorm family that belong to the MLP half (`relational.convert_layer` splits by these)
MLP_ROLES = ("up_bias", "down_bias", "mlp_norm_bias")


def unexported_option(config, target: str | None = None) -> str | None:
    """The first option of a converted LayerNorm model (or of partial rotary) that the Llama-like export targets
    (Llama, Qwen3, SmolLM3, Phi-3) do not hold, as one line naming it and the target that does, or None. `target`
    "phi3": partial rotary is held (Phi-3 has `partial_rotary_factor`). A converted Gemma 3: `unexported_gemma_option`."""
    from .gemma import unexported_gemma_option

    if unexported_gemma_option(config) is not None:
        return unexported_gemma_option(config)
    options = {
        "mlp_gated=False": not config.mlp_gated,
        "parallel_residual=True": config.parallel_residual,
        "position_encoding='learned'": config.position_encoding == "learned",
        "embedding_centring=True": config.embedding_centring,
        "final_norm_bias=True": config.final_norm_bias,
        "partial rotary (partial_rotary_factor < 1)": 0 < config.rotary_dim < config.qk_rank and target != "phi3",
    }
    found = [name for name, present in options.items() if present]
    if not found:
        return None
    if found == ["partial rotary (partial_rotary_factor < 1)"]:
        return f"{found[0]} has no equivalent there: export --to phi3 or --to gpt_neox holds it"
    return (
        f"{found[0]} (a converted GPT-2 / GPT-NeoX model) has no equivalent there: export --to gpt2 or --to gpt_neox "
        "holds the plain MLP, learned positions, input centring, final norm bias, partial rotary and parallel residual"
    )


def is_layernorm_family(model: nn.Module) -> bool:
    return get_adapter(model).family in LAYERNORM_FAMILIES


def check_layernorm_convertible(model: nn.Module) -> None:
    """`UnsupportedModelError` in one line naming the feature the relational architecture does not hold."""
    config, name = model.config, type(model).__name__
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(f"unsupported: {name} (cross-attention layers, add_cross_attention=True)")
    act = activation(config)
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported: {name} (activation {act!r}; the relational MLP has {ACTIVATIONS})")
    if get_adapter(model).output_head() is None:
        raise UnsupportedModelError(f"unsupported: {name} (no LM head: convert takes causal LMs)")
    adapter = get_adapter(model)
    gain = adapter.final_norm().weight
    if not adapter.head_tied() and gain.device.type != "meta" and bool((gain == 0).any()):
        raise UnsupportedModelError(f"unsupported: {name} (a zero final LayerNorm gain in front of an untied head)")
    if adapter.family == "gpt_neox":
        if not config.attention_bias:
            raise UnsupportedModelError(f"unsupported: {name} (attention without biases, attention_bias=False)")
        rope = config.rope_parameters
        if rope.get("partial_rotary_factor", 1.0) != 1.0 and rope.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"unsupported: {name} (rope type {rope['rope_type']!r} with partial rotary)")


def activation(config) -> str | None:
    """The MLP activation's name: GPT-2's `activation_function`, GPT-NeoX's `hidden_act`."""
    return getattr(config, "activation_function", None) or getattr(config, "hidden_act", None)


def query_scale(model: nn.Module, index: int) -> float:
    """The factor on W_Q and b_Q that turns the relational scale 1 / sqrt(d_h) into the source's attention scale."""
    config = model.config
    d_h = get_adapter(model).head_dim()
    scale = d_h**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(index + 1)
    return scale * math.sqrt(d_h)


def layernorm_config(model: nn.Module, *, tie: bool, pivot_scale: float | None = None) -> RelationalConfig:
    """The RelationalConfig (pivot gauge, learned positions, plain MLP with biases, biases on q/k/v/o, final norm
    with gain and bias, input centring with a tied head) that holds the LayerNorm `model` exactly."""
    adapter = get_adapter(model)
    c = model.config
    vocab, d = c.vocab_size, c.hidden_size

    def token(value):
        values = value if isinstance(value, list) else [value]
        return value if all(v is None or 0 <= v < vocab for v in values) else None

    if adapter.family == "gpt2":
        family = dict(
            intermediate_size=c.n_inner if c.n_inner is not None else 4 * d,
            position_encoding="learned",
            rms_norm_eps=c.layer_norm_epsilon,
        )
    else:  # GPT-NeoX: rotary (partial: `rope_parameters["partial_rotary_factor"]`), parallel or sequential residual
        family = dict(
            intermediate_size=c.intermediate_size,
            position_encoding="rope",
            rope_parameters=dict(c.rope_parameters),
            parallel_residual=bool(c.use_parallel_residual),
            rms_norm_eps=c.layer_norm_eps,
        )
    return RelationalConfig(
        **family,
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=adapter.num_heads(),
        num_key_value_heads=adapter.num_kv_heads(),
        head_dim=adapter.head_dim(),
        qk_rank=adapter.head_dim(),
        max_position_embeddings=c.max_position_embeddings,
        gauge="pivot",
        pivot_scale=pivot_scale,
        attention_bias=True,
        attention_output_bias=True,
        hidden_act=activation(c),
        mlp_gated=False,
        mlp_bias=True,
        tie_word_embeddings=tie,
        final_norm_gain=tie,
        final_norm_bias=True,
        embedding_centring=tie,
        initializer_range=getattr(c, "initializer_range", 0.02),
        pad_token_id=token(getattr(c, "pad_token_id", None)),
        bos_token_id=token(getattr(c, "bos_token_id", None)),
        eos_token_id=token(getattr(c, "eos_token_id", None)),
    )


def layernorm_layer_tensors(model: nn.Module, layer) -> dict[str, torch.Tensor | None]:
    """The tensors of `layer` by role (Linear layout, detached, no copy): q/k/v/o and their biases, the two
    LayerNorms' gains and biases, up/down and their biases, and the query factor (`query_scale`)."""
    adapter = get_adapter(model)
    w = adapter.attention_weights(layer)
    mlp = adapter.mlp_slots(layer)
    return {
        **w.roles(),
        "attention_gain": layer.attention_norm.weight.detach(),
        "attention_norm_bias": layer.attention_norm.bias.detach(),
        "query_scale": torch.tensor(query_scale(model, layer.index), dtype=torch.float64),
        "up": mlp.up.get(),
        "up_bias": mlp.up_bias.get(),
        "down": mlp.down.get(),
        "down_bias": mlp.down_bias.get(),
        "mlp_gain": layer.mlp_norm.weight.detach(),
        "mlp_norm_bias": layer.mlp_norm.bias.detach(),
    }


def _read(weight: torch.Tensor, bias: torch.Tensor | None, gain: torch.Tensor, shift: torch.Tensor):
    """A reader of g * n + beta: (W diag(g), b + W beta) in float64, returned in fp32."""
    w = weight.double()
    b = w @ shift.double() + (0 if bias is None else bias.double())
    return (w * gain.double()).float(), b.float()


def _centre(weight: torch.Tensor, bias: torch.Tensor | None):
    """A writer made mean-free: (C W, C b) (W: d x in, each column centred), in float64, returned in fp32."""
    w = weight.double()
    out = (w - w.mean(0, keepdim=True)).float()
    if bias is None:
        return out, None
    b = bias.double()
    return out, (b - b.mean()).float()


@torch.no_grad()
def fold_layernorm_layer(tensors: dict[str, torch.Tensor | None]) -> tuple[dict, dict]:
    """One layer of a LayerNorm family in relational form: (attention, mlp) full weights for
    `RelationalAttention.set_full_weights` / `RelationalPlainMLP.set_full_weights` (module docstring); a half whose
    tensors are not in `tensors` comes back empty."""
    attention, mlp = {}, {}
    if "q" in tensors:
        g, beta = tensors["attention_gain"], tensors["attention_norm_bias"]
        for key in ("q", "k", "v"):
            attention[key], attention[f"{key}_bias"] = _read(tensors[key], tensors.get(f"{key}_bias"), g, beta)
        s = float(tensors["query_scale"])
        attention["q"], attention["q_bias"] = attention["q"] * s, attention["q_bias"] * s
        attention["o"], attention["o_bias"] = _centre(tensors["o"], tensors.get("o_bias"))
    if "up" in tensors:
        g, beta = tensors["mlp_gain"], tensors["mlp_norm_bias"]
        mlp["up"], mlp["up_bias"] = _read(tensors["up"], tensors.get("up_bias"), g, beta)
        mlp["down"], mlp["down_bias"] = _centre(tensors["down"], tensors.get("down_bias"))
    return attention, mlp


def centred_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of an embedding made mean-free (float64 arithmetic), in `dtype`."""
    r = rows.double()
    return (r - r.mean(-1, keepdim=True)).to(dtype)


@torch.no_grad()
def load_layernorm_ends(source: nn.Module, target: nn.Module) -> None:
    """Embeddings, final norm and head of the in-memory conversion (module docstring)."""
    src = get_adapter(source)
    tie = target.config.tie_word_embeddings
    emb = src.embedding().weight.detach()
    target.model.embed_tokens.weight.copy_(emb.float() if tie else centred_rows(emb))
    positions = src.embedding_slots()[1:]
    if positions:
        table = positions[0].get()
        target.model.embed_positions.weight.copy_(table.float() if tie else centred_rows(table))
    final = src.final_norm()
    gain, bias = final.weight.detach(), final.bias.detach()
    if tie:
        target.model.norm.weight.copy_(gain.float())
        target.model.norm.bias.copy_(bias.float())
    else:
        target.model.norm.bias.copy_(untied_final_bias(gain, bias))
        target.lm_head.weight.copy_((src.output_head().weight.detach().double() * gain.double()).float())


def untied_final_bias(gain: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """beta / g (float64, returned in fp32): the final bias in front of a head with the final gain folded in."""
    return (bias.double() / gain.double()).float()


def remaining_after_folding(model: nn.Module, remaining: dict[str, int]) -> dict[str, int]:
    """The source's groups left on the converted model: the LayerNorm groups are folded away (`FOLDED_GROUPS`), and
    for a LayerNorm family the residual rotation is the converted model's own: with a tied head it commutes with the
    final gain kept in the norm and fixes the all-ones direction (the model centres its input): (m - 1)(m - 2) / 2
    per cluster of m equal gain values; with an untied head (gain folded, embedding stored centred) it is all of
    O(d)."""
    out = {k: v for k, v in remaining.items() if k not in FOLDED_GROUPS}
    if not is_layernorm_family(model):
        return out
    adapter = get_adapter(model)
    gain = adapter.final_norm().weight.detach()
    if adapter.head_tied():
        if gain.device.type == "meta":
            return out
        sizes = torch.unique(gain.double(), return_counts=True)[1].tolist()
        dimension = sum((m - 1) * (m - 2) // 2 for m in sizes)
    else:
        dimension = gain.numel() * (gain.numel() - 1) // 2
    out.pop("residual_rotation", None)
    if dimension:
        out["residual_rotation"] = dimension
    return out


def norm_parameters(model: nn.Module, tie: bool) -> tuple[int, int]:
    """(the source's norm parameters: gains and, for LayerNorms, biases; those the converted model keeps: the final
    norm's gain (and bias, for LayerNorm families) where they cannot fold)."""
    adapter = get_adapter(model)
    norms = [n for layer in adapter.layers() for n in (layer.attention_norm, layer.mlp_norm)] + [adapter.final_norm()]

    def size(norm) -> int:
        return sum(t.numel() for t in (norm.weight, getattr(norm, "bias", None)) if t is not None)

    total = sum(size(n) for n in norms)
    final = adapter.final_norm()
    if is_layernorm_family(model):  # the bias is kept, and the gain in front of a tied head
        return total, final.bias.numel() + (final.weight.numel() if tie else 0)
    return total, final.weight.numel() if tie else 0


@torch.no_grad()
def centred(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True)


__all__ = [
    "FOLDED_GROUPS",
    "LAYERNORM_NOTE",
    "LAYERNORM_FAMILIES",
    "MLP_ROLES",
    "centred",
    "centred_rows",
    "check_layernorm_convertible",
    "fold_layernorm_layer",
    "is_layernorm_family",
    "layernorm_config",
    "layernorm_layer_tensors",
    "load_layernorm_ends",
    "norm_parameters",
    "remaining_after_folding",
    "unexported_option",
    "untied_final_bias",
]
