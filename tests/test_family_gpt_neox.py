"""GPT-NeoX (Pythia) from Transformers' own config class: fused query_key_value laid out per head, LayerNorm with
biases, partial rotary (rotary_pct), attention and MLP in parallel or in sequence, untied head. The groups counted
are those of its forward pass (hand-derived closed forms, a random element keeps the logits, the count equals the
orbit dimension measured numerically); analyze, the Trainer and canonicalize work on it; convert and compress refuse
it in one line naming the features the relational architecture cannot hold yet."""

from __future__ import annotations

import pytest
import torch
from family_checks import (
    assert_refused_in_one_line,
    counted_dimension,
    largest_logit_change_under_random_symmetry,
    measured_orbit_dimension,
    nonlinear_weights,
    projected_update_is_horizontal,
    randomize_gains_and_biases,
    run_cli,
    site_updates,
    train_projected_and_suppressed,
)
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

from relational_hf.symmetry import redundancy_report
from relational_hf.symmetry.report import redundancy_report_from_checkpoint

V, D, L, H, DH, F = 64, 32, 2, 4, 8, 64
ROT = 2  # rotary_pct 0.25 of d_h = 8


def tiny(parallel: bool = True, seed: int = 0, **overrides) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F,
        max_position_embeddings=64, rotary_pct=ROT / DH, use_parallel_residual=parallel, **overrides,
    )  # fmt: skip
    return randomize_gains_and_biases(GPTNeoXForCausalLM(config)).eval()


def expected(parallel: bool) -> dict[str, int]:
    """Per layer: QK = rotary commutant (ROT) + GL on the DH - ROT other coordinates, per head; the key bias on those
    coordinates cancels in the softmax; VO = GL(DH) per head, b_V folds into b_O; both LayerNorms fold their gains
    into the readers and shift their biases into the readers' biases; every reader row may add u (1/g) (centring):
    3D (query_key_value) + F (dense_h_to_4h); in parallel, only b_O + b_down reaches the stream. Model-wide: the final
    gain folds into the untied head, the final bias trades with the bias-free head (d), the writers' columns, biases
    and the embedding rows move along the all-ones direction (the down bias's move is the exchange's when parallel),
    and the residual rotation fixes the all-ones direction: O(d - 1)."""
    per_writer = (D + 1) + (F + (0 if parallel else 1))
    counts = {
        "qk_gauge": L * H * (ROT + (DH - ROT) ** 2),
        "key_bias_shift": L * H * (DH - ROT),
        "vo_gauge": L * H * DH**2,
        "value_bias_fold": L * D,
        "norm_gain": 2 * L * D + D,
        "layernorm_bias_shift": 2 * L * D,
        "reader_centring_translation": L * (3 * D + F),
        "centring_bias_exchange": D,
        "centring_translation": L * per_writer + V,
        "residual_rotation": (D - 1) * (D - 2) // 2,
    }
    if parallel:
        counts["parallel_bias_exchange"] = L * D
    return counts


@pytest.mark.parametrize("parallel", [True, False])
def test_counts_by_group_equal_the_closed_forms(parallel):
    report = redundancy_report(tiny(parallel), descriptors=False)
    assert report.by_group == expected(parallel)


@pytest.mark.parametrize("parallel", [True, False])
def test_a_random_group_element_keeps_the_logits(parallel):
    model = tiny(parallel)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    scale = model(ids).logits.abs().max().item()
    assert largest_logit_change_under_random_symmetry(model, ids) < 1e-4 * max(1.0, scale)


def test_counted_dimension_equals_the_orbit_dimension_measured_numerically():
    """d = 8, one sequential layer, 2 heads of width 4 with 2 rotary coordinates, random gains and biases, matrices at
    unit scale: the Jacobian of the logits has a null space of exactly the counted dimension."""
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=8, rotary_pct=0.5, use_parallel_residual=False,
    )  # fmt: skip
    model = nonlinear_weights(randomize_gains_and_biases(GPTNeoXForCausalLM(config)))
    nullity, gap = measured_orbit_dimension(model, vocab=32, length=8, rows=16)
    assert gap > 4  # decades between the symmetry directions and the rest
    assert nullity == counted_dimension(model)


def test_a_checkpoint_saved_by_transformers_is_read_layer_by_layer(tmp_path):
    """Transformers saves the head as embed_out and loads it as lm_head: the layer-by-layer reader follows its
    renaming, so the streamed report equals the in-memory one, and the command reads the folder as it is."""
    model = tiny()
    model.save_pretrained(tmp_path / "src")
    streamed = redundancy_report_from_checkpoint(tmp_path / "src", descriptors=False)
    assert streamed.by_group == redundancy_report(model, descriptors=False).by_group
    code, out, err = run_cli(["redundancy", str(tmp_path / "src")])
    assert code == 0, err
    assert "centring_bias_exchange" in out


@pytest.mark.parametrize("parallel", [True, False])
def test_site_updates_add_up_to_the_block_update(parallel):
    """What the residual sites read is what enters the stream: attention + MLP update = the layer's update."""
    model = tiny(parallel)
    seen = site_updates(model, torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2)))
    for layer in range(L):
        total = seen[("residual_attention", layer)] + seen[("residual_mlp", layer)]
        torch.testing.assert_close(total, seen[("block", layer)], atol=1e-5, rtol=1e-5)


def test_analyze_measures_every_site(tmp_path):
    tiny().save_pretrained(tmp_path / "src")
    torch.save(torch.randint(0, V, (96,), generator=torch.Generator().manual_seed(0)), tmp_path / "ids.pt")
    code, _, err = run_cli([
        "analyze", str(tmp_path / "src"), "--text", str(tmp_path / "ids.pt"), "--out", str(tmp_path / "out"),
        "--seq-len", "16", "--sweep-values", "0", "--no-per-layer", "--compression", "none",
    ])  # fmt: skip
    assert code == 0, err
    import json

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    sites = ("residual_attention", "residual_mlp", "block", "value", "value_exclude_self")
    for site in sites:
        assert [row["layer"] for row in report["decomposition"][site]] == list(range(L))
        assert all(row["count"] > 0 for row in report["decomposition"][site])


def test_projection_is_horizontal_and_the_trainer_projects_and_suppresses(tmp_path):
    assert projected_update_is_horizontal(tiny()) < 1e-6
    log = train_projected_and_suppressed(tiny(), tmp_path, V)
    assert 0 < log["parallel_suppression"] <= 0.3 and log["orbit_drift"] >= 0


def test_convert_and_compress_refuse_in_one_line_and_canonicalize_keeps_the_function(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "src")
    features = ("LayerNorm with centring and biases", "parallel attention and MLP")
    assert_refused_in_one_line("convert", [str(tmp_path / "src"), str(tmp_path / "c")], *features)
    assert_refused_in_one_line("compress", [str(tmp_path / "src"), str(tmp_path / "k"), "--remove", "0.2"], *features)
    assert not (tmp_path / "c").exists() and not (tmp_path / "k").exists()
    code, _, err = run_cli(["canonicalize", str(tmp_path / "src"), str(tmp_path / "canonical")])
    assert code == 0, err
    canonical = AutoModelForCausalLM.from_pretrained(tmp_path / "canonical").eval()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (canonical(ids).logits - model(ids).logits).abs().max() < 1e-4
