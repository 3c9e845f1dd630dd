"""llama.cpp's `qwen3` and `smollm3` architectures for relational checkpoints that `llama` / `deci` cannot hold
(DESIGN.md 2.2b): which architecture a relational config takes, its rotary layout, and what each refuses.

What llama.cpp reads (the version llama-cpp-python 0.3.36 carries: `src/models/qwen3.cpp`, `src/models/smollm3.cpp`,
`llama_model_rope_type`, the common hyperparameter loader of `llama-model.cpp`):

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
  differ) have no form in them and are refused: padding the narrower layers with zero units would be exact, but it
  would silently give back the compression. Neither creates `attn_output.bias`: `attention_output_bias` is refused
  (q/k/v biases are optional tensors both read). Head counts are global.
- A model with both `qk_norm` and layers without rotary has no llama.cpp architecture here (qwen3 rotates every
  layer, smollm3 normalises no query or key) and is refused.
"""

from __future__ import annotations

#: llama.cpp architectures whose rope pairs coordinate j with j + D/2 (NEOX); the others pair 2j with 2j + 1
NEOX_ROPE_ARCHS = frozenset({"qwen3"})
#: smollm3: layer il attends without rotary positions when (il + 1) % SMOLLM3_NO_ROPE_STEP == 0 (llama.cpp's loader)
SMOLLM3_NO_ROPE_STEP = 4


def _partial_rope(config) -> bool:
    return config.rope_layers is not None and not all(config.rope_layers)


def family_arch(config) -> str | None:
    """`qwen3` for a relational config with a per-head QK-norm, `smollm3` for one with layers without rotary
    positions, None for the others (`llama` / `deci`). Does not check that the architecture holds the config
    (`family_refusal`)."""
    if config.qk_norm:
        return "qwen3"
    if _partial_rope(config):
        return "smollm3"
    return None


def smollm3_rope_layers(num_layers: int) -> list[bool]:
    """The rotary switch per layer that llama.cpp's smollm3 applies: False for every SMOLLM3_NO_ROPE_STEP-th layer."""
    return [(i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(num_layers)]


def family_refusal(config) -> str | None:
    """Why the relational `config` (a `qwen3` or `smollm3` one, `family_arch`) has no exact form in that llama.cpp
    architecture (one line naming the config field), or None when it has one (or is neither)."""
    arch = family_arch(config)
    if arch is None:
        return None
    if config.qk_norm and _partial_rope(config):
        return (
            f"qk_norm=True with rope_layers={config.rope_layers!r} has no GGUF form: llama.cpp's qwen3 rotates every "
            "layer and its smollm3 normalises no query or key"
        )
    if arch == "qwen3" and config.qk_rank != config.head_dim:
        return (
            f"qk_rank={config.qk_rank} below head_dim={config.head_dim} with qk_norm=True has no GGUF form: llama.cpp's "
            "qwen3 normalises each query/key head over the whole head width (key width = value width), and zero rows "
            "inside the head would change its RMS"
        )
    if arch == "smollm3" and list(config.rope_layers) != smollm3_rope_layers(config.num_hidden_layers):
        want = smollm3_rope_layers(config.num_hidden_layers)
        return (
            f"rope_layers={config.rope_layers!r} has no GGUF form: llama.cpp's smollm3 attends without rotary "
            f"positions in every {SMOLLM3_NO_ROPE_STEP}th layer exactly ({want!r} here), and llama and deci in none"
        )
    widths = sorted({config.layer_intermediate_size(i) for i in range(config.num_hidden_layers)})
    if len(widths) > 1:
        return (
            f"layer_intermediate_sizes={config.layer_intermediate_sizes!r} (per-layer SwiGLU widths) has no GGUF form "
            f"in llama.cpp's {arch}: it creates every layer's SwiGLU at one width (zero units would pad them back "
            "to the widest, undoing the compression)"
        )
    if config.attention_output_bias:
        return f"attention_output_bias=True has no GGUF form in llama.cpp's {arch}: it reads no attn_output.bias"
    return None


__all__ = ["NEOX_ROPE_ARCHS", "SMOLLM3_NO_ROPE_STEP", "family_arch", "family_refusal", "smollm3_rope_layers"]
