"""Where every weight of a relational model goes in a GGUF file for llama.cpp (DESIGN.md 2.2b): the one home of the
GGUF layout maths, pure torch (the file itself is written by `relational_hf.convert.gguf_export`).

- **Architecture.** Uniform SwiGLU widths: llama.cpp's `llama`. Per-layer SwiGLU widths (a compressed model):
  `deci`, whose `feed_forward_length` and `attention.head_count_kv` llama.cpp reads as per-layer arrays. A per-head
  QK-norm (`qk_norm`, from Qwen3): `qwen3`, with per-layer `attn_q_norm` / `attn_k_norm` gains. Layers without rotary
  positions (`rope_layers`, from SmolLM3): `smollm3`, which skips rotary in every 4th layer. Gemma 3's options
  (`sandwich_norms`, `embedding_scale`, sliding-window `layer_types`, from `relational_hf.convert.gemma`): `gemma3`,
  with per-layer `post_attention_norm` / `post_ffw_norm` gains and its sliding-window metadata. What those three read
  and refuse: `relational_hf.convert.gguf_families`. The head width D, the rotary width (= D) and the head counts stay
  global in all five.
- **Heads.** One head width D = r * ceil(d_h / r) holds a QK form of rank r and value width d_h exactly (the same
  embedding as the plain Llama export, `relational_hf.convert.export`): relational rotary pair p of a key head goes
  to the Llama pair p D / r, which turns at the same frequency (theta^(-2p/r)); every other query/key coordinate is
  zero, so a layer's QK width r_l < D adds exactly 0 to each score; W_Q is scaled by sqrt(D / r_l) so that
  llama.cpp's 1/sqrt(D) score scale gives the relational 1/sqrt(r_l). A value width r_v < D: zero rows of W_V and
  zero columns of W_O. (`qwen3` and `gemma3` take r = D only: their norm sees the whole head; `gemma3` scales its
  query-norm gains instead where llama.cpp's score scale is not 1/sqrt(D).)
- **Rotary layout.** The relational (and Transformers) rotation pairs coordinate j with j + D/2 of a head; llama.cpp's
  `llama`, `deci` and `smollm3` (its "normal" rope) pair 2j with 2j + 1. The rows of each query and key head are
  reordered so that half-split pair j lands on adjacent coordinates (2j, 2j + 1) (`rope_interleave`); scores are
  unchanged because queries and keys are reordered alike. `qwen3`'s and `gemma3`'s rope is NEOX (half-split, the
  relational layout): their rows and QK-norm gains go in unreordered.
- **Norms.** The gain-free layer norms are RMSNorms with unit weights; the final norm carries the final gain (in
  front of a tied head) or unit weights; the QK-norm gains (`qwen3`, `gemma3`) and the sandwich-norm gains
  (`gemma3`: Gemma's 1 + w, which the relational model stores as the factor itself) as stored. A tied head stays
  tied: no `output` tensor (llama.cpp reads `token_embd`).

Refused before anything is written (`gguf_refusal`, one line naming the config field): value-space parallel removal,
models without rotary positions, partial rotary, rotary types other than the default (`gemma3`: also linear on its
full layers), activations other than SiLU (`gemma3`: the tanh GELU), any config field the layout does not map, and
what `qwen3` / `smollm3` / `gemma3` cannot hold (`gguf_families.family_refusal`: a QK-norm with a QK rank below the
head width, layer patterns without rotary other than every 4th layer, a QK-norm together with layers without rotary,
per-layer SwiGLU widths, an output bias; for `gemma3` an embedding scale other than sqrt(hidden_size), a missing
QK-norm or sandwich norm, scaled rotary frequencies on sliding layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .export import ExportError, _layer_qk_coordinates, _pad_heads, llama_head_dim
from .gguf_families import FAMILY_ARCHS, NEOX_ROPE_ARCHS, Gemma3Params, family_arch, family_refusal, gemma3_params

#: the relational model_type (config.json); anything else is converted first
RELATIONAL_MODEL_TYPE = "relational-transformer"


class GGUFExportError(ExportError):
    """A checkpoint that has no exact GGUF form, or a GGUF export that cannot be written (one line, naming the cause)."""


def gguf_refusal(config, pad_mlp: bool = False) -> str | None:
    """Why the relational `config` has no exact form in llama.cpp's `llama` / `deci` / `qwen3` / `smollm3` / `gemma3`
    (one line naming the config field), or None when it has one. `pad_mlp`: per-layer SwiGLU widths, which `qwen3`,
    `smollm3` and `gemma3` cannot hold, are accepted, to be padded with zero units (`gguf_layout`)."""
    if getattr(config, "model_type", None) != RELATIONAL_MODEL_TYPE:
        kind = getattr(config, "model_type", None) or type(config).__name__
        return (
            f"a {kind} checkpoint is not relational: run `relational-hf convert SRC REL` first and export REL "
            "(a plain Llama checkpoint also converts with llama.cpp's own convert_hf_to_gguf.py)"
        )
    if config.value_parallel_removal:
        return (
            "value_parallel_removal=True has no GGUF form: removing the part of each head's output parallel to the "
            "token's own value is a nonlinear edit no llama.cpp layer computes"
        )
    if config.position_encoding != "rope":
        return (
            f"position_encoding={config.position_encoding!r} has no GGUF form: llama.cpp's llama and deci rotate "
            "every query/key coordinate"
        )
    rope = dict(config.rope_parameters or {})
    gemma3 = family_arch(config) == "gemma3"  # its rotary types and activation: `gguf_families`
    if 0 < config.rotary_dim < config.qk_rank:
        return (
            f"rope_parameters partial_rotary_factor={rope.get('partial_rotary_factor')!r} (partial rotary) has no GGUF form: "
            "llama.cpp's llama and deci, as this export writes them, rotate every query/key coordinate"
        )
    if rope.get("rope_type", "default") != "default" and not gemma3:
        return (
            f"rope_parameters rope_type={rope.get('rope_type')!r}: only the default rotary type is exported to GGUF "
            "(its frequencies are checked exactly; scaled types are not)"
        )
    if config.hidden_act != "silu" and not gemma3:
        return f"hidden_act={config.hidden_act!r} has no GGUF form: llama.cpp's llama and deci gate with SiLU"
    return _unmapped_option(config) or family_refusal(config, pad_mlp)


#: The relational config's own fields the GGUF layout maps (or that do not change the function). Any other field of
#: the config class set away from its default is refused by name: an option added to the architecture later is never
#: exported as if it were absent.
MAPPED_FIELDS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "qk_rank", "position_encoding", "rope_parameters", "max_position_embeddings",
        "gauge", "pivot_scale", "attention_bias", "attention_output_bias", "value_parallel_removal", "hidden_act",
        "tie_word_embeddings", "final_norm_gain", "initializer_range", "rms_norm_eps", "attention_dropout", "use_cache",
        "pad_token_id", "bos_token_id", "eos_token_id", "layer_qk_ranks", "layer_value_ranks",
        "layer_intermediate_sizes", "qk_norm", "rope_layers",
        # Gemma 3's: any of them makes the architecture gemma3, which checks every one (`gguf_families`)
        "sandwich_norms", "embedding_scale", "layer_types", "sliding_window", "sliding_rope_parameters",
    }
)  # fmt: skip


def _unmapped_option(config) -> str | None:
    import dataclasses

    cls = type(config)
    if not dataclasses.is_dataclass(cls):
        return None
    for field in dataclasses.fields(cls):
        if field.name not in getattr(cls, "__annotations__", {}) or field.name in MAPPED_FIELDS:
            continue  # the base class's bookkeeping, or a field the layout maps
        default = field.default if field.default is not dataclasses.MISSING else None
        value = getattr(config, field.name, default)
        if value != default:
            return f"{field.name}={value!r} has no GGUF form: the GGUF export does not map this option"
    return None


@dataclass(frozen=True)
class GGUFLayout:
    """The llama.cpp hyperparameters of a relational model: `arch` ("llama", "deci", "qwen3", "smollm3" or "gemma3"),
    head width D (= rotary width, key and value length), per-layer SwiGLU widths, the global counts, whether each layer
    holds QK-norm gains (`qk_norm`), and gemma3's sandwich norms and sliding-window settings (`gemma3`)."""

    arch: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    feed_forward: tuple[int, ...]
    qk_ranks: tuple[int, ...]
    value_ranks: tuple[int, ...]
    tied: bool
    q_bias: bool
    o_bias: bool
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    qk_norm: bool = False
    gemma3: Gemma3Params | None = None
    mlp_padding: tuple[int, ...] = ()  # zero SwiGLU units added to each layer (`pad_mlp`; empty: none)

    @property
    def rope_interleaved(self) -> bool:
        """Whether llama.cpp's rope of `arch` pairs adjacent coordinates (2j, 2j + 1), so rows are reordered."""
        return self.arch not in NEOX_ROPE_ARCHS

    @property
    def padding_zeros(self) -> int:
        """Zero entries the fixed head width D adds to the stored maps (QK and value widths below D), and the zero
        SwiGLU units of `mlp_padding` (gate and up rows, down columns)."""
        d, h, h_kv, width = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        heads = sum(
            d * ((h + h_kv) * (width - r) + (h_kv + h) * (width - v)) for r, v in zip(self.qk_ranks, self.value_ranks)
        )
        return heads + 3 * d * sum(self.mlp_padding)


