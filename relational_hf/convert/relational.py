"""Exact conversion of Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3: `convert.families`)
into relational models in the pivot gauge.

Steps (DESIGN.md 2.2, 4): fold every RMSNorm gain into the maps that read it (q/k/v, gate/up, the head), keep the
gain-free norms, then let the relational modules move each QK pair, VO pair and SwiGLU to the pivot gauge
(`RelationalAttention.set_full_weights`, `RelationalMLP.set_full_weights`). The function is unchanged, so the
converter checks it: logits of source and result on random tokens must agree to `tolerance` (fp32), otherwise
`ConversionError`. The stored parameter count drops by exactly the orbit dimensions of the fixed groups
(QK RoPE commutant: r per key head, VO GL(d_h): d_h^2 per key/value head, SwiGLU scales: d_ff per layer) relative
to the source minus its folded norm gains: every layer's gains fold into their readers, and the final gain folds
into an untied head; in front of a tied head it is kept (`RelationalConfig.final_norm_gain`, d values), because it
cannot fold into a matrix that is also the input embedding.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers.initialization import no_init_weights

from ..architectures import get_adapter
from ..compress.slicing import SliceReport, slice_relational
from ..lm.metrics import perplexity
from ..modeling import RelationalConfig, RelationalForCausalLM
from ..symmetry.groups import symmetry_groups
from .families import check_convertible, fixed_groups, relational_options
from .gemma import (
    GEMMA_NOTE,
    NOT_COMPRESSED,
    OUTPUT_GAINS,
    check_gemma_convertible,
    gemma_layer_tensors,
    gemma_options,
    is_gemma_family,
    load_output_gains,
    norm_gain,
)
from .layernorm import (
    LAYERNORM_NOTE,
    MLP_ROLES,
    fold_layernorm_layer,
    is_layernorm_family,
    layernorm_config,
    layernorm_layer_tensors,
    load_layernorm_ends,
    norm_parameters,
    remaining_after_folding,
)
from .preflight import ConversionError, check_pivot_gauge_exists

logger = logging.getLogger(__name__)


@dataclass
class ConversionReport:
    """What `to_relational` produced and checked (`kept_final_gain`: the d final-norm gain values kept in front of a
    tied head, 0 when the head is untied and the gain is folded into it). The exactness check: max |logit
    difference| (fp32; float64 copies where fp32 rounding missed the tolerance: `verified_in`) on `verified_on`
    (random tokens, or real text), `logit_scale` = max(1, max |source logit|), and `relative_logit_difference` =
    their ratio, which must be <= `tolerance`."""

    source_class: str
    source_parameters: int
    source_norm_gain_parameters: int
    removed_orbit_dimensions: dict[str, int]
    relational_parameters: int
    max_logit_difference: float
    verified_sequence_length: int
    kept_final_gain: int = 0
    logit_scale: float = 1.0
    relative_logit_difference: float = 0.0
    tolerance: float = 1e-4
    verified_on: str = "random tokens"
    verified_in: str = "float32"  # "float64" when float32 rounding alone exceeded the tolerance (`to_relational`)
    remaining_symmetries: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    slicing: SliceReport | None = None

    @property
    def expected_parameters(self) -> int:
        """source - norm gains - removed orbit dimensions + the final gain kept in front of a tied head."""
        removed = sum(self.removed_orbit_dimensions.values())
        return self.source_parameters - self.source_norm_gain_parameters - removed + self.kept_final_gain

    def to_dict(self) -> dict:
        out = asdict(self)
        out["expected_parameters"] = self.expected_parameters
        return out

    def to_markdown(self) -> str:
        removed = sum(self.removed_orbit_dimensions.values())
        lines = [
            f"## Conversion of `{self.source_class}` to the relational pivot gauge",
            "",
            f"- source parameters: {self.source_parameters:,} (norm gains {self.source_norm_gain_parameters:,})",
            f"- orbit dimensions removed: {removed:,} ("
            + ", ".join(f"{k} {v:,}" for k, v in self.removed_orbit_dimensions.items())
            + ")",
            f"- relational parameters: {self.relational_parameters:,}"
            + (
                f" ({self.kept_final_gain:,} final norm parameters kept in front of the head)"
                if self.kept_final_gain
                else ""
            ),
            f"- max |logit difference| on {self.verified_on} (fp32, length {self.verified_sequence_length}): "
            f"{self.max_logit_difference:.3g} = {self.relative_logit_difference:.3g} x scale "
            f"{self.logit_scale:.3g} (tolerance {self.tolerance:g} x scale; scale = max(1, max |output|))",
        ]
        if self.remaining_symmetries:
            lines.append("- symmetries left: " + ", ".join(f"{k} {v:,}" for k, v in self.remaining_symmetries.items()))
        if self.slicing is not None:
            lines += ["", self.slicing.to_markdown()]
        lines += [f"- note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


class PhaseTimes(dict):
    """Seconds spent per named phase of a conversion (wall clock, summed over the layers): `with times("fold"): ...`
    adds the block's duration to times["fold"]. The converters take one to say where their time goes."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - start


