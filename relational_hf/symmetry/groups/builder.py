"""Building the groups of a model through its architecture adapter: `symmetry_groups(model)`."""

from __future__ import annotations

import torch
from torch import nn

from ...architectures import (
    ArchitectureAdapter,
    AttentionSlots,
    LayerRoles,
    MLPSlots,
    TensorSlot,
    UnsupportedModelError,
    get_adapter,
)
from ..algebra import Conformal, FullLinear, RotaryCommutant, Subalgebra
from ..sharding import full_tensor
from .base import SymmetryGroup, _is_meta
from .heads import QKGauge, QKNormGainExchange, VOGauge
from .residual import ResidualReader, ResidualRotation
from .scaling import MLPScale, NormGain
from .translations import (
    CentringBiasExchange,
    CentringTranslation,
    KeyBiasShift,
    LayerNormBiasShift,
    ParallelBiasExchange,
    ReaderCentringTranslation,
    ValueBiasFold,
)


def _qk_algebra(
    slots: AttentionSlots, inv_freq: torch.Tensor | None, notes: list[str], layer: int
) -> tuple[Subalgebra, str]:
    r, rot = slots.qk_dim, slots.rotary_dim
    if slots.q_norm is not None:
        gq, gk = slots.q_norm.param, slots.k_norm.param
        half = rot // 2
        if _is_meta(gq):
            mask = torch.ones(half, dtype=torch.bool)
            if layer == 0:
                notes.append(
                    "QK-norm gains not materialised (meta device): rotations counted on every rotary pair, "
                    "as for freshly initialised gains"
                )
        else:
            gq64, gk64 = full_tensor(gq).double().cpu(), full_tensor(gk).double().cpu()
            mask = (gq64[:half] == gq64[half:rot]) & (gk64[:half] == gk64[half:rot])
        alg = RotaryCommutant(r, rot, pair_mask=mask, scalings=False, pass_block=False)
        return alg, (
            f"QK-norm: per-head normalisation admits only rotations, on the {int(mask.sum())}/{half} rotary "
            "pairs whose q/k gains are equal (per key head)"
        )
    if rot == 0:
        return FullLinear(r), "full GL(r) per key head (no rotary positions)"
    if inv_freq is not None and not _is_meta(inv_freq) and inv_freq.unique().numel() < inv_freq.numel():
        notes.append(f"layer {layer}: repeated rotary frequencies; the commutant is larger than counted")
    if rot < r:
        return RotaryCommutant(r, rot), f"RoPE commutant on {rot} rotary dims + GL({r - rot}) on the rest, per key head"
    return RotaryCommutant(r, rot), "RoPE commutant (a complex scalar per rotary pair): r per key head"


def symmetry_groups(model: nn.Module) -> tuple[list[SymmetryGroup], list[str]]:
    """The continuous symmetry groups that hold for `model`'s weights as stored, and notes on what breaks others.

    Raises UnsupportedModelError ("unsupported: <class>") for a model no adapter knows."""
    builder = _GroupBuilder(get_adapter(model))
    for layer in builder.adapter.layers():
        builder.add_layer(layer)
    builder.add_final_norm_and_head()
    builder.add_centring_translations()
    builder.add_residual_rotation()
    return builder.groups, builder.notes


