"""Configuration of the relational-transformer architecture.

This file travels to the Hub next to `modeling_relational.py` (``trust_remote_code``): it imports only the standard
library, transformers and huggingface_hub (a dependency of transformers, whose `strict` dataclasses every in-tree
configuration uses).

Validation uses the Transformers v5 mechanism (`huggingface_hub.dataclasses.strict`): every field is a typed dataclass
field whose own range check runs at construction *and on every later assignment* (``cfg.gauge = "bogus"`` raises at
once), and the checks that involve several fields are ``validate_*`` methods, run at construction, by
``config.validate()``, by ``save_pretrained`` and by the model constructor. Errors are
`RelationalConfigError`, both a `huggingface_hub.errors.StrictDataclassError` (what the library raises) and a
`ValueError` (what this project's callers catch), and their message names the field. NaN fails every numeric range. To add an optional field,
declare it with a default (``my_width: int | None = None``, or a `_number`/`_integer` field for a range check) and,
when it depends on other fields, check it in `validate_architecture`.
"""

import functools
import math
import re
from typing import Any, Literal

from huggingface_hub.dataclasses import as_validated_field, strict
from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedConfig

#: default pivot value c = PIVOT_SCALE_FACTOR x initializer_range (see `pivot_scale`)
PIVOT_SCALE_FACTOR = 5.0
#: the attention types `layer_types` may name (Transformers' names)
LAYER_TYPES = ("full_attention", "sliding_attention")


def _integer(low: int, high: int | None = None, *, optional: bool = False):
    """A dataclass field holding an int in [low, high] (high=None: unbounded; optional: None allowed)."""

    @as_validated_field
    def check(value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"must be an integer, got {value!r} ({type(value).__name__})")
        if value < low or (high is not None and value > high):
            allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"must be in {allowed}, got {value}")

    return check


def _number(low: float, high: float, *, low_open: bool, high_open: bool, optional: bool = False):
    """A dataclass field holding a finite real number in the stated interval (NaN and infinities are refused)."""

    @as_validated_field
    def check(value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"must be a number, got {value!r} ({type(value).__name__})")
        ok = math.isfinite(value)
        ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
        if not ok:
            interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            raise ValueError(f"must be a finite number in {interval}, got {value}")

    return check


