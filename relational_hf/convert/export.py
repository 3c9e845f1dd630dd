"""Relational checkpoints -> plain Transformers Llama checkpoints (no plugin, no remote code needed to load them).

A relational model whose shapes fit a standard Llama is written back as `LlamaForCausalLM` with the same function:

- each head's gauge-fixed QK and VO factors are multiplied back out into full W_Q, W_K, W_V, W_O
  (`RelationalAttention.full_weights`), the SwiGLU scales likewise (`RelationalMLP.full_weights`);
- the gain-free norms become RMSNorms with unit gains; a final gain (kept in front of a tied head) becomes Llama's
  final norm weight, an untied head is copied;
- Llama uses one head width D for queries, keys and values. A relational model with QK rank r < d_h ("thin keys")
  is embedded exactly in D = r * ceil(d_h / r): RoPE rotates coordinate pairs (j, j + r/2) at frequency
  theta^(-2j/r), and a Llama head of width D rotates the pair (k, k + D/2) at theta^(-2k/D), so relational pair j
  goes to Llama pair k = j D/r (same frequency), every other query/key coordinate is zero, and W_Q is multiplied by
  sqrt(D/r) to turn Llama's 1/sqrt(D) score scale into the relational 1/sqrt(r). Value coordinates beyond d_h are
  zero in W_V and never read by W_O. The frequencies are checked numerically (any `rope_type`), not assumed;
- a compressed model (per-layer QK and value widths, each key head with its own subset of rotary pairs, per-layer
  SwiGLU widths) is embedded layer by layer the same way: pair j of key head h goes to the Llama pair of the model
  frequency it turns at (`rope_pair_index`), W_Q scaled by sqrt(D/r_l), SwiGLU units padded with zero units up to
  the widest layer. Exact, but the plain checkpoint stores the zeros (about the dense size): it is for loading
  without the plugin, not for the compressed size;
- a sliced model (global principal rotation, smaller d) is a smaller standard Llama as it stands.

Refused, with the reason: value-space parallel removal (a nonlinear per-head edit no Llama layer computes), models
without rotary positions (a Llama always rotates its query/key coordinates), and any tensor a Llama has no place
for (e.g. per-layer shortcut matrices of a per-layer rotation). The result is checked like a conversion: the
logits of the relational and the Llama model on random tokens must agree to `tolerance` in fp32.

`to_free_gauge` writes a relational model in the free gauge instead: the same architecture (per-layer widths, thin
keys, rotary pair subsets all kept, so it loads with the plugin or `trust_remote_code`), with plain full maps that
inference reads as stored, nothing assembled.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights

from ..modeling import RelationalForCausalLM
from ..params import stored_parameters
from .relational import float64_logit_difference, max_logit_difference

logger = logging.getLogger(__name__)

EXPORT_TARGETS = ("llama", "free", "qwen3", "smollm3", "phi3", "gpt2", "gpt_neox", "gemma3")


class ExportError(ValueError):
    """A relational model that has no exact form in the requested architecture, or an export that failed its check."""


def verified_logit_difference(source, exported, config, verify_length: int, tolerance: float) -> tuple[float, float | None]:
    """(max |logit difference| between `source` and `exported` on random ids, the float32 figure it replaced or
    None): when float32 misses `tolerance`, float64 copies tell rounding from a real error, and a float64 figure
    within it is returned instead. One home for the check every export runs before it writes anything."""
    length = min(verify_length, config.max_position_embeddings)
    diff = max_logit_difference(source, exported, vocab_size=config.vocab_size, length=length)
    if not diff <= tolerance:
        again = float64_logit_difference(source, exported, vocab_size=config.vocab_size, length=length)
        if again is not None and again[0] <= tolerance:
            return again[0], diff
    return diff, None


@dataclass
class ExportReport:
    """What `to_llama` wrote and checked: stored parameters before and after (the Llama stores the gauge
    coordinates, the unit norm gains and any zero padding again), the Llama head width, the zero entries added by
    padding a QK rank below the head width, and the measured max |logit difference| (fp32, random tokens)."""

    target: str
    source_parameters: int
    exported_parameters: int
    head_dim: int
    qk_rank: int
    value_head_dim: int
    padding_zeros: int
    max_logit_difference: float
    verified_sequence_length: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        stored_again = "the pivot entries" if self.target == "free" else "gauge coordinates and unit norm gains"
        lines = [
            f"## Export to `{self.target}`",
            "",
            f"- relational parameters: {self.source_parameters:,}; {self.target} parameters: "
            f"{self.exported_parameters:,} ({stored_again} stored again"
            + (f", {self.padding_zeros:,} zeros of padding" if self.padding_zeros else "")
            + ")",
            f"- head width {self.head_dim} (QK rank {self.qk_rank}, value width {self.value_head_dim})"
            if self.target != "free"
            else "- every per-layer width, thin key and rotary pair kept; every map a full Linear",
            f"- max |logit difference| on random tokens (fp32, length {self.verified_sequence_length}): "
            f"{self.max_logit_difference:.3g}",
        ]
        lines += [f"- note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def copy_head(source: nn.Module, exported: nn.Module) -> None:
    """Tie `exported`'s head where the relational config ties it, else copy the head; carry the generation config."""
    if source.config.tie_word_embeddings:
        exported.tie_weights()
    else:
        exported.lm_head.weight.copy_(source.lm_head.weight)
    if getattr(source, "generation_config", None) is not None:
        exported.generation_config = copy.deepcopy(source.generation_config)