class _GroupBuilder:
    """Collects the groups of one model layer by layer, and what the residual rotation acts on: rows in residual
    coordinates, writers (maps into the stream), readers (maps behind a norm), and each layer's centring targets."""

    def __init__(self, adapter: ArchitectureAdapter) -> None:
        self.adapter = adapter
        self.groups: list[SymmetryGroup] = []
        self.notes: list[str] = []
        self.inv_freq = adapter.rope_inv_freq()
        self.rows: list[TensorSlot] = list(adapter.embedding_slots())
        self.writers: list[TensorSlot] = []
        self.readers: list[ResidualReader] = []
        #: False once a norm's readers are stored gauge-fixed (the rotation is then counted only)
        self.residual_linear = True
        #: some norm centres its input (LayerNorm)
        self.centring = False
        #: the final gain's clusters of equal values (the rotation must commute with that gain), None: no constraint
        self.clusters: list[list[int]] | None = None
        self.translation_columns: dict[int, list[TensorSlot]] = {}
        self.translation_vectors: dict[int, list[TensorSlot]] = {}
        #: gains of the norms between sublayers and the stream (the rotation must commute with each)
        self.post_gains: list[TensorSlot] = []

    def note_once(self, layer: int, note: str) -> None:
        """A note that holds for every layer, recorded at layer 0."""
        if layer == 0:
            self.notes.append(note)

    # --- one layer ---------------------------------------------------------------------------------------------
    def add_layer(self, layer: LayerRoles) -> None:
        att = self.adapter.attention_slots(layer)
        mlp = self.adapter.mlp_slots(layer)
        self.add_qk(layer.index, att)
        self.add_vo(layer.index, att)
        if mlp.gated and not mlp.scale_fixed:
            self.groups.append(MLPScale(layer.index, mlp.up, mlp.down, mlp.up_bias))
        attention_readers = [(att.q, att.q_bias), (att.k, att.k_bias), (att.v, att.v_bias)]
        self.add_norm(layer.index, "attention_norm", layer.attention_norm, attention_readers)
        self.add_norm(layer.index, "mlp_norm", layer.mlp_norm, mlp.readers())
        exchange = layer.parallel and att.o_bias is not None and mlp.down_bias is not None
        if exchange:  # only b_O + b_down reaches the stream
            self.groups.append(ParallelBiasExchange(layer.index, att.o_bias, mlp.down_bias))
        for post in (layer.attention_post_norm, layer.mlp_post_norm):
            self.add_post_norm(post)
        self.add_writers(layer.index, att, mlp, skip_down_bias=exchange)

    def add_qk(self, i: int, att: AttentionSlots) -> None:
        if att.qk_gauge_fixed:
            self.note_once(i, "QK gauge fixed in storage (pivot gauge): no QK redundancy left")
        else:
            alg, desc = _qk_algebra(att, self.inv_freq, self.notes, i)
            if alg.dimension() > 0:
                self.groups.append(QKGauge(i, att, alg, desc, key_bias_free=_key_bias_free(att)))
            if att.q_norm is not None:
                self.groups.append(
                    QKNormGainExchange(i, att.q_norm, att.k_norm, att.rotary_dim, offset=att.qk_norm_offset)
                )
                self.note_once(
                    i,
                    "QK-norm: the per-head scale of W_Q/W_K is a symmetry only up to the norm's epsilon, "
                    "so it is not counted",
                )
        if _key_bias_free(att):
            self.groups.append(KeyBiasShift(i, att.k_bias))
        elif _key_bias_free(att, partial=True):  # the non-rotated coordinates of each key head
            r, rot = att.qk_dim, att.rotary_dim
            index = torch.arange(att.num_kv_heads * r).view(-1, r)[:, rot:].reshape(-1)
            self.groups.append(KeyBiasShift(i, att.k_bias, index))

    def add_vo(self, i: int, att: AttentionSlots) -> None:
        if att.vo_gauge_fixed:
            self.note_once(i, "VO gauge fixed in storage (pivot gauge): no VO redundancy left")
        elif att.v is not None and att.value_parallel_removal:
            desc = "CO(d_h) = scalings x rotations per kv head (value-space parallel removal breaks GL(d_h))"
            self.groups.append(VOGauge(i, att, Conformal(att.head_dim), desc))
        elif att.v is not None:
            self.groups.append(VOGauge(i, att, FullLinear(att.head_dim), "GL(d_h) per key/value head"))
        if att.v_bias is not None and att.o_bias is not None and not att.value_parallel_removal:
            self.groups.append(ValueBiasFold(i, att))

    def add_norm(
        self, i: int, tag: str, norm: nn.Module | None, maps: list[tuple[TensorSlot | None, TensorSlot | None]]
    ) -> None:
        """The gain and bias groups of the norm in front of `maps` (weight, bias), which read the stream through it."""
        ns = self.adapter.norm_slots(norm)
        self.centring = self.centring or ns.centring
        if any(w is None for w, _ in maps):  # gauge-fixed readers: reached through full weights only
            self.residual_linear = False
        present = [(w, b) for w, b in maps if w is not None]
        if ns.gain is not None:
            self.groups.append(NormGain(i, f"layers.{i}.{tag}_gain", ns, present))
        biased = all(b is not None for _, b in present)
        if ns.bias is not None and biased:
            self.groups.append(LayerNormBiasShift(i, f"layers.{i}.{tag}_bias_shift", ns.bias, present))
        if ns.centring:
            self.add_centring_readers(i, f"layers.{i}.{tag}", ns, present)
        self.readers.append(ResidualReader(ns.gain, ns.bias, present, ns.offset))

    def add_centring_readers(self, i: int | None, tag: str, ns, present) -> None:
        """The symmetries of the readers of a mean-centring norm: every map with a bias (every map, without a norm
        bias) may add u (1/g)^T to its weight; a norm bias read by some map without a bias exchanges with them."""
        free = [(w, b) for w, b in present if b is not None or ns.bias is None]
        if free:
            self.groups.append(
                ReaderCentringTranslation(i, f"{tag}_reader_centring", ns.gain, ns.bias, free, ns.offset)
            )
        if ns.bias is not None and len(free) < len(present):
            key = f"{tag}_centring_bias_exchange"
            self.groups.append(CentringBiasExchange(i, key, ns.gain, ns.bias, present, ns.offset))

    def add_post_norm(self, norm: nn.Module | None) -> None:
        """A norm between a sublayer and the stream (sandwich norm): its output enters the stream, so a residual
        rotation must commute with its gain (rotate only among coordinates of equal gain)."""
        ns = self.adapter.norm_slots(norm)
        if norm is None:
            return
        if ns.bias is not None or ns.centring:
            raise UnsupportedModelError(
                f"unsupported: {type(self.adapter.model).__name__} (a post-sublayer norm with a bias or centring)"
            )
        if ns.gain is not None:
            self.post_gains.append(ns.gain)

    def add_writers(self, i: int, att: AttentionSlots, mlp: MLPSlots, skip_down_bias: bool = False) -> None:
        """The layer's maps into the residual stream (rotated on their output side) and their biases (rows).
        `skip_down_bias`: the down bias's centring translation is already spanned by the parallel exchange."""
        columns = self.translation_columns.setdefault(i, [])
        vectors = self.translation_vectors.setdefault(i, [])
        for weight, bias in ((att.o, att.o_bias), (mlp.down, mlp.down_bias)):
            if weight is not None:
                self.writers.append(weight)
                columns.append(weight)
            if bias is not None:
                self.rows.append(bias)
                if not (skip_down_bias and bias is mlp.down_bias):
                    vectors.append(bias)

    # --- the end of the stack ----------------------------------------------------------------------------------
    def add_final_norm_and_head(self) -> None:
        final = self.adapter.norm_slots(self.adapter.final_norm())
        head = self.adapter.head_slot()
        if head is None:
            return
        if not self.adapter.head_tied():
            if final.gain is not None:
                self.groups.append(NormGain(None, "final_norm_gain", final, [(head, None)]))
            if final.centring:
                self.add_centring_readers(None, "final_norm", final, [(head, None)])
            # a final bias with no head bias to absorb it moves with the rotation (ResidualReader.moves_bias)
            self.readers.append(ResidualReader(final.gain, final.bias, [(head, None)], final.offset))
            self.clusters = _gain_clusters(self.post_gains, self.notes)
            return
        if final.gain is not None:
            self.notes.append("final norm gain not foldable: the output head is tied to the embedding")
        self.clusters = _gain_clusters(self.post_gains + ([final.gain] if final.gain is not None else []), self.notes)
        if final.bias is not None:
            self.rows.append(final.bias)

    def add_centring_translations(self) -> None:
        """With LayerNorm centring, the all-ones direction of every writer is a translation symmetry."""
        if not self.centring:
            return
        self.notes.append(
            "LayerNorm centring: residual rotations must fix the all-ones direction (O(d) -> O(d-1)); the "
            "all-ones direction of every writer becomes a translation symmetry"
        )
        tied = self.adapter.head_tied()
        embedding = self.adapter.embedding().weight
        global_rows = [s for s in self.adapter.embedding_slots() if not (tied and s.param is embedding)]
        if tied:
            self.notes.append("token-embedding translations broken by the tied head")
        for i in sorted(self.translation_columns):
            key = f"layers.{i}.centring_translation"
            vectors = self.translation_vectors.get(i, [])
            self.groups.append(CentringTranslation(i, key, self.translation_columns[i], [], vectors))
        if global_rows:
            self.groups.append(CentringTranslation(None, "embeddings.centring_translation", [], global_rows, []))

    def add_residual_rotation(self) -> None:
        if len(self.adapter.embedding_slots()) > 1:
            self.notes.append(
                "absolute position embeddings rotate with the stream: they do not break the residual rotation"
            )
        if self.adapter.head_slot() is None:
            self.notes.append(
                "no LM head known to the adapter: the outputs read the residual stream directly, and a residual "
                "rotation changes, so it is not a symmetry"
            )
            return
        note = "" if self.residual_linear else "counted only: factors stored gauge-fixed (canonicalize re-gauges)"
        d = self.adapter.embedding().weight.shape[1]
        residual = ResidualRotation(
            d,
            self.rows,
            self.writers,
            self.readers,
            self.clusters,
            self.centring or self.adapter.input_centring(),
            linear=self.residual_linear,
            note=note,
        )
        if residual.dimension() > 0:
            self.groups.append(residual)


