"""Exact conversion of Gemma 3 (text, Gemma3ForCausalLM) into the relational architecture.

Gemma 3's forward pass (Transformers' `modeling_gemma3`): every norm is N(x) = x / sqrt(mean(x^2) + eps) * (1 + w),
computed in fp32; per layer

    h <- h + N_post_attn(Attn(N_in(h))),    h <- h + N_post_ffw(MLP(N_pre_ffw(h))),

queries and keys normalised per head by their own (1 + w) norms before the rotary embedding, scores scaled by
query_pre_attn_scalar^-1/2, MLP (gelu_tanh(x W_gate) * (x W_up)) W_down, the embedded input multiplied by
sqrt(hidden_size) in the embedding's dtype, a final norm in front of a head tied to the embedding, and two kinds of
layers (`layer_types`): full attention with the global rotary base, and sliding-window attention with the local one.

In relational form (`RelationalConfig`), each exactly:

- (1 + w) gains: the gain is 1 + w, formed in fp32 as Gemma forms it (`norm_gain`). The two pre-norms' gains fold into
  their readers (q/k/v, gate/up) as any RMSNorm gain; where a gain cannot fold it is stored as 1 + w: the QK-norm gains
  (`qk_norm`, as Qwen3), the final gain in front of the tied head (`final_norm_gain`), and the sandwich norms';
- sandwich norms (`sandwich_norms`): the post-attention and post-feedforward norms sit between W_O (W_down) and the
  stream, so their gains fold nowhere and are stored. The symmetry they remove: a residual rotation R must now commute
  with every sandwich gain (and with the final gain): only rotations inside clusters of equal gain values survive,
  none with trained gains. The VO gauge (W_V B, B^-1 W_O) and the MLP scales leave the sublayers' outputs unchanged, so
  the pivot gauge still fixes them;
- query_pre_attn_scalar: the relational scale is qk_rank^-1/2 = head_dim^-1/2, so the query norm's gain carries the
  factor sqrt(head_dim / query_pre_attn_scalar) (a scalar on the normalised query passes through the rotary embedding,
  which is linear): exact, no config field;
- the embedding scale (`embedding_scale` = sqrt(hidden_size)): it cannot fold into a table that is also the head;
- the GELU-tanh gated MLP: `hidden_act="gelu_pytorch_tanh"` (the same SwiGLU-type product, so its scales are a gauge);
- sliding-window layers: `layer_types` and `sliding_window` as Gemma's (Transformers' masks and sliding cache), the
  full layers' rotary settings as `rope_parameters`, the sliding layers' as `sliding_rope_parameters`.

Refused in one line naming the field: `final_logit_softcapping`, `attn_logit_softcapping` (None in Gemma 3's
checkpoints), `use_bidirectional_attention`, layer types other than full and sliding attention, activations the
relational MLP does not have.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..architectures import UnsupportedModelError, get_adapter
from ..modeling import RelationalConfig

#: adapter families that convert through this module
GEMMA_FAMILIES = ("gemma3",)
#: the per-layer tensors a converted layer stores outside its attention and MLP (the sandwich norms' gains)
OUTPUT_GAINS = ("attention_output_gain", "mlp_output_gain")
#: activations the relational gated MLP computes
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu", "relu")
#: the conversion report's note on Gemma 3
GEMMA_NOTE = (
    "Gemma 3: (1 + w) gains folded into the pre-norms' readers; the QK-norm, sandwich-norm and final gains stored as "
    "1 + w (the query gain times sqrt(head_dim / query_pre_attn_scalar)); the embedding scale, the sliding-window "
    "layers and their rotary base kept as config options (embedding_scale, layer_types, sliding_rope_parameters)"
)


def is_gemma_family(model: nn.Module) -> bool:
    return get_adapter(model).family in GEMMA_FAMILIES


def check_gemma_convertible(model: nn.Module) -> None:
    """`UnsupportedModelError` in one line naming the field the relational architecture does not hold."""
    c, name = model.config, type(model).__name__
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = getattr(c, field, None)
        if value is not None:
            raise UnsupportedModelError(f"unsupported: {name} ({field}={value!r}: logit soft-capping is not held yet)")
    if getattr(c, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"unsupported: {name} (use_bidirectional_attention=True: causal attention only)")
    other = sorted(set(c.layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise UnsupportedModelError(f"unsupported: {name} (layer_types {other[0]!r}: full and sliding attention only)")
    if c.hidden_activation not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"unsupported: {name} (hidden_activation {c.hidden_activation!r}; the relational MLP has {ACTIVATIONS})"
        )
    if get_adapter(model).output_head() is None:
        raise UnsupportedModelError(f"unsupported: {name} (no LM head: convert takes causal LMs)")


def gemma_options(model: nn.Module) -> dict:
    """The `RelationalConfig` options that hold Gemma 3 (module docstring), to update the Llama-family ones with."""
    c = model.config
    sliding = "sliding_attention" in c.layer_types
    rope = c.rope_parameters
    return dict(
        qk_norm=True,
        sandwich_norms=True,
        embedding_scale=float(c.hidden_size**0.5),
        hidden_act=c.hidden_activation,
        rope_parameters=copy.deepcopy(dict(rope["full_attention"])),
        layer_types=list(c.layer_types),
        sliding_window=c.sliding_window if sliding else None,
        sliding_rope_parameters=copy.deepcopy(dict(rope["sliding_attention"])) if sliding else None,
    )


def norm_gain(adapter, norm: nn.Module, stored: torch.Tensor | None = None) -> torch.Tensor:
    """The gain `norm` multiplies by: its stored vector (`stored`: the same vector read elsewhere, e.g. from the
    shards) plus the family's offset (`NormSlots.offset`), formed in fp32 as Gemma forms 1 + w; without an offset,
    the stored vector itself (no copy)."""
    slots = adapter.norm_slots(norm)
    gain = slots.gain.get() if stored is None else stored
    return gain.float() + slots.offset if slots.offset else gain


def query_gain_factor(config) -> float:
    """sqrt(head_dim / query_pre_attn_scalar): Gemma's attention scale over the relational head_dim^-1/2."""
    return math.sqrt(config.head_dim / config.query_pre_attn_scalar)


