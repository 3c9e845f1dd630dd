"""GPT-NeoX (Pythia) from Transformers' own config class: fused query_key_value laid out per head, LayerNorm with
biases, partial rotary (rotary_pct), attention and MLP in parallel or in sequence, untied head. The groups counted
are those of its forward pass (hand-derived closed forms, a random element keeps the logits, the count equals the
orbit dimension measured numerically); analyze, the Trainer and canonicalize work on it. `convert` is exact in both
residual forms (`relational_hf.convert.layernorm`: writes centred, LayerNorms folded into RMS norms, partial rotary
and the parallel residual held by the relational architecture, the QK pair kept free because partial rotary leaves GL
on the non-rotated block); `compress` (streamed or in memory) keeps the QK forms at full width."""

from __future__ import annotations

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
    run_cli,
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
    assert_site_updates_add_up(tiny(parallel), V, L)


def test_analyze_measures_every_site(tmp_path):
    report = analyze_report(tiny(), tmp_path, V)
    sites = ("residual_attention", "residual_mlp", "block", "value", "value_exclude_self")
    for site in sites:
        assert [row["layer"] for row in report["decomposition"][site]] == list(range(L))
        assert all(row["count"] > 0 for row in report["decomposition"][site])


def test_projection_is_horizontal_and_the_trainer_projects_and_suppresses(tmp_path):
    assert projected_update_is_horizontal(tiny()) < 1e-6
    log = train_projected_and_suppressed(tiny(), tmp_path, V)
    assert 0 < log["parallel_suppression"] <= 0.3 and log["orbit_drift"] >= 0


@torch.no_grad()
def convertible(parallel: bool, seed: int = 0, **overrides) -> GPTNeoXForCausalLM:
    """`tiny` with every matrix at unit scale (logits of a few units) and random LayerNorm gains and biases."""
    return nonlinear_weights(tiny(parallel, seed, **overrides), seed=seed + 2).float().eval()


def _ids(seed: int = 9, batch: int = 3, length: int = 24) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_convert_is_exact_streamed_and_in_memory(parallel, tmp_path):
    """Logits within 1e-4 of the logit scale both ways; the stored count drops by the four LayerNorm vectors of each
    layer and the final gain (folded into the untied head) and the VO gauge (d_h^2 per head: pivot); the QK pair stays free (partial rotary) and its gauge is
    reported as left; the relational model holds the residual form, partial rotary and the plain MLP."""
    import json

    source = convertible(parallel)
    source.save_pretrained(tmp_path / "src")
    ids = _ids()
    with torch.no_grad():
        expected = source(ids).logits
    assert 1.0 < float(expected.abs().max()) < 100.0
    loaded = {}
    for name, extra in (("streamed", []), ("in_memory", ["--no-stream"])):
        code, _, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / name), *extra])
        assert code == 0, err
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        c = model.config
        assert c.parallel_residual == parallel and c.rotary_dim == ROT and not c.mlp_gated and c.mlp_bias
        assert not c.tie_word_embeddings and not c.embedding_centring and c.final_norm_bias
        with torch.no_grad():
            got = model(ids).logits
        assert float((got - expected).abs().max()) < 1e-4 * max(1.0, float(expected.abs().max()))
        stored = sum(p.numel() for p in model.parameters())
        report = json.loads((tmp_path / name / "conversion_report.json").read_text())
        assert stored == report["relational_parameters"] == report["expected_parameters"]
        # every layer's two LayerNorms (gains and biases) and the final gain fold; the final bias is kept (as beta / g)
        assert stored == sum(p.numel() for p in source.parameters()) - 4 * L * D - D - L * H * DH**2
        assert report["removed_orbit_dimensions"] == {"vo_gauge": L * H * DH**2}
        assert report["remaining_symmetries"]["qk_gauge"] == L * H * (ROT + (DH - ROT) ** 2)
        # the untied embedding is stored mean-free: the stream the RMS norms read is mean-free
        assert float(model.model.embed_tokens.weight.detach().mean(-1).abs().max()) < 1e-6
        loaded[name] = model.state_dict()
    assert loaded["streamed"].keys() == loaded["in_memory"].keys()