def verified_family_report(
    model: nn.Module, source: nn.Module, exported: nn.Module, target: str, *, tolerance: float, verify_length: int,
    padding_zeros: int = 0, notes: list[str] | None = None,
) -> ExportReport:
    """The logit check and the report of an export to a family's own class (`to_family`, `to_layernorm_family`):
    `ExportError` in one line when the logits differ by more than `tolerance`; stored parameters counted once."""
    c = model.config
    diff, rounding = verified_logit_difference(source, exported, c, verify_length, tolerance)
    if not diff <= tolerance:
        raise ExportError(f"exported {target} model's logits differ from the relational model's by {diff:.3g}")
    rounded = [] if rounding is None else [f"float32 logits differed by {rounding:.3g} (rounding); verified in float64: {diff:.3g}"]
    return ExportReport(
        target=target,
        source_parameters=stored_parameters(model)["total"],
        exported_parameters=stored_parameters(exported)["total"],
        head_dim=c.head_dim,
        qk_rank=c.qk_rank,
        value_head_dim=c.head_dim,
        padding_zeros=padding_zeros,
        max_logit_difference=diff,
        verified_sequence_length=min(verify_length, c.max_position_embeddings),
        notes=rounded + list(notes or ()),
    )


def _check_exportable(model: nn.Module) -> None:
    if not isinstance(model, RelationalForCausalLM):
        raise ExportError(
            f"export takes a relational causal LM (RelationalForCausalLM), got {type(model).__name__}; "
            "a standard checkpoint needs no export"
        )
    c = model.config
    if c.value_parallel_removal:
        raise ExportError(
            "value_parallel_removal=True has no Llama equivalent: removing the part of each head's output parallel "
            "to the token's own value is a nonlinear edit no Llama layer computes"
        )
    if c.position_encoding != "rope":
        raise ExportError(
            f"position_encoding={c.position_encoding!r} has no Llama equivalent: a Llama rotates every query/key "
            "coordinate with RoPE"
        )
    from .layernorm import unexported_option

    if unexported_option(c) is not None:
        raise ExportError(unexported_option(c))
    if c.qk_norm:
        raise ExportError("qk_norm=True (per-head QK-norm) has no Llama equivalent: export --to qwen3 holds it")
    if c.rope_layers is not None and not all(c.rope_layers):
        raise ExportError("layers without rotary (rope_layers) have no Llama equivalent: export --to smollm3 holds them")
    with torch.device("meta"), no_init_weights():
        reference = RelationalForCausalLM(copy.deepcopy(c))
    expected = set(reference.state_dict())
    present = set(model.state_dict())
    extra, missing = sorted(present - expected), sorted(expected - present)
    if extra or missing:
        raise ExportError(
            "the model holds tensors a standard relational model (and so a Llama) has no place for"
            + (f": extra {extra[:5]}" if extra else "")
            + (f", missing {missing[:5]}" if missing else "")
        )


def llama_head_dim(qk_rank: int, head_dim: int) -> int:
    """The Llama head width D that holds a QK form of rank r and a value width d_h exactly: the smallest multiple of
    r that is >= d_h (each relational RoPE pair j lands on the Llama pair j D/r of the same frequency)."""
    return qk_rank * math.ceil(head_dim / qk_rank)