@torch.no_grad()
def gemma_layer_tensors(model: nn.Module, layer) -> dict[str, torch.Tensor | None]:
    """The tensors of one Gemma 3 layer by role (`relational.LAYER_ROLES`, the QK-norm gains and `OUTPUT_GAINS`),
    every gain as the factor it multiplies by (1 + w), the query gain times `query_gain_factor`."""
    adapter = get_adapter(model)
    slots, mlp = adapter.attention_slots(layer), adapter.mlp_slots(layer)
    offset = slots.qk_norm_offset
    q_gain = (slots.q_norm.get().float() + offset).double() * query_gain_factor(model.config)
    return {
        **adapter.attention_weights(layer).roles(),
        "q_norm": q_gain.float(),
        "k_norm": slots.k_norm.get().float() + offset,
        "attention_gain": norm_gain(adapter, layer.attention_norm),
        "attention_output_gain": norm_gain(adapter, layer.attention_post_norm),
        "gate": mlp.gate.get(),
        "up": mlp.up.get(),
        "down": mlp.down.get(),
        "mlp_gain": norm_gain(adapter, layer.mlp_norm),
        "mlp_output_gain": norm_gain(adapter, layer.mlp_post_norm),
    }


@torch.no_grad()
def load_output_gains(target: nn.Module, gains: dict[str, torch.Tensor]) -> None:
    """Store the sandwich norms' gains (`OUTPUT_GAINS`) in the `RelationalDecoderLayer` `target`."""
    for key, norm in zip(OUTPUT_GAINS, (target.attention_output_norm, target.mlp_output_norm), strict=True):
        if (norm is None) != (key not in gains):
            raise ValueError(f"{key}: the source layer and the relational layer (sandwich_norms) disagree")
        if norm is not None:
            norm.weight.copy_(gains[key])


def unexported_gemma_option(config: RelationalConfig) -> str | None:
    """The first option of a converted Gemma 3 model that the Llama-like export targets do not hold (`--to gemma3`
    does), as one line naming it, or None."""
    options = {
        "sandwich_norms=True": config.sandwich_norms,
        f"embedding_scale={config.embedding_scale!r}": config.embedding_scale is not None,
        "layer_types (sliding-window layers)": config.layer_types is not None,
    }
    found = [name for name, present in options.items() if present]
    if not found:
        return None
    return (
        f"{found[0]} (a converted Gemma 3 model) has no equivalent there: export --to gemma3 holds the sandwich "
        "norms, the embedding scale and the sliding-window layers"
    )


#: why `convert --slice` refuses Gemma 3 and its conversion
NOT_COMPRESSED = (
    "sandwich norms, the embedding scale and sliding-window layers (Gemma 3) are not sliced yet; convert holds it "
    "exactly and compress narrows it"
)


def is_gemma_config(config) -> bool:
    """Whether `config` (any model's) is Gemma 3's or a converted Gemma 3's (the layer-by-layer logits,
    `streaming.layerwise_logits`, do not take them yet)."""
    if getattr(config, "model_type", None) == "gemma3_text":
        return True
    return bool(getattr(config, "sandwich_norms", False)) or getattr(config, "embedding_scale", None) is not None or (
        getattr(config, "model_type", None) == RelationalConfig.model_type and config.layer_types is not None
    )


__all__ = [
    "GEMMA_FAMILIES",
    "GEMMA_NOTE",
    "NOT_COMPRESSED",
    "OUTPUT_GAINS",
    "check_gemma_convertible",
    "gemma_layer_tensors",
    "gemma_options",
    "is_gemma_family",
    "load_output_gains",
    "norm_gain",
    "query_gain_factor",
    "is_gemma_config",
    "unexported_gemma_option",
]