def test_converted_checkpoint_loads_with_remote_code_alone_and_generates_the_same_tokens(tmp_path):
    from family_helpers import assert_remote_code_load

    source = convertible(True, seed=3)
    source.save_pretrained(tmp_path / "src")
    code, _, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / "relational")])
    assert code == 0, err
    assert_remote_code_load(tmp_path / "relational", tmp_path, source, _ids(length=12))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "relational", dtype=torch.float32).eval()
    prompt = _ids(seed=4, batch=2, length=5)
    ours = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    theirs = source.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
    for target in ("llama", "qwen3", "gguf"):  # no export target holds the plain MLP yet: one line, nothing written
        code, _, err = run_cli(["export", str(tmp_path / "relational"), str(tmp_path / target), "--to", target])
        lines = [line for line in err.splitlines() if "error:" in line]
        assert code == 2 and len(lines) == 1 and ("mlp_gated=False" in lines[0] or "no GGUF form" in lines[0]), err
        assert not (tmp_path / target).exists()


def test_partial_rotary_conversion_keeps_its_symmetries(tmp_path):
    """On the converted model the QK pair keeps the rotary commutant on the rotated coordinates and GL on the others
    (stored free): a random element of every counted group keeps the logits."""
    from relational_hf.convert import to_relational

    model, report = to_relational(convertible(False, seed=5), return_report=True)
    by_group = redundancy_report(model, descriptors=False).by_group
    assert by_group["qk_gauge"] == L * H * (ROT + (DH - ROT) ** 2) and "vo_gauge" not in by_group
    # the report's symmetries left are the converted model's own (untied head: the final gain folded, all of O(d))
    assert report.remaining_symmetries == by_group and by_group["residual_rotation"] == D * (D - 1) // 2
    ids = _ids(length=12)
    scale = float(model(ids).logits.abs().max())
    assert largest_logit_change_under_random_symmetry(model, ids) < 1e-4 * max(1.0, scale)


def test_attention_without_biases_is_refused_in_one_line(tmp_path):
    tiny(attention_bias=False).save_pretrained(tmp_path / "src")
    assert_refused_in_one_line("convert", [str(tmp_path / "src"), str(tmp_path / "c")], "attention_bias=False")
    assert not (tmp_path / "c").exists()


def test_canonicalize_keeps_the_function(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "src")
    code, _, err = run_cli(["canonicalize", str(tmp_path / "src"), str(tmp_path / "canonical")])
    assert code == 0, err
    canonical = AutoModelForCausalLM.from_pretrained(tmp_path / "canonical").eval()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (canonical(ids).logits - model(ids).logits).abs().max() < 1e-4


def test_partial_rotary_and_parallel_residual_options_are_validated_in_one_line():
    from relational_hf import RelationalConfig

    base = dict(vocab_size=16, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2)
    partial = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    config = RelationalConfig(**base, rope_parameters=partial, parallel_residual=True)
    assert config.rotary_dim == 2 and config.parallel_residual
    for bad in (0.0, 1.5, 0.1875):  # outside (0, 1]; 1.5 coordinates of 8
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            RelationalConfig(**base, rope_parameters={**partial, "partial_rotary_factor": bad})
    with pytest.raises(ValueError, match="partial_rotary_factor.*qk_norm"):
        RelationalConfig(**base, rope_parameters=partial, qk_norm=True)
    with pytest.raises(ValueError, match="parallel_residual"):
        config.parallel_residual = "yes"


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_export_to_gpt_neox_gives_the_sources_logits_streamed_and_in_memory(parallel, tmp_path):
    """convert (streamed and in memory) -> export --to gpt_neox -> Transformers' own GPTNeoXForCausalLM: the source's
    logits (< 1e-4 of the logit scale) on random LayerNorm gains and biases, with its partial rotary, residual form and
    untied head; the same stored count as the source (unit gains and zero biases in the layers' LayerNorms, the VO gauge
    stored again)."""
    source = convertible(parallel, seed=6)
    source.save_pretrained(tmp_path / "src")
    ids = _ids(length=32)
    with torch.no_grad():
        expected = source(ids).logits
    for name, extra in (("streamed", []), ("in_memory", ["--no-stream"])):
        code, _, err = run_cli(["convert", str(tmp_path / "src"), str(tmp_path / name), *extra])
        assert code == 0, err
        out = tmp_path / f"{name}_neox"
        code, _, err = run_cli(["export", str(tmp_path / name), str(out), "--to", "gpt_neox"])
        assert code == 0, err
        exported = GPTNeoXForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        c = exported.config
        assert c.use_parallel_residual == parallel and c.rope_parameters["partial_rotary_factor"] == ROT / DH
        assert not c.tie_word_embeddings and exported.lm_head.weight is not exported.gpt_neox.embed_in.weight
        with torch.no_grad():
            got = exported(ids).logits
        assert float((got - expected).abs().max()) < 1e-4 * max(1.0, float(expected.abs().max()))
        assert sum(p.numel() for p in exported.parameters()) == sum(p.numel() for p in source.parameters())
        for layer in exported.gpt_neox.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                assert bool((norm.weight == 1).all()) and bool((norm.bias == 0).all())


