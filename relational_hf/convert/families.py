"""Which Llama-like families convert exactly into the relational architecture, and with which of its options.

The converter folds every RMSNorm gain into the maps that read it and moves each QK pair, VO pair and SwiGLU to the
relational gauge. A family converts when every part of its forward pass has an exact relational form:

- Llama, Mistral, Qwen2: nothing beyond the defaults (q/k/v biases, an output bias, any rope type);
- Qwen3: per-head QK-norm with per-dimension gains (`RelationalConfig.qk_norm`). The norm sits between W_Q / W_K and
  the scores, so the QK pair keeps only the rotations that commute with the norm, the gains and RoPE (one angle per
  rotary pair whose q and k gains are equal): W_Q, W_K and both gain vectors are stored as they are, exactly, and the
  QK gauge stays free (it is reported as a symmetry left, with the gain exchange g_q c, g_k / c). VO and the SwiGLU
  scales go to the pivot gauge as for Llama;
- SmolLM3: layers without rotary positions (`config.no_rope_layers`, `RelationalConfig.rope_layers`), whose QK gauge
  is the full GL(d_h) of each key head, fixed by a block pivot;
- Phi-3: the fused `qkv_proj` and `gate_up_proj` are split at conversion (the adapter's views); rope types default
  and longrope (Phi-3's short/long factors switch at `original_max_position_embeddings` in both models alike);
  partial rotary (`partial_rotary_factor` < 1: the first rot_dim coordinates of each head turn, rotate-half layout)
  is held by the relational partial rotary, with the QK pair kept free (GL on the non-rotated block is not pivoted).

- GPT-2, GPT-NeoX: LayerNorms folded into RMS norms over a mean-free stream, learned positions, a plain GELU MLP with biases
  (GPT-NeoX: rotary, partial with the QK pair kept free, parallel residual; `relational_hf.convert.layernorm`, which
  says what is exact and what is refused).

Refused in one line naming the feature, before any work: MLP biases, q/k/v biases present on some maps only,
partial rotary with a QK-norm or differing between layers, activations the relational SwiGLU does not have, QK-norm
over the whole projection (not per head).
"""

from __future__ import annotations

from torch import nn

from ..architectures import UnsupportedModelError, get_adapter
from .layernorm import LAYERNORM_FAMILIES, check_layernorm_convertible

#: adapter families the converter takes
CONVERTIBLE_FAMILIES = ("llama", "smollm3", "phi3")
#: the groups the relational pivot gauge removes from storage
PIVOT_GROUPS = ("qk_gauge", "vo_gauge", "mlp_scale")


def _unsupported(model: nn.Module, feature: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported: {type(model).__name__} ({feature})")


def check_convertible(model: nn.Module) -> None:
    """Raise `UnsupportedModelError` ("unsupported: <class> (<feature>)") when `model` has no exact relational form."""
    adapter = get_adapter(model)
    if adapter.relational_obstruction is not None:  # the adapter names what has no relational form yet
        raise _unsupported(model, f"{adapter.relational_obstruction}: no relational form yet")
    if adapter.family in LAYERNORM_FAMILIES:
        check_layernorm_convertible(model)
        return
    if adapter.family not in CONVERTIBLE_FAMILIES or adapter.output_head() is None:
        raise _unsupported(
            model, "to_relational converts Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, GPT-2 and GPT-NeoX causal LMs"
        )
    config = model.config
    if config.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
        raise _unsupported(model, f"activation {config.hidden_act!r}")
    head_dim = adapter.head_dim()
    for layer in adapter.layers():
        slots, mlp = adapter.attention_slots(layer), adapter.mlp_slots(layer)
        if any(b is not None for b in (mlp.up_bias, mlp.gate_bias, mlp.down_bias)):
            raise _unsupported(model, "MLP biases; the relational SwiGLU has none")
        if not mlp.gated or mlp.gate is None:
            raise _unsupported(model, "a non-gated MLP; the relational MLP is SwiGLU")
        if len({slots.q_bias is None, slots.k_bias is None, slots.v_bias is None}) > 1:
            raise _unsupported(model, "q/k/v biases must be all present or all absent")
        if 0 < slots.rotary_dim < head_dim and (slots.q_norm is not None or slots.rotary_dim % 2):
            raise _unsupported(model, "partial rotary with a QK-norm or an odd number of rotated coordinates")
        if (slots.q_norm is None) != (slots.k_norm is None):
            raise _unsupported(model, "a norm on the queries or the keys only")
        if slots.q_norm is not None and slots.q_norm.param.shape != (head_dim,):
            raise _unsupported(model, "QK-norm over the whole projection; the relational QK-norm is per head")
    norms = [m for layer in adapter.layers() for m in (layer.attention_norm, layer.mlp_norm)] + [adapter.final_norm()]
    rotary = {adapter.attention_slots(layer).rotary_dim for layer in adapter.layers()}
    if len(rotary - {0}) > 1 or (len(rotary) > 1 and any(0 < r < head_dim for r in rotary)):
        raise _unsupported(model, "partial rotary that differs between layers or with layers without rotary")
    if any(n is None or getattr(n, "bias", None) is not None or isinstance(n, nn.LayerNorm) for n in norms):
        raise _unsupported(model, "LayerNorm or norm biases; the relational model has gain-free RMS norms")


def relational_options(model: nn.Module) -> dict:
    """The `RelationalConfig` options beyond the Llama defaults that `model` needs: qk_norm, rope_layers."""
    adapter = get_adapter(model)
    layers = adapter.layers()
    slots = [adapter.attention_slots(layer) for layer in layers]
    rotary = [s.rotary_dim > 0 for s in slots]
    options: dict = {"qk_norm": slots[0].q_norm is not None}
    if not any(rotary):
        options["position_encoding"] = "none"
    elif not all(rotary):
        options["rope_layers"] = rotary
    return options


def fixed_groups(model: nn.Module) -> tuple[str, ...]:
    """The source's groups the converted model no longer stores: with QK-norm or partial rotary (GPT-NeoX) the QK
    pair stays as it is."""
    adapter = get_adapter(model)
    slots = adapter.attention_slots(adapter.layers()[0])
    partial = 0 < slots.rotary_dim < slots.qk_dim
    return PIVOT_GROUPS[1:] if slots.q_norm is not None or partial else PIVOT_GROUPS


__all__ = ["CONVERTIBLE_FAMILIES", "check_convertible", "fixed_groups", "relational_options"]
