"""Parameter counts: the closed-form formula (the README's), for relational models and same-size Llama baselines, and
the stored parameters of any model (every stored tensor once, by kind and by layer), which compression reports and
checks (`check_not_grown`)."""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch import nn

from .modeling import GaugeFixedLinear, RelationalConfig

PARAMETER_KINDS: tuple[str, ...] = ("embedding", "head", "attention_qk", "attention_vo", "mlp", "norms", "other")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
        free = config.qk_norm or 0 < config.rotary_dim < config.qk_rank  # QK-norm, partial rotary: QK stored as it is
        qk += 0 if free else hkv * (r if config.layer_rope(i) else r * r)
        vo += 0 if config.value_parallel_removal else hkv * dh * dh
        mlp += config.layer_intermediate_size(i) if config.mlp_gated else 0  # a plain MLP has no scale gauge
    return {"qk": qk, "vo": vo, "mlp": mlp}


def relational_parameter_count(config: RelationalConfig) -> int:
    """Stored parameters of a relational model:
    V d (embedding) [+ V d untied head] [+ d final gain] + L [ d (H r + H_kv r + H_kv d_h) + H d_h d + 3 d d_ff
    + biases (H r + H_kv r + H_kv d_h if attention_bias) + (d if attention_output_bias) ] - fixed orbit dimensions;
    a plain MLP (mlp_gated=False) has 2 d d_ff (+ d_ff + d biases) and no scale gauge; learned positions add P d, a
    final norm bias d, sandwich norms 2 d per layer."""
    d, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    layers = 0
    for i in range(L):  # per-layer widths: r = layer_qk_rank(i), d_h = layer_value_rank(i), d_ff = ...(i)
        dh, r, f = config.layer_value_rank(i), config.layer_qk_rank(i), config.layer_intermediate_size(i)
        layer = d * (h * r + hkv * r + hkv * dh) + h * dh * d + (3 if config.mlp_gated else 2) * d * f
        layer += (f + d) if config.mlp_bias else 0
        if config.attention_bias:
            layer += h * r + hkv * r + hkv * dh
        if config.attention_output_bias:
            layer += d
        if config.qk_norm:
            layer += 2 * r  # the query and key gains
        if config.sandwich_norms:
            layer += 2 * d  # the gains of the norms on the attention's and the MLP's outputs (Gemma 3)
        layers += layer
    total = V * d * (1 if config.tie_word_embeddings else 2) + layers + (d if config.final_norm_gain else 0)
    total += (d if config.final_norm_bias else 0) + (
        config.max_position_embeddings * d if config.position_encoding == "learned" else 0
    )
    return total - sum(orbit_dimensions_fixed(config).values())


def llama_parameter_count(config: RelationalConfig) -> int:
    """Parameters of Transformers' Llama with the same dimensions (qk_rank = head_dim): the relational free-gauge
    count without a final gain plus the RMSNorm gains (2 d per layer + d final)."""
    free = RelationalConfig(
        **{**config.to_dict(), "gauge": "free", "qk_rank": config.head_dim, "final_norm_gain": False}
    )
    return relational_parameter_count(free) + (2 * config.num_hidden_layers + 1) * config.hidden_size


def parameter_kind(name: str) -> str:
    """The kind of a stored tensor from its qualified name: embedding, head, attention_qk (queries, keys and their
    biases), attention_vo (values, outputs), mlp, norms (gains) or other (shortcut matrices and anything else)."""
    leaf = name.lower()
    if "embed" in leaf or leaf.startswith("wte") or ".wte." in leaf or ".wpe." in leaf:
        return "embedding"
    if leaf.startswith("lm_head") or ".lm_head." in leaf:
        return "head"
    if "shortcut" in leaf:
        return "other"
    if "norm" in leaf or re.search(r"(^|\.)ln_\w+\.", leaf):
        return "norms"
    if re.search(r"(q_proj|k_proj|\.wq\.|\.wk\.|query|key)", leaf):
        return "attention_qk"
    if re.search(r"(v_proj|o_proj|\.wv\.|\.wo\.|value|out_proj|attn\.c_proj|c_attn)", leaf):
        return "attention_vo"
    if re.search(r"(mlp|gate_proj|up_proj|down_proj|c_fc|feed_forward|ffn)", leaf):
        return "mlp"
    return "other"


def _stored_tensors(model: nn.Module):
    """(qualified name, tensor) for every stored tensor once (the first name under which its storage appears)."""
    seen: set[tuple[int, int, tuple]] = set()

    def first_time(t: torch.Tensor) -> bool:
        if t.device.type == "meta":  # no storage: tied tensors are one object
            key = (id(t), 0, tuple(t.shape))
        else:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            return False
        seen.add(key)
        return True

    for name, p in model.named_parameters(remove_duplicate=True):
        if first_time(p):
            yield name, p
    persistent = set(model.state_dict(keep_vars=True))  # a buffer is stored when the model's state holds it
    for module_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            qualified = f"{module_name}.{buf_name}" if module_name else buf_name
            if buf is None or qualified not in persistent:
                continue
            if not (buf.is_floating_point() or buf.is_complex()):
                continue  # layout: indices, masks
            if isinstance(module, GaugeFixedLinear) and buf_name == "fixed_value":
                continue  # gauge constants, not data
            if first_time(buf):
                yield qualified, buf


def stored_parameters(model: nn.Module) -> dict:
    """Stored parameters of `model`: {"total": int, "by_kind": {kind: int}, "by_layer": [int per decoder layer],
    "nonzero": int}. Every stored tensor counts once (see the module docstring); "by_layer" sums the tensors whose
    name holds `layers.<i>.`; "nonzero" counts the non-zero entries (what a sparse format would store). A model on
    the meta device (built from its config, no weights) is counted too (its "nonzero" is then its total)."""
    by_kind = dict.fromkeys(PARAMETER_KINDS, 0)
    layers: dict[int, int] = defaultdict(int)
    total = nonzero = 0
    for name, t in _stored_tensors(model):
        n = t.numel()
        total += n
        nonzero += n if t.device.type == "meta" else int(torch.count_nonzero(t.detach()))
        by_kind[parameter_kind(name)] += n
        m = _LAYER.search(name)
        if m:
            layers[int(m.group(1))] += n
    by_layer = [layers.get(i, 0) for i in range(max(layers) + 1)] if layers else []
    return {"total": total, "by_kind": by_kind, "by_layer": by_layer, "nonzero": nonzero}


class ModelGrewError(ValueError):
    """A compression method produced a model storing more parameters than its source."""


def check_not_grown(before: int | nn.Module, after: int | nn.Module, method: str = "compression") -> None:
    """Raise ModelGrewError when `after` stores more parameters than `before` (models or stored totals): no
    compression method may return a larger model than its source."""
    b = before if isinstance(before, int) else stored_parameters(before)["total"]
    a = after if isinstance(after, int) else stored_parameters(after)["total"]
    if a > b:
        raise ModelGrewError(
            f"{method} would store {a:,} parameters, more than the source's {b:,}; choose a larger reduction"
        )