def _key_bias_free(att: AttentionSlots, partial: bool = False) -> bool:
    """The key bias cancels in the softmax: no rotary positions (which would rotate it per position), no QK-norm.
    `partial`: with partial rotary, its non-rotated coordinates cancel."""
    rotary = 0 < att.rotary_dim < att.qk_dim if partial else att.rotary_dim == 0
    return att.k_bias is not None and rotary and att.q_norm is None and not att.qk_gauge_fixed


def _gain_clusters(gains: list[TensorSlot], notes: list[str]) -> list[list[int]] | None:
    """The coordinates on which every gain of `gains` is constant (the finest common refinement of their clusters of
    equal values): a residual rotation must commute with each of them. None: no constraint."""
    if not gains:
        return None
    if any(_is_meta(g.param) for g in gains):
        also = "" if len(gains) == 1 else ", nor the sandwich norms' gains"
        notes.append(f"final norm gain not materialised (meta device){also}: assumed constant (as initialised)")
        return None
    keys = torch.stack([full_tensor(g.param).double().cpu() for g in gains], 1)  # (d, gains)
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(keys.tolist()):
        groups.setdefault(tuple(row), []).append(i)
    clusters = sorted(groups.values(), key=lambda c: c[0])
    if len(clusters) > 1:
        what = "final gain" if len(gains) == 1 else f"{len(gains)} gains in front of the stream"
        notes.append(f"residual rotation reduced to the commutant of the {what} ({len(clusters)} distinct values)")
    return clusters