def test_export_to_gpt_neox_refuses_in_one_line_what_it_cannot_hold(tmp_path):
    """A relational model with grouped key/value heads or a QK rank below the head width has no GPT-NeoX form: one line
    naming the field, nothing written."""
    from relational_hf import RelationalConfig, RelationalForCausalLM

    partial = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    base = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=1, num_attention_heads=H,
                mlp_gated=False, mlp_bias=True, rope_parameters=partial)  # fmt: skip
    for overrides, named in ((dict(num_key_value_heads=2), "num_key_value_heads=2"), (dict(qk_rank=4), "qk_rank=4")):
        RelationalForCausalLM(RelationalConfig(**base, **overrides)).save_pretrained(tmp_path / named)
        argv = [str(tmp_path / named), str(tmp_path / f"{named}_out"), "--to", "gpt_neox"]
        code, _, err = run_cli(["export", *argv])
        lines = [line for line in err.splitlines() if "error:" in line]
        assert code == 2 and len(lines) == 1 and named in lines[0], err
        assert not (tmp_path / f"{named}_out").exists()


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_compress_keeps_the_partial_rotary_qk_forms_and_exports_back_to_gpt_neox(parallel, tmp_path, capsys):
    """`compress --remove 0.1` of a Pythia-like checkpoint (the byte-level vocabulary, random LayerNorm gains and
    biases; a local folder, so streamed one layer at a time, the same model as in memory:
    `tests/test_family_layernorm_stream.py`): the stored count is the report's and the closed form's
    (`assert_compress`) and at most 90% of the source's, the head stays untied, the perplexity is finite; the QK forms keep their full width (partial rotary:
    stored as they are, reported as `qk_kept_full`) while MLP units or VO ranks go; every write stays mean-free, so the
    result exports to GPTNeoXForCausalLM with the same logits (narrower layers padded with zeros)."""
    import math

    from family_helpers import VOCAB, assert_compress, load, relative_logit_difference, save, token_ids

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F,
        max_position_embeddings=64, rotary_pct=ROT / DH, use_parallel_residual=parallel,
    )  # fmt: skip
    source = nonlinear_weights(randomize_gains_and_biases(GPTNeoXForCausalLM(config))).eval()
    model = assert_compress(save(source, tmp_path / "src"), tmp_path, capsys, "compressed")
    report, c = model.compression_report, model.config
    assert report["parameters_after"] <= math.floor(0.9 * report["parameters_before"])
    assert math.isfinite(report["calibration_perplexity_after"]) and not c.tie_word_embeddings
    assert c.layer_qk_ranks is None and c.rotary_dim == ROT and c.parallel_residual == parallel
    assert sorted(report["qk_kept_full"]) == [str(i) for i in range(L)] and "partial rotary" in report["qk_kept_full"]["0"]
    assert sum(c.layer_intermediate_sizes) + sum(c.layer_value_ranks) < L * (F + DH)
    code, _, err = run_cli(["export", str(tmp_path / "compressed"), str(tmp_path / "neox"), "--to", "gpt_neox"])
    assert code == 0, err
    exported = GPTNeoXForCausalLM.from_pretrained(tmp_path / "neox", dtype=torch.float32).eval()
    assert relative_logit_difference(load(tmp_path / "compressed"), exported, token_ids()) < 1e-4
