"""Closed-form parameter counts (the README's formula), for relational models and same-size Llama baselines."""

from __future__ import annotations

from .modeling import RelationalConfig


def orbit_dimensions_fixed(config: RelationalConfig) -> dict[str, int]:
    """Per model, the symmetry dimensions the pivot gauge removes from storage, by group:
    qk: H_kv r^2 per layer (no rotary) or H_kv r (rotary commutant); vo: H_kv d_h^2 per layer (none with value-space
    parallel removal, which breaks GL(d_h)); mlp: d_ff per layer. All zero for gauge="free"."""
    if config.gauge != "pivot":
        return {"qk": 0, "vo": 0, "mlp": 0}
    L, hkv = config.num_hidden_layers, config.num_key_value_heads
    qk = vo = mlp = 0
    for i in range(L):  # per-layer widths (layer_qk_ranks, ...) default to the global ones
        r, dh = config.layer_qk_rank(i), config.layer_value_rank(i)
        qk += hkv * (r if config.position_encoding == "rope" else r * r)
        vo += 0 if config.value_parallel_removal else hkv * dh * dh
        mlp += config.layer_intermediate_size(i)
    return {"qk": qk, "vo": vo, "mlp": mlp}


def relational_parameter_count(config: RelationalConfig) -> int:
    """Stored parameters of a relational model:
    V d (embedding) [+ V d untied head] [+ d final gain] + L [ d (H r + H_kv r + H_kv d_h) + H d_h d + 3 d d_ff
    + biases (H r + H_kv r + H_kv d_h if attention_bias) + (d if attention_output_bias) ] - fixed orbit dimensions."""
    d, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    layers = 0
    for i in range(L):  # per-layer widths: r = layer_qk_rank(i), d_h = layer_value_rank(i), d_ff = ...(i)
        dh, r, f = config.layer_value_rank(i), config.layer_qk_rank(i), config.layer_intermediate_size(i)
        layer = d * (h * r + hkv * r + hkv * dh) + h * dh * d + 3 * d * f
        if config.attention_bias:
            layer += h * r + hkv * r + hkv * dh
        if config.attention_output_bias:
            layer += d
        layers += layer
    total = V * d * (1 if config.tie_word_embeddings else 2) + layers + (d if config.final_norm_gain else 0)
    return total - sum(orbit_dimensions_fixed(config).values())


def llama_parameter_count(config: RelationalConfig) -> int:
    """Parameters of Transformers' Llama with the same dimensions (qk_rank = head_dim): the relational free-gauge
    count without a final gain plus the RMSNorm gains (2 d per layer + d final)."""
    free = RelationalConfig(
        **{**config.to_dict(), "gauge": "free", "qk_rank": config.head_dim, "final_norm_gain": False}
    )
    return relational_parameter_count(free) + (2 * config.num_hidden_layers + 1) * config.hidden_size