@as_validated_field
def _pivot_scale(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value == 0:
        raise ValueError(f"must be a finite nonzero number, got {value}")


_INF = math.inf


class RelationalConfigError(StrictDataclassError, ValueError):
    """A RelationalConfig field out of range or inconsistent with the others (the message names the field)."""


def _one_line(err: Exception) -> str:
    """The library's message is "Validation error for field 'x':" plus the original error on an indented line;
    keep the original message, which names the field and the allowed range."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if len(lines) > 1:
        last = lines[-1]
        kind, sep, rest = last.partition(": ")
        message = rest if sep and kind.endswith("Error") else last
        field = re.search(r"field '(\w+)'", lines[0])
        if field and field.group(1) not in message:
            message = f"{field.group(1)}: {message}"
        return message
    return lines[0] if lines else type(err).__name__


def _value_errors(method):
    """Re-raise the strict dataclass errors of `method` as RelationalConfigError (also a ValueError)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except StrictDataclassError as err:
            if isinstance(err, ValueError):
                raise
            raise RelationalConfigError(_one_line(err)) from err

    return wrapper


@strict
class RelationalConfig(PreTrainedConfig):
    r"""Configuration of a relational transformer (decoder-only, Llama-like skeleton in invariant parameters).

    Args:
        vocab_size: number of tokens.
        hidden_size: residual width d.
        intermediate_size: SwiGLU hidden width d_ff.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads H.
        num_key_value_heads: key/value heads (GQA); must divide `num_attention_heads`. Default: H.
        head_dim: value/output width per head d_h. Default: hidden_size // H.
        qk_rank: rank r of each head's QK bilinear form G_QK = W_Q W_K^T (query/key width), 1 <= r <= d_h.
            Smaller than d_h gives "thin keys". Must be even with rotary positions. Default: d_h. Exposed to
            Transformers as `qk_head_dim` (key width) next to `v_head_dim` (= head_dim), the names that in-tree models
            with different key and value widths use; the key/value cache holds r-wide keys and d_h-wide values.
        position_encoding: "rope" (rotary on the r query/key coordinates), "none", or "learned": absolute position
            embeddings, a table of max_position_embeddings x d added to the token embeddings (GPT-2's `wpe`); the QK
            pairs then have no rotary positions (full GL(r) gauge per key head).
        rope_parameters: rotary settings as in Transformers (`rope_type`, `rope_theta`, scaling keys). Partial
            rotary (`partial_rotary_factor` f < 1, GPT-NeoX's `rotary_pct`): only the first int(f qk_rank) coordinates
            of each head turn (rotate-half layout on them; an even number >= 2). It leaves a full GL on the other
            coordinates, which the pivot layout does not fix, so the QK pair is then stored as it is in either gauge
            (the VO and MLP gauges are fixed as usual); it needs `layer_qk_ranks`, `qk_norm` and `rope_layers` unset.
        max_position_embeddings: longest context the rotary settings are meant for.
        gauge: "pivot" stores QK, VO and the SwiGLU scales in the pivot (echelon) gauge, no redundant
            coordinate left; "free" stores the usual over-parameterised factors (train with projected updates).
        pivot_scale: value of the fixed pivot entries in the pivot gauge (W_K[P] = c I, ...). Any nonzero value
            gives the same function class, but c sets how the scale is shared between the two stored factors of
            each pair (W_K's free entries grow with c, W_Q's shrink as 1/c), and Adam's per-coordinate steps see
            that split. Default: PIVOT_SCALE_FACTOR (5) x initializer_range, which puts the two factors on similar
            scales at initialisation; at c = initializer_range the pivot gauge trained measurably worse than the
            free gauge (benchmarks/quality.py, README).
        attention_bias: biases on the query, key and value maps.
        attention_output_bias: bias on the output map W_O.
        value_parallel_removal: remove, per head before W_O, the part of the attention output parallel to the
            token's own value: o_t <- o_t - (o_t.v_t / |v_t|^2) v_t. This breaks the VO gauge GL(d_h) down to
            scalings times rotations, so the pivot gauge then leaves VO in free form.
        hidden_act: activation of the SwiGLU gate (of the hidden units when `mlp_gated` is False); "gelu_new" is
            GPT-2's tanh-approximate GELU (the same function as "gelu_pytorch_tanh", Transformers' implementation).
        mlp_gated: True: SwiGLU (act(x W_gate) * (x W_up)) W_down; False: a plain MLP act(x W_up + b_up) W_down + b_down
            (GPT-2, GPT-NeoX), which has no scaling gauge (the activation is not homogeneous), so W_up is stored as it
            is in either gauge.
        mlp_bias: biases on the up and down maps; needs mlp_gated=False.
        embedding_centring: subtract, from the embedded input (token plus position embeddings), its mean over the d
            coordinates (a parameter-free projection). A LayerNorm model converts into gain-free RMS norms when every
            write into the residual stream is mean-free; with a head tied to the embedding the embedding itself cannot
            be centred (it also makes the logits), so the input is centred here. Residual rotations must then fix the
            all-ones direction.
        final_norm_bias: a bias vector (d values) added after the final normalisation (and its gain): the final
            LayerNorm's bias in front of the head, kept exactly (its effect on the logits, beta W_head^T, is not a
            constant shift).
        parallel_residual: the attention and the MLP both read the layer input, h + Attn(norm(h)) + MLP(norm'(h))
            (GPT-NeoX's `use_parallel_residual`); False: in sequence, as Llama.
        tie_word_embeddings: tie the output head to the input embedding.
        final_norm_gain: a learned gain vector (d values) on the final normalisation. It is a pure gauge only with an
            untied head (it folds into the head); with a tied head it cannot be folded (the head is also the input
            embedding) and sets the per-dimension logit scale, so it is part of the function class. Default (None):
            present exactly when the head is tied.
        initializer_range: std of the normal initialisation.
        rms_norm_eps: epsilon of the gain-free RMS normalisation (any finite eps >= 0, as Llama).
        attention_dropout: dropout on attention probabilities during training.
        use_cache: return a key/value cache.
        pad_token_id, bos_token_id, eos_token_id: special token ids (None or in [0, vocab_size)).
        layer_qk_ranks: optional per-layer QK widths r_l (one int per layer, each <= qk_rank, even with rotary
            positions), as produced by compression; with rotary positions each key head of a layer keeps r_l / 2 of
            the model's qk_rank / 2 frequency pairs (which ones: the layer's `rope_pair_index` buffer). None: every
            layer has width qk_rank.
        layer_value_ranks: optional per-layer value widths r_v (VO rank per key/value head; W_V is d x r_v and each
            query head's W_O is r_v x d), each <= head_dim. None: head_dim everywhere.
        layer_intermediate_sizes: optional per-layer SwiGLU widths, each >= 1. None: intermediate_size everywhere.
        qk_norm: per-head RMS normalisation of queries and keys before the rotary embedding, each followed by a gain
            vector of qk_rank values shared by all heads (Qwen3). The norm breaks the QK gauge down to rotations (on
            the rotary pairs whose q and k gains are equal), so W_Q and W_K are stored as they are, in either gauge,
            and a layer's QK width cannot be truncated (`layer_qk_ranks` must be None).
        rope_layers: optional per-layer rotary switch (one bool per layer; False: the layer attends without
            positions, its QK gauge is GL(qk_rank), as SmolLM3's no-rope layers). None: every layer follows
            `position_encoding`. Needs position_encoding='rope'.
        sandwich_norms: a norm with a gain vector (d values) on the attention's output and on the MLP's output,
            before each is added to the stream (Gemma 2/3's post-attention and post-feedforward norms). The gains sit
            between W_O (W_down) and the stream, so they fold nowhere: residual rotations must commute with every one
            of them (with distinct gain values, none is left). Off by default.
        embedding_scale: a number multiplying the embedded input (Gemma's sqrt(hidden_size)); with a head tied to the
            embedding it cannot be folded into the table. Computed in the embedding's dtype, as Gemma does. None: no
            scale.
        layer_types: optional attention type per layer, "full_attention" or "sliding_attention" (Gemma 3, with the
            names and masks of Transformers: `create_causal_mask`, `create_sliding_window_causal_mask`; the cache keeps
            the last `sliding_window` positions of a sliding layer). None: every layer attends to the full context.
        sliding_window: the window of the sliding layers (a query attends to the `sliding_window` positions up to and
            including its own); needs `layer_types` with a sliding layer, and they need it.
        sliding_rope_parameters: rotary settings of the sliding layers (Gemma 3's local base frequency), as
            `rope_parameters`, which the full layers keep. None: the sliding layers use `rope_parameters`.
    """

    model_type = "relational-transformer"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int = _integer(1)(default=32000)
    hidden_size: int = _integer(1)(default=768)
    intermediate_size: int = _integer(1)(default=2048)
    num_hidden_layers: int = _integer(1)(default=12)
    num_attention_heads: int = _integer(1)(default=12)
    num_key_value_heads: int | None = _integer(1, optional=True)(default=None)
    head_dim: int | None = _integer(1, optional=True)(default=None)
    qk_rank: int | None = _integer(1, optional=True)(default=None)
    position_encoding: Literal["rope", "none", "learned"] = "rope"
    rope_parameters: dict | None = None
    max_position_embeddings: int = _integer(1)(default=2048)
    gauge: Literal["pivot", "free"] = "pivot"
    pivot_scale: int | float | None = _pivot_scale(default=None)
    attention_bias: bool = False
    attention_output_bias: bool = False
    value_parallel_removal: bool = False
    hidden_act: Literal["silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu"] = "silu"
    tie_word_embeddings: bool = True
    final_norm_gain: bool | None = None
    initializer_range: int | float = _number(0.0, 1.0, low_open=True, high_open=False)(default=0.02)
    rms_norm_eps: int | float = _number(0.0, _INF, low_open=False, high_open=True)(default=1e-6)
    attention_dropout: int | float = _number(0.0, 1.0, low_open=False, high_open=False)(default=0.0)
    use_cache: bool = True
    pad_token_id: int | None = _integer(0, optional=True)(default=None)
    bos_token_id: int | None = _integer(0, optional=True)(default=None)
    eos_token_id: int | list[int] | None = None
    layer_qk_ranks: list[int] | None = None
    layer_value_ranks: list[int] | None = None
    layer_intermediate_sizes: list[int] | None = None
    qk_norm: bool = False
    rope_layers: list[bool] | None = None
    mlp_gated: bool = True
    mlp_bias: bool = False
    embedding_centring: bool = False
    final_norm_bias: bool = False
    parallel_residual: bool = False
    sandwich_norms: bool = False
    embedding_scale: int | float | None = _number(0.0, _INF, low_open=True, high_open=True, optional=True)(default=None)
    layer_types: list[str] | None = None
    sliding_window: int | None = _integer(1, optional=True)(default=None)
    sliding_rope_parameters: dict | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int):
                if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
                    raise RelationalConfigError(
                        f"num_attention_heads: {self.num_attention_heads} does not divide hidden_size "
                        f"{self.hidden_size}; choose a divisor, or give head_dim explicitly"
                    )
            self.head_dim = max(1, self.hidden_size // self.num_attention_heads)
        if self.qk_rank is None:
            self.qk_rank = self.head_dim
        if self.pivot_scale is None:
            self.pivot_scale = PIVOT_SCALE_FACTOR * self.initializer_range
        if self.final_norm_gain is None:
            self.final_norm_gain = self.tie_word_embeddings
        if self.rope_parameters is None and "rope_scaling" not in kwargs:
            self.rope_parameters = {"rope_type": "default", "rope_theta": kwargs.get("rope_theta", 10000.0)}
        super().__post_init__(**kwargs)

    # ---- cross-field checks (`validate_*` methods are run by `validate()`, see the module docstring) ----

    def validate_architecture(self) -> None:
        """Head counts, widths and gauge constraints that involve several fields."""
        for name in ("num_key_value_heads", "head_dim", "qk_rank", "pivot_scale", "final_norm_gain"):
            if getattr(self, name) is None:
                raise ValueError(f"`{name}` must be set (it is None)")
        if self.num_key_value_heads > self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads})"
            )
        if self.qk_rank > self.head_dim:
            raise ValueError(f"`qk_rank` must be in [1, head_dim={self.head_dim}], got {self.qk_rank}")
        if self.position_encoding == "rope" and self.qk_rank % 2 != 0:
            raise ValueError(f"`qk_rank` must be even with position_encoding='rope' (rotary pairs), got {self.qk_rank}")
        if self.gauge == "pivot":
            if self.qk_rank > self.hidden_size:
                raise ValueError(
                    f"`qk_rank` must be <= hidden_size ({self.hidden_size}) in the pivot gauge, got {self.qk_rank}"
                )
            if self.head_dim > self.hidden_size:
                raise ValueError(
                    f"`head_dim` must be <= hidden_size ({self.hidden_size}) in the pivot gauge, got {self.head_dim}"
                )

    def validate_layer_widths(self) -> None:
        """Per-layer widths (compressed models): one integer per layer, in range, even QK widths with rotary."""
        bounds = {
            "layer_qk_ranks": (2 if self.position_encoding == "rope" else 1, self.qk_rank),
            "layer_value_ranks": (1, self.head_dim),
            "layer_intermediate_sizes": (1, None),
        }
        for name, (low, high) in bounds.items():
            values = getattr(self, name)
            if values is None:
                continue
            if not isinstance(values, list) or len(values) != self.num_hidden_layers:
                raise ValueError(
                    f"`{name}` must be a list of {self.num_hidden_layers} integers (one per layer), got {values!r}"
                )
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                    allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
                    raise ValueError(f"`{name}[{i}]` must be an integer in {allowed}, got {v!r}")
                if name == "layer_qk_ranks" and self.position_encoding == "rope" and v % 2 != 0:
                    raise ValueError(f"`{name}[{i}]` must be even with position_encoding='rope', got {v}")

    def validate_layer_options(self) -> None:
        """Per-layer rotary switches and QK-norm: consistent with the positions and the per-layer QK widths."""
        if self.rope_layers is not None:
            values = self.rope_layers
            if not isinstance(values, list) or len(values) != self.num_hidden_layers:
                raise ValueError(
                    f"`rope_layers` must be a list of {self.num_hidden_layers} booleans (one per layer), got {values!r}"
                )
            if not all(isinstance(v, bool) for v in values):
                raise ValueError(f"`rope_layers` must hold only True or False, got {values!r}")
            if self.position_encoding != "rope":
                raise ValueError("`rope_layers` needs position_encoding='rope' (it switches rotary off per layer)")
        if self.qk_norm and self.layer_qk_ranks is not None:
            if any(v != self.qk_rank for v in self.layer_qk_ranks):
                raise ValueError(
                    "`layer_qk_ranks` must be None with qk_norm=True: the per-head QK-norm normalises over all qk_rank "
                    "coordinates, so a narrower QK width is not the same function"
                )

    def validate_layernorm_options(self) -> None:
        """Options of converted LayerNorm families (GPT-2, GPT-NeoX): MLP biases only on the plain MLP."""
        if self.mlp_bias and self.mlp_gated:
            raise ValueError("`mlp_bias` needs mlp_gated=False: the SwiGLU MLP has no biases")

    def layer_rope(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` applies the rotary embedding (`position_encoding`, `rope_layers`)."""
        if self.position_encoding != "rope":
            return False
        return True if self.rope_layers is None else self.rope_layers[layer_idx]

    @property
    def rotary_dim(self) -> int:
        """Query/key coordinates of each head that turn with rotary positions (0 without): int(partial_rotary_factor
        x qk_rank), all qk_rank by default."""
        if self.position_encoding != "rope":
            return 0
        factor = (self.rope_parameters or {}).get("partial_rotary_factor", 1.0)
        return int(self.qk_rank * factor) if isinstance(factor, (int, float)) else self.qk_rank

    def layer_qk_rank(self, layer_idx: int) -> int:
        """QK width r_l of layer `layer_idx` (`layer_qk_ranks`, default qk_rank)."""
        return self.qk_rank if self.layer_qk_ranks is None else self.layer_qk_ranks[layer_idx]

    def layer_value_rank(self, layer_idx: int) -> int:
        """Value width r_v of layer `layer_idx` (`layer_value_ranks`, default head_dim)."""
        return self.head_dim if self.layer_value_ranks is None else self.layer_value_ranks[layer_idx]

    def layer_intermediate_size(self, layer_idx: int) -> int:
        """SwiGLU width of layer `layer_idx` (`layer_intermediate_sizes`, default intermediate_size)."""
        if self.layer_intermediate_sizes is None:
            return self.intermediate_size
        return self.layer_intermediate_sizes[layer_idx]

    def validate_token_ids(self) -> None:
        """Special token ids must index the vocabulary (the pad id is the embedding's padding index)."""
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            for v in value if isinstance(value, list) else [value]:
                if v is None:
                    continue
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size:
                    raise ValueError(f"`{name}` must be None or an integer in [0, {self.vocab_size}), got {v!r}")

    def validate_rope(self) -> None:
        """Rotary settings, checked only with position_encoding='rope'; the rotary width is `qk_rank`."""
        if self.position_encoding != "rope":
            if self.sliding_rope_parameters is not None:
                raise ValueError("`sliding_rope_parameters` needs position_encoding='rope'")
            return
        rope = self.rope_parameters
        self._check_rope_table("rope_parameters", rope)
        factor = rope.get("partial_rotary_factor", 1.0)
        ok = not isinstance(factor, bool) and isinstance(factor, (int, float)) and 0 < factor <= 1
        if not ok or (factor != 1 and (self.rotary_dim < 2 or self.rotary_dim % 2)):
            raise ValueError(
                f"`rope_parameters['partial_rotary_factor']` must be in (0, 1] and turn an even number >= 2 of the "
                f"qk_rank={self.qk_rank} coordinates, got {factor!r}"
            )
        others = [n for n in ("layer_qk_ranks", "rope_layers") if getattr(self, n) is not None] + (
            ["qk_norm"] if self.qk_norm else []
        )
        if factor != 1 and others:
            raise ValueError(f"`rope_parameters['partial_rotary_factor']` < 1 needs {others[0]} unset (partial rotary)")
        local = self.sliding_rope_parameters
        if local is not None:
            self._check_rope_table("sliding_rope_parameters", local)
            if local.get("partial_rotary_factor", 1.0) != factor:
                raise ValueError("`sliding_rope_parameters['partial_rotary_factor']` must equal rope_parameters'")

    def _check_rope_table(self, name: str, rope: Any) -> None:
        """One table of rotary settings (`rope_parameters` or `sliding_rope_parameters`): its type, base and scaling
        keys, with Transformers' own checks of the type."""
        if not isinstance(rope, dict) or "rope_type" not in rope:
            raise ValueError(f"`{name}` must be a dict with a 'rope_type' key, got {rope!r}")
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_types = ("default", *ROPE_INIT_FUNCTIONS)
        if rope["rope_type"] not in rope_types:
            raise ValueError(f"`{name}['rope_type']` must be one of {rope_types}, got {rope['rope_type']!r}")
        theta = rope.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
            raise ValueError(f"`{name}['rope_theta']` must be a finite number > 0, got {theta!r}")
        for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
            value = rope.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"`{name}['{key}']` must be finite, got {value}")
        check = getattr(self, f"_validate_{rope['rope_type']}_rope_parameters", None)
        if check is not None:
            try:
                check(dict(rope), ignore_keys=self.ignore_keys_at_rope_validation)
            except KeyError as err:
                raise ValueError(f"`{name}`: {err.args[0]}") from None

    def validate_window_options(self) -> None:
        """Per-layer attention types and the sliding window (Gemma 3), the embedding scale and the sandwich norms."""
        types = self.layer_types
        if types is not None:
            if not isinstance(types, list) or len(types) != self.num_hidden_layers:
                n = self.num_hidden_layers
                raise ValueError(f"`layer_types` must be a list of {n} layer types (one per layer), got {types!r}")
            bad = [t for t in types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(f"`layer_types` entries must be in {LAYER_TYPES}, got {bad[0]!r}")
        sliding = types is not None and "sliding_attention" in types
        if sliding and self.sliding_window is None:
            raise ValueError("`sliding_window` must be set when `layer_types` has a 'sliding_attention' layer")
        if self.sliding_window is not None and not sliding:
            raise ValueError("`sliding_window` needs `layer_types` with a 'sliding_attention' layer (None otherwise)")
        if self.sliding_rope_parameters is not None and not sliding:
            raise ValueError("`sliding_rope_parameters` needs `layer_types` with a 'sliding_attention' layer")

    def layer_sliding(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` attends through the sliding window (`layer_types`)."""
        return self.layer_types is not None and self.layer_types[layer_idx] == "sliding_attention"

    # ---- names Transformers reads ----

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head (g in GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qk_head_dim(self) -> int:
        """Width of each query/key head (= qk_rank), the name in-tree models with distinct key and value widths use:
        Transformers reads it to size the key half of a cache separately from the value half."""
        return self.qk_rank

    @property
    def v_head_dim(self) -> int:
        """Width of each value head (= head_dim)."""
        return self.head_dim


for _name in ("__init__", "__setattr__", "validate"):
    setattr(RelationalConfig, _name, _value_errors(getattr(RelationalConfig, _name)))

__all__ = ["RelationalConfig", "RelationalConfigError"]
