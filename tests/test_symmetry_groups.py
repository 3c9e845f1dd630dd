"""Groups per architecture: invariance of the function under random group elements, dimensions against hand-derived
closed forms, freeness of the combined action (numerical rank), what breaks or shrinks a group."""

from __future__ import annotations

import copy

import pytest
import torch
from test_symmetry_zoo import (
    ALL,
    LINEAR,
    build,
    perturb,
    token_ids,
)
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.architectures import UnsupportedModelError
from relational_hf.symmetry import (
    apply_random_symmetry,
    redundancy_report,
    redundancy_report_from_config,
    symmetry_groups,
)
from relational_hf.symmetry.groups import ResidualRotation

# ---- closed forms, worked out by hand for the zoo's configs ----------------------------------------------------
# Common sizes: V = 128, d = 32, d_ff = 64, L = 2 layers, H = 4 query heads, d_h = r = 8; H_kv = 2 unless MHA.
V, D, F, L, H, DH = 128, 32, 64, 2, 4, 8
O_D = D * (D - 1) // 2  # residual rotation O(d): 496
EXPECTED = {
    # RoPE commutant r per kv head, GL(d_h) per kv head, SwiGLU d_ff per layer, 2 gains per layer + final (untied)
    "llama": {
        "qk_gauge": L * 2 * DH,
        "vo_gauge": L * 2 * DH**2,
        "mlp_scale": L * F,
        "norm_gain": (2 * L + 1) * D,
        "residual_rotation": O_D,
    },
    # tied head: final gain not foldable; o bias: b_V folds into b_O (d_h per kv head)
    "llama_tied_bias": {
        "qk_gauge": L * 2 * DH,
        "vo_gauge": L * 2 * DH**2,
        "value_bias_fold": L * 2 * DH,
        "mlp_scale": L * F,
        "norm_gain": 2 * L * D,
        "residual_rotation": O_D,
    },
    "mistral": {
        "qk_gauge": L * 2 * DH,
        "vo_gauge": L * 2 * DH**2,
        "mlp_scale": L * F,
        "norm_gain": (2 * L + 1) * D,
        "residual_rotation": O_D,
    },
    # q/k/v biases but no o bias: nothing extra; tied head
    "qwen2": {
        "qk_gauge": L * 2 * DH,
        "vo_gauge": L * 2 * DH**2,
        "mlp_scale": L * F,
        "norm_gain": 2 * L * D,
        "residual_rotation": O_D,
    },
    # QK-norm: rotations only, on the r/2 pairs (gains equal at init) per kv head; gain exchange r/2 per layer
    "qwen3": {
        "qk_gauge": L * 2 * DH // 2,
        "qk_norm_gain_exchange": L * DH // 2,
        "vo_gauge": L * 2 * DH**2,
        "value_bias_fold": L * 2 * DH,
        "mlp_scale": L * F,
        "norm_gain": (2 * L + 1) * D,
        "residual_rotation": O_D,
    },
    # GPT-2 (MHA, no rotary, fused c_attn, LayerNorm, absolute positions P = 64, tied head, GELU MLP 4d):
    "gpt2": {
        "qk_gauge": L * H * DH**2,
        "key_bias_shift": L * D,
        "vo_gauge": L * H * DH**2,
        "value_bias_fold": L * D,
        "norm_gain": 2 * L * D,
        "layernorm_bias_shift": 2 * L * D,
        "reader_centring_translation": L * (3 * D + 4 * D),  # reader rows + u (1/g): c_attn and c_fc outputs
        "centring_translation": L * ((D + 1) + (4 * D + 1)) + 64,  # writer columns + biases, wpe rows
        "residual_rotation": (D - 1) * (D - 2) // 2,
    },  # O(d-1): rotations fixing the all-ones direction
    "relational_free": {
        "qk_gauge": L * 2 * DH,
        "vo_gauge": L * 2 * DH**2,
        "mlp_scale": L * F,
        "residual_rotation": O_D,
    },
    # no rotary: GL(r); key bias shift; CO(d_h) = 1 + d_h(d_h-1)/2 per (MHA) head
    "relational_free_none_vpr": {
        "qk_gauge": L * H * DH**2,
        "key_bias_shift": L * D,
        "vo_gauge": L * H * (1 + DH * (DH - 1) // 2),
        "mlp_scale": L * F,
        "residual_rotation": O_D,
    },
    "relational_pivot": {"residual_rotation": O_D},
    "relational_pivot_vpr": {"vo_gauge": L * H * (1 + DH * (DH - 1) // 2), "residual_rotation": O_D},
}


@pytest.mark.parametrize("name", ALL)
def test_redundancy_counts_equal_closed_forms(name):
    report = redundancy_report(build(name), descriptors=False)
    assert report.by_group == EXPECTED[name]
    assert report.redundant_dimensions == sum(EXPECTED[name].values())
    assert report.quotient_dimension == report.total_parameters - report.redundant_dimensions


@pytest.mark.parametrize("name", ALL)
def test_random_element_of_all_groups_leaves_logits_unchanged_fp32(name):
    model = perturb(build(name))
    ids = token_ids()
    before = model(ids).logits
    moved = apply_random_symmetry(copy.deepcopy(model), torch.Generator().manual_seed(7), scale=0.5)
    raw = max((a - b).abs().max().item() for a, b in zip(model.parameters(), moved.parameters(), strict=True))
    assert raw > 1e-2, "the group element must actually move the stored parameters"
    assert (moved(ids).logits - before).abs().max().item() < 1e-4


def _micro(name: str) -> torch.nn.Module:
    """d = 8 models (1 layer, 2 query heads of width 4) small enough for a dense rank computation."""
    torch.manual_seed(0)
    kw = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    if name == "llama":
        return LlamaForCausalLM(
            LlamaConfig(**kw, num_key_value_heads=1, tie_word_embeddings=False, attention_bias=True)
        )
    if name == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**kw, num_key_value_heads=1, head_dim=4, attention_bias=True))
    if name == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8, bos_token_id=0, eos_token_id=0)
        )
    return RelationalForCausalLM(
        RelationalConfig(**kw, gauge="free", position_encoding="none", value_parallel_removal=True, attention_bias=True)
    )


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "relational"])
def test_combined_action_is_free_rank_equals_redundant_dimensions(name):
    """The vertical map xi (all groups together) has rank = sum of the group dimensions: no group is overcounted
    and no two actions overlap. Random algebra elements (adjoints of random vectors) oversample each group by 4."""
    model = perturb(_micro(name)).double()
    groups, _ = symmetry_groups(model)
    params = {id(s.param): s.param for g in groups for s in g.slots()}
    generator = torch.Generator().manual_seed(0)
    columns = []
    for g in groups:
        own = {id(s.param): s.param for s in g.slots()}
        for _ in range(g.dimension() + 4):
            probe = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in own.items()}
            out = {k: torch.zeros(p.shape, dtype=torch.float64) for k, p in params.items()}
            g.vertical(g.adjoint(probe), out)
            columns.append(torch.cat([t.reshape(-1) for t in out.values()]))
    sv = torch.linalg.svdvals(torch.stack(columns, 1))
    rank = int((sv > 1e-9 * sv[0]).sum())
    assert rank == sum(g.dimension() for g in groups) > 0


