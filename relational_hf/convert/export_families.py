"""Relational checkpoints -> the Transformers class of the family they came from: Qwen3, SmolLM3 or Phi-3.

`to_llama` writes a plain Llama; a relational model with per-head QK-norm (`qk_norm`, from Qwen3) or with layers
without rotary (`rope_layers`, from SmolLM3) has no Llama form, but its own family's class holds it exactly, and a
Phi-3 user may want the fused Phi-3 layout back. `to_family` multiplies every gauge-fixed factor back out
(`full_weights`), writes unit gains into the gain-free norms, keeps the QK-norm gains and a final gain, and checks the
logits like every export. Only uniform widths (no per-layer widths of a compressed model, QK rank = head width) fit
these classes; anything else is refused in one line naming what does not fit (`--to llama` or `--to free` hold it).
GPT-2 and GPT-NeoX (LayerNorms over a mean-free stream, plain MLP, learned positions or partial rotary): `to_family`
hands them to `export_layernorm.to_layernorm_family`; Gemma 3 (sandwich norms, (1 + w) gains, sliding-window layers) to
`export_gemma.to_gemma3`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM
from transformers.initialization import no_init_weights

from ..modeling import RelationalForCausalLM

#: family name -> (config class, model class)
FAMILY_CLASSES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
}


def _refuse(target: str, reason: str) -> ValueError:
    from .export import ExportError

    return ExportError(f"--to {target}: {reason}")


def _check_family(model: nn.Module, target: str) -> None:
    if not isinstance(model, RelationalForCausalLM):
        raise _refuse(target, f"export takes a relational causal LM, got {type(model).__name__}")
    c = model.config
    per_layer = [f for f in ("layer_qk_ranks", "layer_value_ranks", "layer_intermediate_sizes") if getattr(c, f)]
    if per_layer:
        raise _refuse(target, f"per-layer widths ({', '.join(per_layer)}) do not fit its uniform layers; use --to llama")
    if c.qk_rank != c.head_dim:
        raise _refuse(target, f"QK rank {c.qk_rank} < head width {c.head_dim} does not fit; use --to llama")
    if c.value_parallel_removal:
        raise _refuse(target, "value_parallel_removal has no equivalent there")
    if c.position_encoding != "rope":
        raise _refuse(target, "a model without rotary positions has no equivalent there")
    from .layernorm import unexported_option

    if unexported_option(c, target) is not None:
        raise _refuse(target, unexported_option(c, target))
    if c.qk_norm != (target == "qwen3"):
        need = "needs qk_norm=True (per-head QK-norm)" if target == "qwen3" else "has no per-head QK-norm (qk_norm)"
        raise _refuse(target, f"{target} {need}")
    if c.rope_layers is not None and not all(c.rope_layers) and target != "smollm3":
        raise _refuse(target, "layers without rotary (rope_layers) have no equivalent there; use --to smollm3")
    if target == "phi3" and (c.attention_bias or c.attention_output_bias):
        raise _refuse(target, "Phi-3 has no attention biases")
    if target in ("qwen3", "smollm3") and c.attention_bias != c.attention_output_bias:
        raise _refuse(target, "its attention_bias puts biases on q, k, v and o together")


def family_config(config, target: str):
    """The config of the `target` family's class with the dimensions and options of the relational `config`."""
    config_class = FAMILY_CLASSES[target][0]
    kwargs = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=copy.deepcopy(dict(config.rope_parameters)),
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        attention_dropout=config.attention_dropout,
    )
    if target in ("qwen3", "smollm3"):
        kwargs.update(head_dim=config.head_dim, attention_bias=config.attention_bias)
    if target == "smollm3":
        layers = config.rope_layers or [True] * config.num_hidden_layers
        kwargs.update(no_rope_layers=[int(v) for v in layers], use_sliding_window=False)
    if target == "phi3":
        rope = kwargs["rope_parameters"]
        original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        kwargs.update(original_max_position_embeddings=original)
    return config_class(**kwargs)


@torch.no_grad()
def _copy_layers(source: RelationalForCausalLM, target: nn.Module, family: str) -> None:
    for src, dst in zip(source.model.layers, target.model.layers, strict=True):
        w, m = src.self_attn.full_weights(), src.mlp.full_weights()
        attn = dst.self_attn
        if family == "phi3":
            attn.qkv_proj.weight.copy_(torch.cat([w["q"], w["k"], w["v"]]))
            dst.mlp.gate_up_proj.weight.copy_(torch.cat([m["gate"], m["up"]]))
        else:
            for key in ("q", "k", "v"):
                proj = getattr(attn, f"{key}_proj")
                proj.weight.copy_(w[key])
                if proj.bias is not None:
                    proj.bias.copy_(w[f"{key}_bias"])
            dst.mlp.gate_proj.weight.copy_(m["gate"])
            dst.mlp.up_proj.weight.copy_(m["up"])
        attn.o_proj.weight.copy_(w["o"])
        if attn.o_proj.bias is not None:
            attn.o_proj.bias.copy_(w["o_bias"])
        if family == "qwen3":
            attn.q_norm.weight.copy_(w["q_norm"])
            attn.k_norm.weight.copy_(w["k_norm"])
        dst.mlp.down_proj.weight.copy_(m["down"])
        dst.input_layernorm.weight.fill_(1.0)
        dst.post_attention_layernorm.weight.fill_(1.0)


def to_family(model: nn.Module, target: str, *, tolerance: float = 1e-4, verify_length: int = 16):
    """(the `target` family's causal LM with the same function, ExportReport); `ExportError` in one line for a model
    that does not fit the family's class or fails the logit check (fp32, float64 where rounding misses it)."""
    from .export import ExportError, copy_head, verified_family_report
    from .export_layernorm import LAYERNORM_TARGETS, to_layernorm_family

    if target in LAYERNORM_TARGETS:  # GPT-2, GPT-NeoX: LayerNorms, plain MLP, learned positions or partial rotary
        return to_layernorm_family(model, target, tolerance=tolerance, verify_length=verify_length)
    if target == "gemma3":  # sandwich norms, (1 + w) gains, the embedding scale, sliding-window layers
        from .export_gemma import to_gemma3

        return to_gemma3(model, tolerance=tolerance, verify_length=verify_length)
    if target not in FAMILY_CLASSES:
        raise ExportError(f"--to must be one of {(*FAMILY_CLASSES, *LAYERNORM_TARGETS, 'gemma3')} here, got {target!r}")
    _check_family(model, target)
    c = model.config
    source = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    was_training = source.training
    source.eval()
    with no_init_weights():
        exported = FAMILY_CLASSES[target][1](family_config(c, target))
    exported = exported.float().eval().to(next(source.parameters()).device)
    _copy_layers(source, exported, target)
    with torch.no_grad():
        exported.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
        gain = source.model.norm.weight
        exported.model.norm.weight.copy_(gain if gain is not None else torch.ones_like(exported.model.norm.weight))
        copy_head(source, exported)
    try:
        report = verified_family_report(
            model, source, exported, target, tolerance=tolerance, verify_length=verify_length
        )
    finally:
        source.train(was_training)
    return exported, report


__all__ = ["FAMILY_CLASSES", "family_config", "to_family"]