def _sliding_window(config) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return getattr(config, "sliding_window", None) if "sliding_attention" in layer_types else None
    return getattr(config, "sliding_window", None)


def _token_id(value, vocab: int):
    values = value if isinstance(value, list) else [value]
    if all(v is None or 0 <= v < vocab for v in values):
        return value
    return None


def relational_config_for(model: nn.Module, *, tie: bool, pivot_scale: float | None = None) -> RelationalConfig:
    """The RelationalConfig (pivot gauge, RoPE, full qk_rank, the family's options: `families.relational_options`)
    that represents a gain-folded Llama-family `model` (a LayerNorm family: `layernorm.layernorm_config`)."""
    if is_layernorm_family(model):
        return layernorm_config(model, tie=tie, pivot_scale=pivot_scale)
    adapter = get_adapter(model)
    c = model.config
    slots = adapter.attention_slots(adapter.layers()[0])
    vocab = c.vocab_size
    rope = copy.deepcopy(dict(c.rope_parameters))
    if rope.get("rope_type") == "longrope":  # Phi-3: the factors switch at the pretraining length, in both models
        rope.setdefault("original_max_position_embeddings", getattr(c, "original_max_position_embeddings", None))
    options = relational_options(model) | (gemma_options(model) if is_gemma_family(model) else {})
    options.setdefault("rope_parameters", rope)
    options.setdefault("hidden_act", getattr(c, "hidden_act", None))
    return RelationalConfig(
        **options,
        vocab_size=vocab,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=adapter.num_heads(),
        num_key_value_heads=adapter.num_kv_heads(),
        head_dim=adapter.head_dim(),
        qk_rank=adapter.head_dim(),
        position_encoding="rope",
        max_position_embeddings=c.max_position_embeddings,
        gauge="pivot",
        pivot_scale=pivot_scale,
        attention_bias=slots.q_bias is not None,
        attention_output_bias=slots.o_bias is not None,
        tie_word_embeddings=tie,
        final_norm_gain=tie,
        initializer_range=getattr(c, "initializer_range", 0.02),
        rms_norm_eps=c.rms_norm_eps,
        pad_token_id=_token_id(getattr(c, "pad_token_id", None), vocab),
        bos_token_id=_token_id(getattr(c, "bos_token_id", None), vocab),
        eos_token_id=_token_id(getattr(c, "eos_token_id", None), vocab),
    )


def _check_supported(model: nn.Module, *, slicing: bool = False) -> None:
    if is_gemma_family(model):  # Gemma 3 (`convert.gemma`); not sliced yet
        check_gemma_convertible(model)
        if slicing:
            raise ConversionError(f"slicing {type(model).__name__}: {NOT_COMPRESSED}; convert it without --slice")
        return
    check_convertible(model)


def _new_relational(config: RelationalConfig) -> RelationalForCausalLM:
    """A relational model whose weights are all about to be overwritten (no random initialisation)."""
    with no_init_weights():
        model = RelationalForCausalLM(config)
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.float().eval()