def test_qk_norm_gains_that_differ_within_rotary_pairs_remove_the_rotations():
    model = build("qwen3")
    before = redundancy_report(model, descriptors=False).by_group
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight[0] = 1.5  # pair (0, 4) no longer has equal gains
    after = redundancy_report(model, descriptors=False).by_group
    assert before["qk_gauge"] - after["qk_gauge"] == L * 2  # one rotation per kv head per layer lost
    assert after["qk_norm_gain_exchange"] == before["qk_norm_gain_exchange"]


def test_tied_head_with_clustered_final_gain_keeps_only_the_commutant_rotations():
    model = build("qwen2")
    with torch.no_grad():
        model.model.norm.weight[:20] = 2.0  # gain values: 20 coordinates at 2, 12 at 1
    report = redundancy_report(model, descriptors=False)
    assert report.by_group["residual_rotation"] == 20 * 19 // 2 + 12 * 11 // 2
    moved = apply_random_symmetry(copy.deepcopy(model), torch.Generator().manual_seed(3), scale=0.5)
    ids = token_ids()
    assert (moved(ids).logits - model(ids).logits).abs().max().item() < 1e-4


def test_relational_final_gain_in_front_of_a_tied_head_breaks_the_residual_rotation():
    """At gain one the residual rotation is a symmetry; once the (trainable) final gain varies it is not: the same
    rotation changes the logits, and the report drops the group."""
    model = build("relational_free")
    assert model.config.tie_word_embeddings and model.model.norm.weight is not None
    rotation = next(g for g in symmetry_groups(model)[0] if isinstance(g, ResidualRotation))
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(2)))
    ids = token_ids()
    before = model(ids).logits
    rotated = copy.deepcopy(model)
    next(g for g in symmetry_groups(rotated)[0] if isinstance(g, ResidualRotation)).act(q)
    assert (rotated(ids).logits - before).abs().max().item() < 1e-4  # gain one: a symmetry
    with torch.no_grad():
        for m in (model, rotated):
            m.model.norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(4)))
    assert (rotated(ids).logits - model(ids).logits).abs().max().item() > 1e-2  # varying gain: not a symmetry
    report = redundancy_report(model, descriptors=False)
    assert "residual_rotation" not in report.by_group and rotation.dimension() == D * (D - 1) // 2
    assert any("final norm gain not foldable" in n for n in report.notes)