def llama_config_for(model: RelationalForCausalLM) -> LlamaConfig:
    """The LlamaConfig that holds `model` exactly (see the module docstring)."""
    c = model.config
    width = llama_head_dim(c.qk_rank, c.head_dim)
    d_ff = max(layer.mlp.gate_proj.out_features for layer in model.model.layers)
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=d_ff,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=width,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=copy.deepcopy(dict(c.rope_parameters)),
        attention_bias=bool(c.attention_bias or c.attention_output_bias),
        attention_dropout=c.attention_dropout,
        mlp_bias=False,
        tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        dtype="float32",
    )


def _check_rotary(model: RelationalForCausalLM, llama: LlamaForCausalLM) -> None:
    """The Llama pair j D/r must rotate at the relational pair j's frequency, with the same attention scaling."""
    c = model.config
    rel = model.model.rotary_emb
    ref = llama.model.rotary_emb
    width = llama.config.head_dim
    m = width // c.qk_rank
    picked = ref.inv_freq[torch.arange(c.qk_rank // 2) * m].double()
    mine = rel.inv_freq.double()
    if not torch.allclose(picked, mine, rtol=1e-6, atol=0.0) or not math.isclose(
        float(ref.attention_scaling), float(rel.attention_scaling), rel_tol=1e-6
    ):
        raise ExportError(
            f"rope_parameters {dict(c.rope_parameters)} with qk_rank {c.qk_rank} < Llama head width {width}: the "
            "Llama rotary frequencies do not contain the relational ones, so no exact Llama form exists"
        )


@torch.no_grad()
def _pad_heads(w: torch.Tensor, heads: int, width: int, coords: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rows of a per-head (heads * e, ...) tensor placed at `coords` inside heads of `width` (zeros elsewhere);
    coords (e,) for every head alike or (heads, e), one row of places per head."""
    coords = coords.to(w.device).expand(heads, -1)
    e = coords.shape[1]
    src = w.double().reshape(heads, e, *w.shape[1:]) * scale
    out = torch.zeros(heads, width, *w.shape[1:], dtype=torch.float64, device=w.device)
    out[torch.arange(heads, device=w.device)[:, None], coords] = src
    return out.reshape(heads * width, *w.shape[1:])


def _layer_qk_coordinates(attn: nn.Module, model_rank: int, width: int) -> torch.Tensor:
    """(H_kv, r_l) Llama coordinates of one layer's QK coordinates, per key head: relational pair j of key head h turns
    at the model's frequency pair p = rope_pair_index[h, j] (p = j without that buffer); the Llama head of width D
    holds pair p at coordinates (p m, p m + D/2), m = D / qk_rank, which rotate at that pair's frequency."""
    pairs = getattr(attn, "rope_pair_index", None)
    if pairs is None:
        pairs = torch.arange(attn.qk_rank // 2).expand(attn.num_kv_heads, -1)
    pairs = pairs.long().cpu() * (width // model_rank)
    return torch.cat([pairs, pairs + width // 2], dim=-1)


@torch.no_grad()
def to_llama(
    model: nn.Module, *, tolerance: float = 1e-4, verify_length: int = 16, return_report: bool = False
) -> LlamaForCausalLM | tuple[LlamaForCausalLM, ExportReport]:
    """A `LlamaForCausalLM` (fp32, eval mode) computing the same function as the relational causal LM `model`.

    Full factors W_Q, W_K, W_V, W_O and the SwiGLU maps are multiplied back out of the gauge-fixed storage; QK ranks
    below the head width are embedded by RoPE pair (module docstring); unit gains on the layer norms; the final gain
    (if any) on Llama's final norm. Raises `ExportError` for models with no exact Llama form, and when the logits
    on random tokens differ by more than `tolerance` (fp32; float64 copies decide where fp32 rounding misses it). `return_report=True` returns (llama, ExportReport).
    """
    _check_exportable(model)
    c = model.config
    source = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    was_training = source.training
    source.eval()
    config = llama_config_for(source)
    with no_init_weights():
        llama = LlamaForCausalLM(config)
    llama = llama.float().eval().to(next(source.parameters()).device)
    _check_rotary(source, llama)
    width, rank, dh = config.head_dim, c.qk_rank, c.head_dim
    h, h_kv = c.num_attention_heads, c.num_key_value_heads
    zeros_added = 0
    for src_layer, dst_layer in zip(source.model.layers, llama.model.layers, strict=True):
        # each layer's own widths (a compressed model's differ from layer to layer, and its key heads keep their own
        # rotary pairs): the layer's QK scaling r_l^-1/2 becomes Llama's D^-1/2 through W_Q
        rank_l, dh_l = src_layer.self_attn.qk_rank, src_layer.self_attn.head_dim
        k_coords = _layer_qk_coordinates(src_layer.self_attn, rank, width)
        qk = k_coords.repeat_interleave(h // h_kv, dim=0)
        vo = torch.arange(dh_l)
        q_scale = math.sqrt(width / rank_l)
        w = src_layer.self_attn.full_weights()
        attn = dst_layer.self_attn
        attn.q_proj.weight.copy_(_pad_heads(w["q"], h, width, qk, q_scale))
        attn.k_proj.weight.copy_(_pad_heads(w["k"], h_kv, width, k_coords))
        attn.v_proj.weight.copy_(_pad_heads(w["v"], h_kv, width, vo))
        o = w["o"].double().T  # (H d_h, d): rows per head, like the readers
        attn.o_proj.weight.copy_(_pad_heads(o, h, width, vo).T)
        for key, name, heads, coords, scale in (
            ("q_bias", "q_proj", h, qk, q_scale),
            ("k_bias", "k_proj", h_kv, k_coords, 1.0),
            ("v_bias", "v_proj", h_kv, vo, 1.0),
        ):
            bias = getattr(attn, name).bias
            if bias is not None:
                value = w.get(key)
                if value is None:
                    bias.zero_()
                else:
                    bias.copy_(_pad_heads(value, heads, width, coords, scale))
        if attn.o_proj.bias is not None:
            attn.o_proj.bias.copy_(w["o_bias"] if "o_bias" in w else torch.zeros_like(attn.o_proj.bias))
        mlp = src_layer.mlp.full_weights()
        f = mlp["gate"].shape[0]
        dst_mlp = dst_layer.mlp
        dst_mlp.gate_proj.weight.zero_()
        dst_mlp.up_proj.weight.zero_()
        dst_mlp.down_proj.weight.zero_()
        dst_mlp.gate_proj.weight[:f].copy_(mlp["gate"])
        dst_mlp.up_proj.weight[:f].copy_(mlp["up"])
        dst_mlp.down_proj.weight[:, :f].copy_(mlp["down"])
        dst_layer.input_layernorm.weight.fill_(1.0)
        dst_layer.post_attention_layernorm.weight.fill_(1.0)
        zeros_added += (config.intermediate_size - f) * 3 * c.hidden_size
        zeros_added += c.hidden_size * ((h + h_kv) * (width - rank_l) + (h_kv + h) * (width - dh_l))
    llama.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
    gain = source.model.norm.weight
    llama.model.norm.weight.copy_(gain if gain is not None else torch.ones_like(llama.model.norm.weight))
    copy_head(source, llama)
    diff, rounding = verified_logit_difference(source, llama, c, verify_length, tolerance)
    source.train(was_training)
    report = ExportReport(
        target="llama",
        source_parameters=sum(p.numel() for p in model.parameters()),
        exported_parameters=sum(p.numel() for p in llama.parameters()),
        head_dim=width,
        qk_rank=rank,
        value_head_dim=dh,
        padding_zeros=zeros_added,
        max_logit_difference=diff,
        verified_sequence_length=min(verify_length, c.max_position_embeddings),
    )
    if rank < width:
        report.notes.append(
            f"QK rank {rank} < head width {width}: query/key heads padded with zeros (RoPE pairs kept), W_Q "
            f"scaled by sqrt({width}/{rank})"
        )
    if any(getattr(c, f) is not None for f in ("layer_qk_ranks", "layer_value_ranks", "layer_intermediate_sizes")):
        report.notes.append(
            f"per-layer widths (a compressed model): every layer padded with zeros to Llama's uniform widths (head "
            f"{width}, d_ff {config.intermediate_size}); the plain checkpoint stores {zeros_added:,} zeros more"
        )
    if rounding is not None:
        report.notes.append(f"float32 logits differed by {rounding:.3g} (rounding); verified in float64: {diff:.3g}")
    if not diff <= tolerance:
        raise ExportError(f"exported Llama's logits differ from the relational model's by {diff:.3g} > {tolerance:g}")
    logger.info("exported to Llama: %s parameters, max logit difference %.3g", f"{report.exported_parameters:,}", diff)
    return (llama, report) if return_report else llama


def to_free_gauge(
    model: nn.Module, *, tolerance: float = 1e-4, verify_length: int = 16, return_report: bool = False
) -> RelationalForCausalLM | tuple[RelationalForCausalLM, ExportReport]:
    """The relational causal LM `model` in the free gauge (`RelationalConfig.gauge = "free"`, fp32, eval mode): the
    same architecture and widths, every map a plain `nn.Linear` holding the full weight it computes with
    (`full_weights`), so inference reads the weights as they are stored. A pivot-gauge map assembles its full weight
    from its free entries: once per `generate()` call inside `weight_cache`, at every call outside it. The free-gauge
    model stores the pivot entries again (0.3% of SmolLM2's parameters), and fine-tuning it leaves the gauge free.
    Checked like `to_llama` (logits on random tokens within `tolerance`, fp32, float64 where rounding misses it);
    `return_report=True` returns (model, ExportReport)."""
    if not isinstance(model, RelationalForCausalLM):
        raise ExportError(f"the free gauge is a form of a relational causal LM, got {type(model).__name__}")
    c = model.config
    source = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    was_training = source.training
    source.eval()
    config = copy.deepcopy(c)
    config.gauge = "free"
    with no_init_weights():
        free = RelationalForCausalLM(config)
    free = free.float().eval().to(next(source.parameters()).device)
    target = free.state_dict()  # everything outside the decoder maps (embedding, gains, head, rotary pairs) as is
    free.load_state_dict(
        {k: v for k, v in source.state_dict().items() if k in target and target[k].shape == v.shape}, strict=False
    )
    with torch.no_grad():
        for src_layer, dst_layer in zip(source.model.layers, free.model.layers, strict=True):
            dst_layer.self_attn.set_full_weights(src_layer.self_attn.full_weights())
            dst_layer.mlp.set_full_weights(src_layer.mlp.full_weights())
    if c.tie_word_embeddings:
        free.tie_weights()
    if getattr(source, "generation_config", None) is not None:
        free.generation_config = copy.deepcopy(source.generation_config)
    diff, rounding = verified_logit_difference(source, free, c, verify_length, tolerance)
    notes = [] if rounding is None else [f"float32 logits differed by {rounding:.3g} (rounding); verified in float64: {diff:.3g}"]
    source.train(was_training)
    if not diff <= tolerance:
        raise ExportError(f"the free-gauge model's logits differ from the relational model's by {diff:.3g} > {tolerance:g}")
    report = ExportReport(
        target="free",
        source_parameters=stored_parameters(model)["total"],
        exported_parameters=stored_parameters(free)["total"],
        head_dim=c.head_dim,
        qk_rank=c.qk_rank,
        value_head_dim=c.head_dim,
        padding_zeros=0,
        max_logit_difference=diff,
        verified_sequence_length=min(verify_length, c.max_position_embeddings),
        notes=notes,
    )
    logger.info("free gauge: %s parameters, max logit difference %.3g", f"{report.exported_parameters:,}", diff)
    return (free, report) if return_report else free


def export_checkpoint(
    model: nn.Module,
    out: str | os.PathLike,
    *,
    to: str = "llama",
    tokenizer=None,
    tolerance: float = 1e-4,
    lock=None,
) -> ExportReport:
    """Export `model` (`to_llama`, `to_free_gauge` for `to="free"`, `export_families.to_family` for "qwen3",
    "smollm3", "phi3", "gpt2", "gpt_neox", "gemma3") and write it to the new or empty folder `out`
    with `tokenizer` (if given)
    and `export_report.json`, through `relational_hf.outputs.write_new_output` (staged beside, moved into place when
    complete; `lock`: the caller's `OutputLock` on `out`): an interrupted export leaves nothing that looks like a
    checkpoint; a non-empty `out` is refused before any work."""
    from ..outputs import check_new_output, save_tokenizer, write_new_output

    if to not in EXPORT_TARGETS:
        raise ExportError(f"--to must be one of {EXPORT_TARGETS}, got {to!r}")
    check_new_output(out, "OUT")
    if to in ("llama", "free"):
        convert = to_free_gauge if to == "free" else to_llama
        exported, report = convert(model, tolerance=tolerance, return_report=True)
    else:
        from .export_families import to_family

        exported, report = to_family(model, to, tolerance=tolerance)

    def write(folder: Path) -> None:
        exported.save_pretrained(folder)
        if tokenizer is not None:
            save_tokenizer(tokenizer, folder)
        (folder / "export_report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")

    write_new_output(out, write, command="export", kind=to, lock=lock)
    return report


__all__ = [
    "EXPORT_TARGETS",
    "ExportError",
    "ExportReport",
    "export_checkpoint",
    "llama_config_for",
    "llama_head_dim",
    "to_free_gauge",
    "to_llama",
]