#: The tensors of one Llama-family decoder layer by role, in nn.Linear layout (out x in): attention factors and
#: biases (biases may be None), the two RMSNorm gains, and the SwiGLU maps. One home for the per-layer conversion:
#: the in-memory converter and the streaming one (`relational_hf.convert.streaming`) both fill this dict.
LAYER_ROLES = (
    "q",
    "k",
    "v",
    "o",
    "q_bias",
    "k_bias",
    "v_bias",
    "o_bias",
    "attention_gain",
    "gate",
    "up",
    "down",
    "mlp_gain",
)


_MLP_ROLES = ("gate", "up", "down", "mlp_gain", *MLP_ROLES)


def source_layer_tensors(adapter, layer) -> dict[str, torch.Tensor | None]:
    """The tensors of `layer` (a LayerRoles of a Llama-family adapter) by role (`LAYER_ROLES`), detached, in the
    model's own dtype and device (no copy). A LayerNorm family: `layernorm.layernorm_layer_tensors`."""
    if is_layernorm_family(adapter.model):
        return layernorm_layer_tensors(adapter.model, layer)
    if is_gemma_family(adapter.model):
        return gemma_layer_tensors(adapter.model, layer)
    w = adapter.attention_weights(layer)
    mlp = adapter.mlp_slots(layer)
    slots = adapter.attention_slots(layer)
    norms = {} if slots.q_norm is None else {"q_norm": slots.q_norm.get(), "k_norm": slots.k_norm.get()}
    return {
        **norms,
        **w.roles(),
        "attention_gain": layer.attention_norm.weight.detach(),
        "gate": mlp.gate.get(),
        "up": mlp.up.get(),
        "down": mlp.down.get(),
        "mlp_gain": layer.mlp_norm.weight.detach(),
    }


def _times_gain(w: torch.Tensor, gain: torch.Tensor, in_place: bool) -> torch.Tensor:
    """W diag(g) in fp32 from a weight in any floating dtype: one new tensor (the cast, multiplied in place), or,
    with `in_place` and an fp32 W, W itself multiplied in place."""
    out = w.float()
    return out.mul_(gain) if out is not w or in_place else out * gain


