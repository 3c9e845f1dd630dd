"""Configuration of the relational-transformer architecture.

This file travels to the Hub next to `modeling_relational.py` (``trust_remote_code``): it imports only the
standard library and transformers.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

_POSITION_ENCODINGS = ("rope", "none")
_GAUGES = ("pivot", "free")
_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
#: default pivot value c = PIVOT_SCALE_FACTOR x initializer_range (see `pivot_scale`)
PIVOT_SCALE_FACTOR = 5.0


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raise ValueError unless `value` is an int in [low, high] (high=None: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__}).")
    if value < low or (high is not None and value > high):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"`{name}` must be in {allowed}, got {value}.")


def _check_float(name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> None:
    """Raise ValueError unless `value` is a real number in the stated interval."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name}` must be a number, got {value!r}.")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"`{name}` must be in {interval}, got {value}.")


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
            Smaller than d_h gives "thin keys". Must be even with rotary positions. Default: d_h.
        position_encoding: "rope" (rotary on the r query/key coordinates) or "none".
        rope_parameters: rotary settings as in Transformers (`rope_type`, `rope_theta`, scaling keys).
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
        hidden_act: activation of the SwiGLU gate.
        tie_word_embeddings: tie the output head to the input embedding.
        final_norm_gain: a learned gain vector (d values) on the final normalisation. It is a pure gauge only with an
            untied head (it folds into the head); with a tied head it cannot be folded (the head is also the input
            embedding) and sets the per-dimension logit scale, so it is part of the function class. Default (None):
            present exactly when the head is tied.
        initializer_range: std of the normal initialisation.
        rms_norm_eps: epsilon of the gain-free RMS normalisation.
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
    """

    model_type = "relational-transformer"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 768,
        intermediate_size: int = 2048,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        qk_rank: int | None = None,
        position_encoding: str = "rope",
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 2048,
        gauge: str = "pivot",
        pivot_scale: float | None = None,
        attention_bias: bool = False,
        attention_output_bias: bool = False,
        value_parallel_removal: bool = False,
        hidden_act: str = "silu",
        tie_word_embeddings: bool = True,
        final_norm_gain: bool | None = None,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        attention_dropout: float = 0.0,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        layer_qk_ranks: list[int] | None = None,
        layer_value_ranks: list[int] | None = None,
        layer_intermediate_sizes: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        if head_dim is None and isinstance(hidden_size, int) and isinstance(num_attention_heads, int):
            head_dim = hidden_size // num_attention_heads if num_attention_heads > 0 else 0
        self.head_dim = head_dim
        self.qk_rank = head_dim if qk_rank is None else qk_rank
        self.position_encoding = position_encoding
        self.rope_parameters = rope_parameters
        self.max_position_embeddings = max_position_embeddings
        self.gauge = gauge
        self.pivot_scale = PIVOT_SCALE_FACTOR * initializer_range if pivot_scale is None else pivot_scale
        self.attention_bias = attention_bias
        self.attention_output_bias = attention_output_bias
        self.value_parallel_removal = value_parallel_removal
        self.hidden_act = hidden_act
        self.tie_word_embeddings = tie_word_embeddings
        self.final_norm_gain = tie_word_embeddings if final_norm_gain is None else final_norm_gain
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.attention_dropout = attention_dropout
        self.use_cache = use_cache
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.layer_qk_ranks = None if layer_qk_ranks is None else list(layer_qk_ranks)
        self.layer_value_ranks = None if layer_value_ranks is None else list(layer_value_ranks)
        self.layer_intermediate_sizes = None if layer_intermediate_sizes is None else list(layer_intermediate_sizes)
        super().__init__(**kwargs)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        self._validate_fields()

    def _validate_fields(self) -> None:
        """Raise ValueError naming the first field that is out of range or inconsistent with the others."""
        _check_int("vocab_size", self.vocab_size, 1)
        _check_int("hidden_size", self.hidden_size, 1)
        _check_int("intermediate_size", self.intermediate_size, 1)
        _check_int("num_hidden_layers", self.num_hidden_layers, 1)
        _check_int("num_attention_heads", self.num_attention_heads, 1)
        _check_int("num_key_value_heads", self.num_key_value_heads, 1, self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        _check_int("head_dim", self.head_dim, 1)
        _check_int("qk_rank", self.qk_rank, 1, self.head_dim)
        _check_int("max_position_embeddings", self.max_position_embeddings, 1)
        if self.position_encoding not in _POSITION_ENCODINGS:
            raise ValueError(
                f"`position_encoding` must be one of {_POSITION_ENCODINGS}, got {self.position_encoding!r}."
            )
        if self.position_encoding == "rope" and self.qk_rank % 2 != 0:
            raise ValueError(
                f"`qk_rank` must be even with position_encoding='rope' (rotary pairs), got {self.qk_rank}."
            )
        if self.gauge not in _GAUGES:
            raise ValueError(f"`gauge` must be one of {_GAUGES}, got {self.gauge!r}.")
        if self.gauge == "pivot":
            if self.qk_rank > self.hidden_size:
                raise ValueError(
                    f"`qk_rank` must be <= hidden_size ({self.hidden_size}) in the pivot gauge, got {self.qk_rank}."
                )
            if self.head_dim > self.hidden_size:
                raise ValueError(
                    f"`head_dim` must be <= hidden_size ({self.hidden_size}) in the pivot gauge, got {self.head_dim}."
                )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"`hidden_act` must be one of {_ACTIVATIONS}, got {self.hidden_act!r}.")
        _check_float("initializer_range", self.initializer_range, 0.0, 1.0, low_open=True, high_open=False)
        _check_float(
            "pivot_scale",
            abs(self.pivot_scale) if isinstance(self.pivot_scale, (int, float)) else self.pivot_scale,
            0.0,
            float("inf"),
            low_open=True,
            high_open=True,
        )
        _check_float("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0, low_open=True, high_open=True)
        _check_float("attention_dropout", self.attention_dropout, 0.0, 1.0, low_open=False, high_open=True)
        for name in (
            "attention_bias",
            "attention_output_bias",
            "value_parallel_removal",
            "tie_word_embeddings",
            "final_norm_gain",
            "use_cache",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [value]
            for v in values:
                if v is not None:
                    _check_int(name, v, 0, self.vocab_size - 1)
        rope = self.rope_parameters
        if not isinstance(rope, dict) or "rope_type" not in rope:
            raise ValueError(f"`rope_parameters` must be a dict with a 'rope_type' key, got {rope!r}.")
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_types = ("default", *ROPE_INIT_FUNCTIONS)
        if rope["rope_type"] not in rope_types:
            raise ValueError(f"`rope_parameters['rope_type']` must be one of {rope_types}, got {rope['rope_type']!r}.")
        theta = rope.get("rope_theta", 10000.0)
        _check_float("rope_parameters['rope_theta']", theta, 0.0, float("inf"), low_open=True, high_open=True)
        self._validate_layer_widths()

    def _validate_layer_widths(self) -> None:
        """Raise ValueError naming the per-layer width list that has the wrong length or an entry out of range."""
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
                    f"`{name}` must be a list of {self.num_hidden_layers} integers (one per layer), got {values!r}."
                )
            for i, v in enumerate(values):
                _check_int(f"{name}[{i}]", v, low, high)
                if name == "layer_qk_ranks" and self.position_encoding == "rope" and v % 2 != 0:
                    raise ValueError(f"`{name}[{i}]` must be even with position_encoding='rope', got {v}.")

    def layer_qk_rank(self, layer_idx: int) -> int:
        """QK width r_l of layer `layer_idx` (`layer_qk_ranks`, default qk_rank)."""
        return self.qk_rank if self.layer_qk_ranks is None else self.layer_qk_ranks[layer_idx]

    def layer_value_rank(self, layer_idx: int) -> int:
        """Value width r_v of layer `layer_idx` (`layer_value_ranks`, default head_dim)."""
        return self.head_dim if self.layer_value_ranks is None else self.layer_value_ranks[layer_idx]

    def layer_intermediate_size(self, layer_idx: int) -> int:
        """SwiGLU width of layer `layer_idx` (`layer_intermediate_sizes`, default intermediate_size)."""
        return self.intermediate_size if self.layer_intermediate_sizes is None else self.layer_intermediate_sizes[layer_idx]

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head (g in GQA)."""
        return self.num_attention_heads // self.num_key_value_heads


__all__ = ["RelationalConfig"]
