"""Gemma 3 (text, Gemma3ForCausalLM) from Transformers' own config class: (1 + w) RMS gains, sandwich norms, per-head
QK-norm before RoPE, GELU-tanh gated MLP, sqrt(d) embedding scale, query_pre_attn_scalar, sliding-window layers, tied
head. The groups counted are those of its forward pass; analyze and the Trainer work on it; convert and compress
refuse it in one line naming the sandwich norms."""

from __future__ import annotations

import types

import pytest
import torch
from family_checks import (
    analyze_report,
    assert_refused_in_one_line,
    assert_site_updates_add_up,
    counted_dimension,
    largest_logit_change_under_random_symmetry,
    measured_orbit_dimension,
    nonlinear_weights,
    projected_update_is_horizontal,
    randomize_gains_and_biases,
    train_projected_and_suppressed,
)
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from relational_hf.symmetry import redundancy_report
from relational_hf.symmetry.report import redundancy_report_from_checkpoint

V, D, L, H, HKV, DH, F = 64, 32, 2, 4, 2, 8, 64


def config(**overrides) -> Gemma3TextConfig:
    sizes = dict(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=HKV, head_dim=DH,
        intermediate_size=F, max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=6,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    return Gemma3TextConfig(**(sizes | overrides))


def tiny(random_gains: bool = True, seed: int = 0, **overrides) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config(**overrides)).eval()
    return randomize_gains_and_biases(model) if random_gains else model


def test_counts_at_initial_gains_equal_the_closed_forms():
    """Gains at their initial w = 0 (all 1 + w equal): per layer QK rotations on every rotary pair per key head
    (QK-norm), the gain exchange per pair, GL(d_h) VO per key head, d_ff gated-MLP scales, the two pre-norms' gains;
    the sandwich norms' gains are equal, so the residual rotation O(d) survives."""
    report = redundancy_report(tiny(random_gains=False), descriptors=False)
    assert report.by_group == {
        "qk_gauge": L * HKV * DH // 2,
        "qk_norm_gain_exchange": L * DH // 2,
        "vo_gauge": L * HKV * DH**2,
        "mlp_scale": L * F,
        "norm_gain": 2 * L * D,
        "residual_rotation": D * (D - 1) // 2,
    }


def test_random_gains_remove_the_qk_rotations_and_the_residual_rotation():
    """Random QK-norm gains differ within rotary pairs (no rotation commutes with them); random sandwich-norm gains
    leave no rotation of the stream that commutes with all of them."""
    report = redundancy_report(tiny(), descriptors=False)
    assert report.by_group == {
        "qk_norm_gain_exchange": L * DH // 2,
        "vo_gauge": L * HKV * DH**2,
        "mlp_scale": L * F,
        "norm_gain": 2 * L * D,
    }
    assert any("commutant" in note for note in report.notes)


@pytest.mark.parametrize("random_gains", [False, True])
def test_a_random_group_element_keeps_the_logits(random_gains):
    model = tiny(random_gains)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    scale = model(ids).logits.abs().max().item()
    assert largest_logit_change_under_random_symmetry(model, ids) < 1e-4 * max(1.0, scale)


def _exact_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * (x.pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt() * (1 + norm.weight)


def _measurable(model: nn.Module) -> nn.Module:
    """The same function, differentiable as it is computed. Gemma's RMS norms compute in float32: for the float64
    Jacobian, the same formula in the input's dtype, bound as a method (a closure over the module would survive the
    measurement's deepcopy and read the original, constant gains: every gain's column would be zero). The embedding
    has a padding_idx, whose row reverse-mode differentiation leaves without the lookup's gradient (only the tied
    head's): the forward ignores padding_idx, so it is cleared."""
    for module in model.modules():
        if type(module).__name__ == "Gemma3RMSNorm":
            module.forward = types.MethodType(_exact_norm, module)
        if isinstance(module, nn.Embedding):
            module.padding_idx = None
    return model


@pytest.mark.parametrize("random_gains", [False, True])
def test_counted_dimension_equals_the_orbit_dimension_measured_numerically(random_gains):
    """d = 8, 2 layers (sliding, full), 2 query heads sharing one key head of width 4: the Jacobian of the logits
    has a null space of exactly the counted dimension (100 with random gains; 132 at w = 0, with the QK rotations and
    O(8)). The scale symmetries of the norms hold only up to their epsilon (per layer: each query head's and the key
    head's W_Q/W_K scale, the W_O and W_down scales behind the sandwich norms): they sit between the function's
    directions and the null space, are not null, and not counted. 32 rows of 8 tokens: with 16 the Jacobian's rank
    is bounded by the positions' d - 1 normalised directions plus the tied head's V d (about 1150 of 1496
    parameters), and the data, not the symmetries, makes the null space (304)."""
    torch.manual_seed(0)
    small = config(
        vocab_size=32, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
        max_position_embeddings=8, query_pre_attn_scalar=3,
    )  # fmt: skip
    model = nonlinear_weights(Gemma3ForCausalLM(small))
    if random_gains:
        randomize_gains_and_biases(model)
    nullity, gap = measured_orbit_dimension(_measurable(model), vocab=32, length=8, rows=32)
    assert gap > 4
    assert nullity == counted_dimension(model) == (100 if random_gains else 132)


def test_a_saved_checkpoint_is_read_layer_by_layer(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "src")
    streamed = redundancy_report_from_checkpoint(tmp_path / "src", descriptors=False)
    assert streamed.by_group == redundancy_report(model, descriptors=False).by_group


def test_site_updates_are_what_the_sandwich_norms_add_to_the_stream():
    assert_site_updates_add_up(tiny(), V, L)


def test_analyze_measures_every_site(tmp_path):
    report = analyze_report(tiny(), tmp_path, V)
    for site in ("residual_attention", "residual_mlp", "block", "value", "value_exclude_self"):
        assert [row["layer"] for row in report["decomposition"][site]] == list(range(L))


def test_projection_is_horizontal_and_the_trainer_projects_and_suppresses(tmp_path):
    assert projected_update_is_horizontal(tiny()) < 1e-6
    log = train_projected_and_suppressed(tiny(), tmp_path, V)
    assert 0 < log["parallel_suppression"] <= 0.3 and log["orbit_drift"] >= 0


def test_convert_and_compress_refuse_in_one_line(tmp_path):
    tiny().save_pretrained(tmp_path / "src")
    assert_refused_in_one_line("convert", [str(tmp_path / "src"), str(tmp_path / "c")], "sandwich norms")
    assert_refused_in_one_line("compress", [str(tmp_path / "src"), str(tmp_path / "k"), "--remove", "0.2"], "sandwich")
    assert not (tmp_path / "c").exists() and not (tmp_path / "k").exists()
