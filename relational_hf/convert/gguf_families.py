"""llama.cpp's `qwen3`, `smollm3` and `gemma3` architectures for relational checkpoints that `llama` / `deci` cannot
hold (DESIGN.md 2.2b): which architecture a relational config takes, its rotary layout, its extra metadata and what
each refuses.

What llama.cpp reads (the version llama-cpp-python 0.3.36 carries: `src/models/qwen3.cpp`, `src/models/smollm3.cpp`,
`src/models/gemma3.cpp`, `llama_model_rope_type`, `load_swa_pattern` and the common hyperparameter loader of
`llama-model.cpp`):

- **qwen3** (a relational model with `qk_norm`, converted from Qwen3): per layer `attn_q_norm.weight` and
  `attn_k_norm.weight` of the head width, applied to each query / key head (RMS over the head width, times the gain,
  the global `attention.layer_norm_rms_epsilon`) after the q/k maps and their optional biases and before the rotary
  embedding, as the relational attention does (`RelationalAttention.q_norm`, gains of qk_rank values shared by the
  heads, not folded: the norm would undo a fold). Its rope is NEOX: coordinate j turns with j + D/2, the relational
  (and Transformers) layout, so no row is reordered and the gains go in as they are. Scores are scaled by 1/sqrt(D)
  and the graph asserts key_length = value_length = rope.dimension_count, so the QK width must be the head width:
  a `qk_rank` below `head_dim` would need zero rows inside the normalised head, which change its RMS, and is refused;
  value widths below the head width (`layer_value_ranks`) are zero rows of W_V and zero columns of W_O, exactly.
- **smollm3** (a relational model with `rope_layers`, converted from SmolLM3): the llama layout (adjacent-pair "normal"
  rope, so rows are interleaved as for `llama`), and layer il attends without rotary positions exactly when
  (il + 1) % 4 == 0 (`n_no_rope_layer_step`, fixed at 4 in the loader, no metadata key): `rope_layers` must be that
  pattern, any other is refused. Scores are scaled by 1/sqrt(D) (`attention.scale` is not read), so per-layer QK widths
  below D are padded by rotary pair and W_Q scaled, as for `llama`.
- Both read `feed_forward_length` through the common loader (a per-layer array is accepted there) but create every
  layer's SwiGLU tensors at the width of layer 0, so per-layer SwiGLU widths (`layer_intermediate_sizes` that
  differ) have no form in them and are refused unless asked for (`pad_mlp`, `export --pad-mlp`): padding the
  narrower layers with zero units to the widest is exact, but it gives back that part of the compression, so it is
  never done silently. Neither creates `attn_output.bias`: `attention_output_bias` is refused
  (q/k/v biases are optional tensors both read). Head counts are global.
- A model with both `qk_norm` and layers without rotary has no llama.cpp architecture here (qwen3 rotates every
  layer, smollm3 normalises no query or key) and is refused.
- **gemma3** (a relational model with any of Gemma 3's options: `sandwich_norms`, `embedding_scale`, `layer_types`,
  `sliding_window`, `sliding_rope_parameters`; converted from Gemma 3 by `relational_hf.convert.gemma`). Per layer:
  `attn_norm`, `attn_q/k/v`, `attn_q_norm` / `attn_k_norm` (head width, required), `attn_output`,
  `post_attention_norm`, `ffn_norm`, `ffn_gate/up/down`, `post_ffw_norm`; then `output_norm` and an optional
  `output`. Every norm is RMS x / sqrt(mean(x^2) + eps) times its weight, one global eps: llama.cpp's own converter
  adds Gemma's 1 to w, and the relational model already stores every gain as the factor 1 + w, so the gains go in as
  stored (the gain-free pre-norms as ones). llama.cpp itself multiplies the embedded input by sqrt(n_embd) (in f32,
  no metadata key): `embedding_scale` must be that number in float32, or it is refused. Queries are scaled by
  1/sqrt(key_length) (`query_pre_attn_scalar` is not read; the conversion already carries it in the query-norm
  gain), except in a model of 62 layers (llama.cpp's "27B"), where the scale is 1/sqrt(n_embd / n_head): there the
  query-norm gains are multiplied by sqrt(n_embd / n_head / D) (`Gemma3Params.query_gain`), exactly. The rope is
  NEOX (the relational layout, rows not reordered), `rope.freq_base` the full layers' base; the sliding layers turn
  at `rope.freq_base_swa` (written; llama.cpp's default is 10000) with no scaling (their freq_scale is fixed at 1),
  the full layers at `rope.scaling.factor` for a linear `rope_type` (Gemma 3 4B and up); other rope types are
  refused. `attention.sliding_window` is the window (llama.cpp masks key p0 for query p1 when p1 - p0 >= window: the
  same `window` positions up to and including its own as Transformers' sliding mask), and
  `attention.sliding_window_pattern` a bool per layer (True: sliding), so any pattern of `layer_types` is held;
  without sliding layers neither key is written (no window). The MLP is GELU-tanh gated (`LLM_FFN_GELU`, `LLM_FFN_PAR`):
  `hidden_act` must be "gelu_pytorch_tanh" or "gelu_new" (the same function); note that llama.cpp's CPU GELU looks
  its value up in a table of f16 inputs and outputs (`GGML_GELU_FP16`), so it differs from the f32 function by about
  one f16 rounding. Final logit soft-capping is not written (the relational model has none; the conversion refuses
  it). As for qwen3: the QK width must be the head width (the QK-norm sees the whole head), value widths are padded
  with zeros, every layer's SwiGLU has layer 0's width (per-layer widths refused), no `attn_output.bias` is read,
  head counts are global; every layer rotates (`rope_layers` refused). Refused by name as well: `qk_norm=False` and
  `sandwich_norms=False` (llama.cpp's gemma3 requires the QK-norm and both sandwich norms; unit weights would still
  normalise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: llama.cpp architectures whose rope pairs coordinate j with j + D/2 (NEOX); the others pair 2j with 2j + 1
NEOX_ROPE_ARCHS = frozenset({"qwen3", "gemma3"})
#: the llama.cpp architectures this module maps (`family_arch`); each holds one SwiGLU width for every layer
FAMILY_ARCHS = frozenset({"qwen3", "smollm3", "gemma3"})
#: the relational config's Gemma 3 options: any of them set makes the export llama.cpp's gemma3
GEMMA3_OPTIONS = ("sandwich_norms", "embedding_scale", "layer_types", "sliding_window", "sliding_rope_parameters")
#: activations llama.cpp's gemma3 computes (GELU, tanh approximation)
GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")
#: llama.cpp's gemma3 scales queries by 1/sqrt(n_embd / n_head) instead of 1/sqrt(key_length) at this layer count
GEMMA3_27B_LAYERS = 62
#: smollm3: layer il attends without rotary positions when (il + 1) % SMOLLM3_NO_ROPE_STEP == 0 (llama.cpp's loader)
SMOLLM3_NO_ROPE_STEP = 4


def _partial_rope(config) -> bool:
    return config.rope_layers is not None and not all(config.rope_layers)


def _gemma_like(config) -> bool:
    return any(getattr(config, name, None) not in (None, False) for name in GEMMA3_OPTIONS)


def family_arch(config) -> str | None:
    """`gemma3` for a relational config with any of Gemma 3's options (`GEMMA3_OPTIONS`), `qwen3` for one with a
    per-head QK-norm, `smollm3` for one with layers without rotary positions, None for the others (`llama` /
    `deci`). Does not check that the architecture holds the config (`family_refusal`)."""
    if _gemma_like(config):
        return "gemma3"
    if config.qk_norm:
        return "qwen3"
    if _partial_rope(config):
        return "smollm3"
    return None


def smollm3_rope_layers(num_layers: int) -> list[bool]:
    """The rotary switch per layer that llama.cpp's smollm3 applies: False for every SMOLLM3_NO_ROPE_STEP-th layer."""
    return [(i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(num_layers)]


def family_refusal(config, pad_mlp: bool = False) -> str | None:
    """Why the relational `config` (a `qwen3`, `smollm3` or `gemma3` one, `family_arch`) has no exact form in that llama.cpp
    architecture (one line naming the config field), or None when it has one (or is neither). `pad_mlp`: per-layer
    SwiGLU widths are held, padded with zero units to the widest layer (`gguf_layout.gguf_layout`)."""
    arch = family_arch(config)
    if arch is None:
        return None
    if arch == "gemma3":
        reason = _gemma3_refusal(config)
        if reason is not None:
            return reason
    elif config.qk_norm and _partial_rope(config):
        return (
            f"qk_norm=True with rope_layers={config.rope_layers!r} has no GGUF form: llama.cpp's qwen3 rotates every "
            "layer and its smollm3 normalises no query or key"
        )
    if arch in NEOX_ROPE_ARCHS and config.qk_rank != config.head_dim:
        return (
            f"qk_rank={config.qk_rank} below head_dim={config.head_dim} with qk_norm=True has no GGUF form: llama.cpp's "
            f"{arch} normalises each query/key head over the whole head width (key width = value width), and zero rows "
            "inside the head would change its RMS"
        )
    if arch == "smollm3" and list(config.rope_layers) != smollm3_rope_layers(config.num_hidden_layers):
        want = smollm3_rope_layers(config.num_hidden_layers)
        return (
            f"rope_layers={config.rope_layers!r} has no GGUF form: llama.cpp's smollm3 attends without rotary "
            f"positions in every {SMOLLM3_NO_ROPE_STEP}th layer exactly ({want!r} here), and llama and deci in none"
        )
    widths = sorted({config.layer_intermediate_size(i) for i in range(config.num_hidden_layers)})
    if len(widths) > 1 and not pad_mlp:
        return (
            f"layer_intermediate_sizes={config.layer_intermediate_sizes!r} (per-layer SwiGLU widths) has no GGUF form "
            f"in llama.cpp's {arch}: it creates every layer's SwiGLU at one width; --pad-mlp writes the narrower "
            f"layers padded with zero units to {widths[-1]} (exact, but those units are stored again)"
        )
    if config.attention_output_bias:
        return f"attention_output_bias=True has no GGUF form in llama.cpp's {arch}: it reads no attn_output.bias"
    return None


def _rope_type(table) -> str:
    return dict(table or {}).get("rope_type", "default")


def _gemma3_refusal(config) -> str | None:
    """What llama.cpp's gemma3 cannot hold of a Gemma-like relational config, before the checks it shares with qwen3."""
    where = "has no GGUF form in llama.cpp's gemma3"
    if not config.qk_norm:
        return f"qk_norm=False {where}: it RMS-normalises every query and key head (attn_q_norm / attn_k_norm required)"
    if not config.sandwich_norms:
        return (
            f"sandwich_norms=False {where}: it RMS-normalises both sublayers' outputs (post_attention_norm / "
            "post_ffw_norm required; unit weights would still normalise)"
        )
    d, scale = config.hidden_size, config.embedding_scale
    if scale is None or np.float32(scale) != np.float32(math.sqrt(d)):
        return (
            f"embedding_scale={scale!r} {where}: it multiplies the embedded input by sqrt(hidden_size) = "
            f"{math.sqrt(d):g} itself"
        )
    if config.hidden_act not in GEMMA3_ACTIVATIONS:
        return f"hidden_act={config.hidden_act!r} {where}: its gated MLP uses the tanh-approximate GELU"
    if _partial_rope(config):
        return f"rope_layers={config.rope_layers!r} {where}: it rotates every layer"
    sliding = config.layer_types is not None and "sliding_attention" in config.layer_types
    full = dict(config.rope_parameters or {})
    if _rope_type(full) not in ("default", "linear"):
        return (
            f"rope_parameters rope_type={_rope_type(full)!r} {where}: its full-attention layers take the default or a "
            "linear rotary scaling"
        )
    local = config.sliding_rope_parameters if config.sliding_rope_parameters is not None else full
    if sliding and _rope_type(local) != "default":
        name = "sliding_rope_parameters" if config.sliding_rope_parameters is not None else "rope_parameters"
        return (
            f"{name} rope_type={_rope_type(local)!r} for the sliding layers {where}: their rotary frequencies are "
            "never scaled there"
        )
    return None


@dataclass(frozen=True)
class Gemma3Params:
    """What llama.cpp's gemma3 reads beyond the common hyperparameters: the sliding layers (`swa_layers`, one bool
    per layer, None without sliding layers) and their window and rotary base, the full layers' linear rotary factor
    (None: unscaled), and the factor on the query-norm gains that turns llama.cpp's attention scale into the
    relational 1/sqrt(D) (1 except at GEMMA3_27B_LAYERS layers)."""

    swa_layers: tuple[bool, ...] | None
    sliding_window: int | None
    rope_theta_swa: float | None
    rope_linear_factor: float | None
    query_gain: float


def gemma3_params(config) -> Gemma3Params:
    """The `Gemma3Params` of a relational config that `family_refusal` accepts as gemma3."""
    types = config.layer_types
    sliding = types is not None and "sliding_attention" in types
    full = dict(config.rope_parameters or {})
    local = dict(config.sliding_rope_parameters if config.sliding_rope_parameters is not None else full)
    query_gain = 1.0
    if config.num_hidden_layers == GEMMA3_27B_LAYERS:  # llama.cpp's scale 1/sqrt(n_embd / n_head), not 1/sqrt(D)
        query_gain = math.sqrt(config.hidden_size / config.num_attention_heads / config.head_dim)
    return Gemma3Params(
        swa_layers=tuple(t == "sliding_attention" for t in types) if sliding else None,
        sliding_window=int(config.sliding_window) if sliding else None,
        rope_theta_swa=float(local.get("rope_theta", 10000.0)) if sliding else None,
        rope_linear_factor=float(full["factor"]) if _rope_type(full) == "linear" else None,
        query_gain=query_gain,
    )


def gemma3_metadata(writer, params: Gemma3Params) -> None:
    """Write the gemma3 keys of `params` (sliding window, per-layer pattern, local base, linear rotary factor)."""
    if params.swa_layers is not None:
        writer.add_sliding_window(params.sliding_window)
        writer.add_sliding_window_pattern(list(params.swa_layers))
        writer.add_rope_freq_base_swa(params.rope_theta_swa)
    if params.rope_linear_factor is not None:
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params.rope_linear_factor)


__all__ = [
    "GEMMA3_27B_LAYERS",
    "GEMMA3_ACTIVATIONS",
    "GEMMA3_OPTIONS",
    "NEOX_ROPE_ARCHS",
    "SMOLLM3_NO_ROPE_STEP",
    "Gemma3Params",
    "family_arch",
    "family_refusal",
    "gemma3_metadata",
    "gemma3_params",
    "smollm3_rope_layers",
]