@torch.no_grad()
def fold_layer_gains(
    tensors: dict[str, torch.Tensor | None], in_place: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Fold one layer's RMSNorm gains into their readers: W_Q, W_K, W_V -> W diag(g_attn), W_gate, W_up ->
    W diag(g_mlp). Returns the (attention, mlp) full weights in fp32 for `RelationalAttention.set_full_weights` /
    `RelationalMLP.set_full_weights`; a half whose tensors are not in `tensors` comes back empty. The products are
    taken in fp32 and are exactly the float64 products rounded to fp32: weights and gains in fp32, bf16 or fp16 are
    exact in fp32, their exact product fits a float64 (48 significant bits, no overflow or underflow), so both ways
    round the exact product once (IEEE multiplication is correctly rounded). `in_place`: the caller's fp32 tensors
    may be overwritten (they are the caller's to give away, as in the streaming converter); otherwise no tensor of
    `tensors` is changed. A LayerNorm family's tensors (with the norms' biases): `layernorm.fold_layernorm_layer`."""
    if "attention_norm_bias" in tensors or "mlp_norm_bias" in tensors:
        return fold_layernorm_layer(tensors)
    attention, mlp = {}, {}
    if "q" in tensors:
        g_attn = tensors["attention_gain"].float()
        for key in ("q", "k", "v"):
            attention[key] = _times_gain(tensors[key], g_attn, in_place)
        attention["o"] = tensors["o"].float()
        for key in ("q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm"):
            if tensors.get(key) is not None:
                attention[key] = tensors[key].float()
    if "up" in tensors:
        g_mlp = tensors["mlp_gain"].float()
        mlp = {
            "gate": _times_gain(tensors["gate"], g_mlp, in_place),
            "up": _times_gain(tensors["up"], g_mlp, in_place),
            "down": tensors["down"].float(),
        }
    return attention, mlp


@torch.no_grad()
def convert_layer(
    target: nn.Module,
    tensors: dict[str, torch.Tensor | None],
    times: PhaseTimes | None = None,
    *,
    consume: bool = False,
) -> None:
    """Load one source layer (`LAYER_ROLES` tensors) into a `RelationalDecoderLayer` `target`: gains folded
    (`fold_layer_gains`), then QK pairs, VO pairs and SwiGLU scales moved to the target's gauge by its own
    `set_full_weights`. The layer computes the same map as the source layer (its norms are gain-free). The dict
    `tensors` is emptied (memory: its tensors are dropped as soon as they are converted); with `consume` its fp32
    tensors are also overwritten (folded in place: the caller gives them away). `times` (optional) receives the
    seconds of the phases "fold", "gauge_attention" and "gauge_mlp" (pivot selection, the gauge maps and storing
    the free entries)."""
    times = times if times is not None else PhaseTimes()
    load_output_gains(target, {k: tensors.pop(k) for k in OUTPUT_GAINS if k in tensors})  # sandwich norms (Gemma 3)
    # one half at a time, and `tensors` is emptied as it is used: a caller that holds no other reference (the
    # streaming converter) keeps only what is still to be converted in memory
    part = {k: tensors.pop(k) for k in list(tensors) if k not in _MLP_ROLES}
    with times("fold"):
        attention = fold_layer_gains(part, in_place=consume)[0]
    del part
    with times("gauge_attention"):
        target.self_attn.set_full_weights(attention)
    del attention
    part = {k: tensors.pop(k) for k in list(tensors)}
    with times("fold"):
        mlp = fold_layer_gains(part, in_place=consume)[1]
    del part
    with times("gauge_mlp"):
        target.mlp.set_full_weights(mlp)


@torch.no_grad()
def fold_head(head: torch.Tensor, final_gain: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W_head diag(g_final) (products in float64), returned in `dtype`: the final norm gain folded into an untied
    head. Row blocks of `head` may be folded separately (the result is elementwise)."""
    return (head.double() * final_gain.double()).to(dtype)


@torch.no_grad()
def _fold_and_load(source: nn.Module, target: RelationalForCausalLM) -> None:
    src, dst = get_adapter(source), get_adapter(target)
    for ls, ld in zip(src.layers(), dst.layers(), strict=True):
        convert_layer(ld.block, source_layer_tensors(src, ls))
    if is_layernorm_family(source):
        load_layernorm_ends(source, target)
        return
    dst.embedding().weight.copy_(src.embedding().weight.float())
    g_final = norm_gain(src, src.final_norm())  # 1 + w for Gemma 3
    if target.config.tie_word_embeddings:
        target.model.norm.weight.copy_(g_final.float())
    else:
        target.lm_head.weight.copy_(fold_head(src.output_head().weight, g_final))


def relative_difference(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float, float]:
    """(max |a - b|, scale, max |a - b| / scale) with scale = max(1, max |a|): the error measured against the size
    of the outputs, so that a check means the same for logits of size 1 and of size 30 (float32 rounding grows with
    the magnitude of what is computed)."""
    diff = float((reference.float() - other.float()).abs().max())
    scale = max(1.0, float(reference.float().abs().max()))
    return diff, scale, diff / scale


@torch.no_grad()
def logit_difference(
    a: nn.Module,
    b: nn.Module,
    *,
    vocab_size: int,
    length: int,
    batch: int = 2,
    seed: int = 0,
    input_ids: torch.Tensor | None = None,
) -> tuple[float, float, float]:
    """`relative_difference` of the logits of `a` (reference) and `b` on `input_ids` (N, T) when given (e.g. real
    text), else on random token ids (batch x length); both models run on a's device."""
    if input_ids is None:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab_size, (batch, length), generator=generator)
    device = next(a.parameters()).device
    ids = input_ids.to(device)
    return relative_difference(a(ids).logits, b(ids).logits)


def float64_logit_difference(
    source: nn.Module, target: nn.Module, *, vocab_size: int, length: int, ids: torch.Tensor | None = None
) -> tuple[float, float, float] | None:
    """`logit_difference` of float64 copies of both models (the same ids), or None when the copies do not fit in
    memory. Float32 rounding, which some inputs amplify through the depth of a model (on SmolLM2, 1.4e-4 of the logit
    scale on the default random tokens in some processes, 3e-6 in others), no longer counts; a real error does."""
    try:
        a, b = copy.deepcopy(source).double(), copy.deepcopy(target).double()
    except (MemoryError, RuntimeError):
        return None
    try:
        return logit_difference(a, b, vocab_size=vocab_size, length=length, input_ids=ids)
    finally:
        del a, b