def test_layernorm_centring_and_tied_head_are_reported_for_gpt2():
    report = redundancy_report(build("gpt2"), descriptors=False)
    text = " ".join(report.notes)
    assert "O(d) -> O(d-1)" in text and "tied" in text


def test_unknown_architecture_raises_unsupported_with_class_name():
    class Mystery(torch.nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="unsupported: Mystery"):
        redundancy_report(Mystery())


def test_llama_7b_shape_counts_from_config_on_meta_device():
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    )
    report = redundancy_report_from_config(config)
    d, layers, heads, dh = 4096, 32, 32, 128
    assert report.total_parameters == 6_738_415_616
    assert report.by_group == {
        "qk_gauge": layers * heads * dh,
        "vo_gauge": layers * heads * dh * dh,
        "mlp_scale": layers * 11008,
        "norm_gain": (2 * layers + 1) * d,
        "residual_rotation": d * (d - 1) // 2,
    }
    assert report.descriptors is None


@pytest.mark.parametrize("name", LINEAR)
def test_balance_of_a_group_is_its_moment_map(name):
    """For linear actions the balance is <theta, xi(X)> = <xi^T theta, X> for every X in the algebra."""
    model = perturb(build(name)).double()
    groups, _ = symmetry_groups(model)
    generator = torch.Generator().manual_seed(2)
    for g in groups:
        if not g.linear or g.name == "residual_rotation":
            continue
        params = {id(s.param): s.param.detach() for s in g.slots()}
        probe = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in params.items()}
        x = g.adjoint(probe)
        out = {k: torch.zeros(p.shape, dtype=torch.float64) for k, p in params.items()}
        g.vertical(x, out)
        lhs = sum(float((params[k].double() * out[k]).sum()) for k in params)
        rhs = sum(float((m * xi).sum()) for m, xi in zip(g.balance(), x, strict=True))
        assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs)), g.key


def test_base_model_without_lm_head_has_no_residual_rotation():
    """A base model returns residual-stream states; rotating the stream changes them, so O(d) is not counted."""
    from transformers import LlamaModel

    torch.manual_seed(0)
    base = LlamaModel(
        LlamaConfig(
            vocab_size=V,
            hidden_size=D,
            intermediate_size=F,
            num_hidden_layers=L,
            num_attention_heads=H,
            num_key_value_heads=2,
        )
    )
    assert "residual_rotation" not in redundancy_report(base, descriptors=False).by_group