def gguf_layout(config, pad_mlp: bool = False) -> GGUFLayout:
    """The `GGUFLayout` of a relational config; `GGUFExportError` (one line) when `gguf_refusal` refuses it.
    `pad_mlp`: in `qwen3` / `smollm3` / `gemma3`, which hold one SwiGLU width, per-layer widths are written at the
    widest layer's, the narrower layers padded with zero units (`mlp_padding`: each unit's gate and up rows and down
    column zero, so it adds act(0) * 0 = 0 exactly); `llama` and `deci` need none."""
    reason = gguf_refusal(config, pad_mlp)
    if reason is not None:
        raise GGUFExportError(reason)
    layers = range(config.num_hidden_layers)
    own = tuple(config.layer_intermediate_size(i) for i in layers)
    arch = family_arch(config) or ("llama" if len(set(own)) == 1 else "deci")
    widths = (max(own),) * len(own) if arch in FAMILY_ARCHS and len(set(own)) > 1 else own
    return GGUFLayout(
        arch=arch,
        head_dim=llama_head_dim(config.qk_rank, config.head_dim),
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
        feed_forward=widths,
        qk_ranks=tuple(config.layer_qk_rank(i) for i in layers),
        value_ranks=tuple(config.layer_value_rank(i) for i in layers),
        tied=bool(config.tie_word_embeddings),
        q_bias=bool(config.attention_bias),
        o_bias=bool(config.attention_output_bias),
        rope_theta=float(dict(config.rope_parameters).get("rope_theta", 10000.0)),
        rms_norm_eps=float(config.rms_norm_eps),
        context_length=int(config.max_position_embeddings),
        qk_norm=bool(config.qk_norm),
        gemma3=gemma3_params(config) if arch == "gemma3" else None,
        mlp_padding=tuple(w - o for w, o in zip(widths, own)) if widths != own else (),
    )