@torch.no_grad()
def max_logit_difference(
    a: nn.Module, b: nn.Module, *, vocab_size: int, length: int, batch: int = 2, seed: int = 0
) -> float:
    """max |logits_a - logits_b| on random token ids (batch x length), both models in fp32 on a's device."""
    return logit_difference(a, b, vocab_size=vocab_size, length=length, batch=batch, seed=seed)[0]


def to_relational(
    model: nn.Module,
    slice_fraction: float = 0.0,
    calibration_data: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    eval_data: torch.Tensor | Sequence[torch.Tensor] | None = None,
    pivot_scale: float | None = None,
    tolerance: float = 1e-4,
    verify_length: int = 64,
    verify_data: torch.Tensor | None = None,
    return_report: bool = False,
):
    """Convert a Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 / Phi-3 causal LM into a `RelationalForCausalLM` in the
    pivot gauge (what each family needs and what stays free: `relational_hf.convert.families`).

    Exact stage: norm gains folded into their readers (W diag(g)), QK pairs (RoPE, any rope_parameters, GQA, q/k/v
    biases), VO pairs and SwiGLU scales moved to the pivot gauge; the final norm gain folds into an untied head and
    is kept in front of a tied one (`final_norm_gain`). The converter verifies, in fp32, max |logit difference| <=
    `tolerance` x max(1, max |logit|) (relative to the logit scale: float32 rounding grows with depth, length and
    the size of the logits; 1.1e-4 absolute on 512 real tokens of SmolLM2, whose logits reach about 20; where fp32
    misses the tolerance, float64 copies of both models decide, `report.verified_in`) on
    `verify_data` (token ids (N, T), e.g. real text; the first 4 rows are used) or else on 2 random sequences of
    `verify_length` tokens, and that the stored parameters are exactly source - norm gains - orbit dimensions
    (+ d for a kept final gain), raising `ConversionError` otherwise. A bf16 / fp16 source is checked on fp32
    copies: the check measures the conversion, not the rounding of a low-precision copy.

    `slice_fraction` > 0: principal gauge of the residual stream from `calibration_data` (token ids (N, T) or a list
    of (T,) / (1, T) tensors), then the lowest-variance fraction of the d directions is dropped (SliceGPT-style,
    one rotation for the whole stream); with `eval_data` the report gives the perplexity before and after.
    The result is fp32 and in eval mode. `return_report=True` returns (model, ConversionReport); the report is
    also stored as `model.conversion_report`. Mistral's sliding window is not represented (the relational model
    attends to the full context): a warning is issued and the check runs on sequences inside the window.
    """
    _check_supported(model, slicing=slice_fraction > 0)

    check_pivot_gauge_exists(model)  # names the layer and head of a rank-deficient block
    if not 0.0 <= slice_fraction < 1.0:
        raise ValueError(f"slice_fraction must be in [0, 1), got {slice_fraction}")
    if slice_fraction > 0 and is_layernorm_family(model):
        raise ConversionError(
            f"slicing {type(model).__name__}: principal-gauge slicing of a converted LayerNorm model (a plain MLP "
            "with biases; GPT-2's learned positions and input centring) is not supported yet; convert it without --slice"
        )
    if slice_fraction > 0 and calibration_data is None:
        raise ValueError("slice_fraction > 0 needs calibration_data (token ids) for the principal gauge")
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0 (relative to the logit scale), got {tolerance}")
    if verify_length < 1:
        raise ValueError(f"verify_length must be >= 1, got {verify_length}")
    if verify_data is not None:
        if not isinstance(verify_data, torch.Tensor) or verify_data.dtype != torch.long or verify_data.ndim != 2:
            raise ValueError("verify_data must be a (N, T) long tensor of token ids")
        if verify_data.numel() and not 0 <= int(verify_data.min()) <= int(verify_data.max()) < model.config.vocab_size:
            raise ValueError(f"verify_data holds token ids outside [0, {model.config.vocab_size})")
    adapter = get_adapter(model)
    notes = []
    window = None if is_gemma_family(model) else _sliding_window(model.config)  # Gemma 3's windows are held
    length = verify_length
    if verify_data is not None:
        verify_data = verify_data[:4]
        length = verify_data.shape[1]
    if window is not None:
        length = min(length, window)
        if verify_data is not None:
            verify_data = verify_data[:, :length]
        message = (
            f"{type(model).__name__} uses sliding-window attention (window {window}); the relational model "
            f"attends to the full context, so the two agree only on sequences of at most {window} tokens"
        )
        warnings.warn(message, stacklevel=2)
        notes.append(message)

    source = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    source_was_training = source.training
    source.eval()
    tie = adapter.head_tied()
    if is_layernorm_family(model) or is_gemma_family(model):
        notes.append(LAYERNORM_NOTE if is_layernorm_family(model) else GEMMA_NOTE)
    target = _new_relational(relational_config_for(model, tie=tie, pivot_scale=pivot_scale))
    target.to(next(source.parameters()).device)
    _fold_and_load(source, target)

    groups, _ = symmetry_groups(model)
    removed: dict[str, int] = {}
    remaining: dict[str, int] = {}
    fixed = fixed_groups(model)
    for g in groups:
        bucket = removed if g.name in fixed else remaining
        bucket[g.name] = bucket.get(g.name, 0) + g.dimension()
    remaining = remaining_after_folding(model, remaining)  # no gain, bias or centring left in the relational norms
    gains, kept = norm_parameters(model, tie)
    diff, scale, relative = logit_difference(
        source, target, vocab_size=model.config.vocab_size, length=length, input_ids=verify_data
    )
    precision = "float32"
    if not relative <= tolerance:  # float32 rounding or a real error: float64 copies tell them apart
        vocab = model.config.vocab_size
        again = float64_logit_difference(source, target, vocab_size=vocab, length=length, ids=verify_data)
        if again is not None and again[2] <= tolerance:
            notes.append(
                f"float32 logits differed by {relative:.3g} x the logit scale on these inputs (rounding); verified in "
                f"float64: {again[2]:.3g}"
            )
            (diff, scale, relative), precision = again, "float64"
    source.train(source_was_training)
    report = ConversionReport(
        source_class=type(model).__name__,
        source_parameters=sum(p.numel() for p in model.parameters()),
        source_norm_gain_parameters=gains,
        removed_orbit_dimensions=removed,
        relational_parameters=sum(p.numel() for p in target.parameters()),
        max_logit_difference=diff,
        verified_sequence_length=length,
        logit_scale=scale,
        relative_logit_difference=relative,
        tolerance=tolerance,
        verified_on="random tokens" if verify_data is None else "the given text",
        verified_in=precision,
        remaining_symmetries=remaining,
        notes=notes,
        kept_final_gain=kept,
    )
    if not relative <= tolerance:
        raise ConversionError(
            f"converted model's logits differ from the source's by {diff:.3g} = {relative:.3g} x the logit scale "
            f"{scale:.3g} > tolerance {tolerance:g}"
        )
    if report.relational_parameters != report.expected_parameters:
        raise ConversionError(
            f"converted model stores {report.relational_parameters:,} parameters, expected {report.expected_parameters:,}"
        )
    logger.info(
        "converted %s: %s parameters -> %s, max logit difference %.3g",
        report.source_class,
        f"{report.source_parameters:,}",
        f"{report.relational_parameters:,}",
        diff,
    )
    if slice_fraction > 0:
        sliced, slice_report = slice_relational(target, slice_fraction, calibration_data)
        if eval_data is not None:
            slice_report.perplexity_before = perplexity(target, eval_data)
            slice_report.perplexity_after = perplexity(sliced, eval_data)
        report.slicing = slice_report
        target = sliced
    target.conversion_report = report
    return (target, report) if return_report else target


__all__ = [
    "LAYER_ROLES",
    "ConversionError",
    "ConversionReport",
    "PhaseTimes",
    "convert_layer",
    "float64_logit_difference",
    "fold_head",
    "fold_layer_gains",
    "logit_difference",
    "max_logit_difference",
    "relational_config_for",
    "relative_difference",
    "source_layer_tensors",
    "to_relational",
]