def tensor_shapes(layout: GGUFLayout) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF tensor name, shape) of every tensor the export writes, in the order written. Shapes in the Linear
    layout (out, in), as numpy holds them; GGUF lists the dimensions reversed (ne0 = in)."""
    d, width = layout.hidden_size, layout.head_dim
    q_rows, kv_rows = layout.num_heads * width, layout.num_kv_heads * width
    out = [("token_embd.weight", (layout.vocab_size, d))]
    for i, f in enumerate(layout.feed_forward):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,)), (b + "attn_q.weight", (q_rows, d)), (b + "attn_k.weight", (kv_rows, d))]
        if layout.qk_norm:
            out += [(b + "attn_q_norm.weight", (width,)), (b + "attn_k_norm.weight", (width,))]
        out += [(b + "attn_v.weight", (kv_rows, d)), (b + "attn_output.weight", (d, q_rows))]
        if layout.q_bias:
            out += [(b + "attn_q.bias", (q_rows,)), (b + "attn_k.bias", (kv_rows,)), (b + "attn_v.bias", (kv_rows,))]
        if layout.o_bias:
            out += [(b + "attn_output.bias", (d,))]
        if layout.gemma3 is not None:
            out += [(b + "post_attention_norm.weight", (d,))]
        out += [(b + "ffn_norm.weight", (d,)), (b + "ffn_gate.weight", (f, d)), (b + "ffn_up.weight", (f, d))]
        out += [(b + "ffn_down.weight", (d, f))]
        if layout.gemma3 is not None:
            out += [(b + "post_ffw_norm.weight", (d,))]
    out += [("output_norm.weight", (d,))]
    if not layout.tied:
        out += [("output.weight", (layout.vocab_size, d))]
    return out


def rope_interleave(w: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """Rows (or entries, for a bias) of `heads` heads of `width` reordered from the half-split rotary layout (pair j:
    coordinates j and j + width/2) to llama.cpp's adjacent pairs (2j, 2j + 1): new row 2j is old row j, new row
    2j + 1 is old row j + width/2, head by head."""
    half = width // 2
    order = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)  # [0, h, 1, h+1, ...]
    rows = (order[None, :] + width * torch.arange(heads)[:, None]).reshape(-1)
    return w.index_select(0, rows.to(w.device))


@torch.no_grad()
def layer_tensors(layer: nn.Module, index: int, layout: GGUFLayout, model_qk_rank: int) -> dict[str, torch.Tensor]:
    """The GGUF tensors (float32, computed in float64; Linear layout) of relational decoder layer `index`, in `tensor_shapes` order:
    unit norm weights, W_Q/W_K padded to the head width D by rotary pair and (adjacent-pair rope) interleaved for
    llama.cpp's rope, W_Q scaled by sqrt(D / r_l), the QK-norm gains (`qwen3`, `gemma3`: the query's times
    `Gemma3Params.query_gain`), W_V/W_O padded with zeros, the sandwich-norm gains (`gemma3`), the SwiGLU maps at the
    layer's own width (padded with `mlp_padding`'s zero units)."""
    attn = layer.self_attn
    h, h_kv, width, d = layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.hidden_size
    k_coords = _layer_qk_coordinates(attn, model_qk_rank, width)  # (H_kv, r_l) Llama coordinates per key head
    q_coords = k_coords.repeat_interleave(h // h_kv, dim=0)
    vo = torch.arange(attn.head_dim)
    q_scale = math.sqrt(width / attn.qk_rank)

    def order(rows: torch.Tensor, heads: int) -> torch.Tensor:
        return rope_interleave(rows, heads, width) if layout.rope_interleaved else rows

    w = attn.full_weights()
    b = f"blk.{index}."
    out = {b + "attn_norm.weight": torch.ones(d, dtype=torch.float64)}
    out[b + "attn_q.weight"] = order(_pad_heads(w["q"], h, width, q_coords, q_scale), h)
    out[b + "attn_k.weight"] = order(_pad_heads(w["k"], h_kv, width, k_coords), h_kv)
    if layout.qk_norm:  # gains over the whole head (r = D, `gguf_families`): nothing padded, moved or scaled
        if k_coords.shape[1] != width or not bool((k_coords == torch.arange(width)).all()):
            raise GGUFExportError(f"{b}attn_q_norm: the QK coordinates are not the head's own in order: no qwen3 form")
        for key in ("q_norm", "k_norm"):
            out[f"{b}attn_{key}.weight"] = order(w[key].double().reshape(width, 1), 1).reshape(width)
        if layout.gemma3 is not None and layout.gemma3.query_gain != 1.0:
            out[b + "attn_q_norm.weight"] = out[b + "attn_q_norm.weight"] * layout.gemma3.query_gain
    out[b + "attn_v.weight"] = _pad_heads(w["v"], h_kv, width, vo)
    out[b + "attn_output.weight"] = _pad_heads(w["o"].double().T, h, width, vo).T.contiguous()
    if layout.q_bias:
        for key, heads, coords, scale, interleave in (
            ("q", h, q_coords, q_scale, True),
            ("k", h_kv, k_coords, 1.0, True),
            ("v", h_kv, vo, 1.0, False),
        ):
            value = w.get(f"{key}_bias")
            rows = heads * width
            padded = (
                torch.zeros(rows, dtype=torch.float64)
                if value is None
                else _pad_heads(value, heads, width, coords, scale)
            )
            out[f"{b}attn_{key}.bias"] = order(padded, heads) if interleave else padded
    if layout.o_bias:
        value = w.get("o_bias")
        out[b + "attn_output.bias"] = torch.zeros(d, dtype=torch.float64) if value is None else value.double()
    if layout.gemma3 is not None:  # the sandwich norms' gains (Gemma's 1 + w, stored as the factor)
        out[b + "post_attention_norm.weight"] = layer.attention_output_norm.weight.detach().double()
    mlp = layer.mlp.full_weights()
    out[b + "ffn_norm.weight"] = torch.ones(d, dtype=torch.float64)
    extra = layout.mlp_padding[index] if layout.mlp_padding else 0  # zero units up to the written width
    out[b + "ffn_gate.weight"] = nn.functional.pad(mlp["gate"].double(), (0, 0, 0, extra))
    out[b + "ffn_up.weight"] = nn.functional.pad(mlp["up"].double(), (0, 0, 0, extra))
    out[b + "ffn_down.weight"] = nn.functional.pad(mlp["down"].double(), (0, extra))
    if layout.gemma3 is not None:
        out[b + "post_ffw_norm.weight"] = layer.mlp_output_norm.weight.detach().double()
    return {k: v.detach().to(torch.float32).cpu() for k, v in out.items()}


__all__ = [
    "RELATIONAL_MODEL_TYPE",
    "GGUFExportError",
    "GGUFLayout",
    "gguf_layout",
    "gguf_refusal",
    "layer_tensors",
    "rope_interleave",
    "tensor_shapes",
]
