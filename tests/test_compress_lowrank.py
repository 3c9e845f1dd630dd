"""Compression in relational coordinates: per-layer widths, the truncations, the budget, the API and the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.commands.main import main
from relational_hf.compress import LowRankOptions, compress_relational, qk_truncate, vo_truncate
from relational_hf.compress.lowrank import layer_kind_parameters, value_grams
from relational_hf.convert import to_relational
from relational_hf.jobs import compress_model
from relational_hf.params import relational_parameter_count

VARIED = dict(
    vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, layer_qk_ranks=[8, 4, 2], layer_value_ranks=[8, 3, 5],
    layer_intermediate_sizes=[48, 10, 30],
)


def _stored(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _llama(layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm gains, so folding them is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("gauge", ["pivot", "free"])
def test_per_layer_widths_save_load_generate(tmp_path, gauge):
    """A model with different widths in every layer stores exactly the closed-form count, round-trips through
    save/from_pretrained with identical logits, and generates with its cache like without."""
    model = RelationalForCausalLM(RelationalConfig(gauge=gauge, **VARIED)).eval()
    assert _stored(model) == relational_parameter_count(model.config)
    ids = torch.randint(0, 50, (2, 9))
    logits = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.layer_value_ranks == [8, 3, 5]
    torch.testing.assert_close(loaded(ids).logits, logits)
    out = loaded.generate(ids[:1], max_new_tokens=4, do_sample=False)
    step = loaded(out[:, :-1]).logits[0, -1].argmax()
    assert int(out[0, -1]) == int(step)  # cached decoding agrees with a full forward


def test_per_layer_widths_are_validated():
    """A width list of the wrong length, an odd rotary width or a width above the model's raises, naming the field."""
    for bad, field in (
        (dict(layer_qk_ranks=[8, 4]), "layer_qk_ranks"),
        (dict(layer_qk_ranks=[8, 3, 2]), "layer_qk_ranks[1]"),
        (dict(layer_value_ranks=[8, 9, 5]), "layer_value_ranks[1]"),
        (dict(layer_intermediate_sizes=[48, 0, 30]), "layer_intermediate_sizes[1]"),
    ):
        with pytest.raises(ValueError, match=field.replace("[", r"\[")):
            RelationalConfig(**(VARIED | bad))


def test_full_rank_truncations_preserve_the_function():
    """Keeping every rotary pair (in any order) and the full VO rank leaves the logits unchanged (float tolerance)."""
    rel = to_relational(_llama())
    ids = torch.randint(0, 64, (2, 12))
    before = rel(ids).logits
    cov = torch.randn(48, 48, dtype=torch.float64)
    cov = cov @ cov.T
    for layer in rel.model.layers:
        attn = layer.self_attn
        w = {k: v.detach().clone() for k, v in attn.full_weights().items()}
        pairs = torch.arange(4).expand(2, 4)
        keep = torch.stack([torch.randperm(4) for _ in range(2)])
        w["q"], w["k"], _, _, new_pairs = qk_truncate(w["q"], w["k"], None, None, pairs, keep, num_kv_heads=2)
        assert torch.equal(new_pairs, pairs)  # kept pairs come back in their original order
        grams = value_grams(w["v"], cov, num_kv_heads=2)
        w["v"], w["o"], _, _ = vo_truncate(w["v"], w["o"], None, grams, num_kv_heads=2, rank=8)
        attn.set_full_weights(w)
    torch.testing.assert_close(rel(ids).logits, before, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gauge", ["free", "pivot"])
def test_no_truncation_budget_is_exact(gauge):
    """compress_relational with a budget equal to the model's size in the gauge it writes (no refit) returns the same
    function in that gauge; one parameter less makes it truncate (the budget is counted in that gauge)."""
    from relational_hf.convert import to_free_gauge
    from relational_hf.modeling.modeling_gauge import GaugeFixedLinear

    rel = to_relational(_llama())
    ids = torch.randint(0, 64, (4, 16))
    size = _stored(to_free_gauge(rel) if gauge == "free" else rel)
    opts = LowRankOptions(correction="none", plan_windows=2, gauge=gauge)
    new, result = compress_relational(rel, ids, size, opts, progress=False)
    assert result.widths == {"qk": [8, 8], "vo": [8, 8], "mlp": [96, 96]}
    assert new.config.gauge == gauge and _stored(new) == size
    fixed = any(isinstance(m, GaugeFixedLinear) for m in new.modules())
    assert fixed == (gauge == "pivot")
    torch.testing.assert_close(new(ids).logits, rel(ids).logits, atol=1e-4, rtol=1e-4)
    _, smaller = compress_relational(rel, ids, size - 1, opts, progress=False)
    assert smaller.widths != result.widths and smaller.planned_parameters <= size - 1


def test_vo_truncation_beats_plain_svd_in_the_activation_norm():
    """On anisotropic inputs the activation-aware rank-r VO maps (shared value factor, g = 3 output blocks) have a
    smaller E||X (G - G_r)||^2 than the plain SVD of [G^1 G^2 G^3] truncated to rank r."""
    d, dh, g, r = 24, 6, 3, 2
    x = torch.randn(400, d, dtype=torch.float64) * torch.logspace(0, -2, d, dtype=torch.float64)
    wv = torch.randn(dh, d, dtype=torch.float64)
    wo = torch.randn(d, g * dh, dtype=torch.float64)
    blocks = [wo[:, j * dh : (j + 1) * dh].T for j in range(g)]
    dense = torch.cat([wv.T @ b for b in blocks], dim=1)  # (d, g d)
    v2, o2, _, _ = vo_truncate(wv, wo, None, value_grams(wv, x.T @ x, num_kv_heads=1), num_kv_heads=1, rank=r)
    ours = torch.cat([v2.T @ o2[:, j * r : (j + 1) * r].T for j in range(g)], dim=1)
    u, s, vh = torch.linalg.svd(dense, full_matrices=False)
    plain = (u[:, :r] * s[:r]) @ vh[:r]
    err_ours = (x @ (dense - ours)).pow(2).sum()
    err_plain = (x @ (dense - plain)).pow(2).sum()
    assert err_ours < 0.9 * err_plain
    assert torch.linalg.matrix_rank(ours) <= r


def test_compress_model_counts_and_report(tmp_path):
    """compress_model meets the budget, never grows, reports exactly what it stores (= the closed-form count of its
    config), and the result saves, reloads with AutoModelForCausalLM and generates."""
    llama = _llama(layers=3)
    ids = torch.randint(0, 64, (6, 24))
    source = _stored(llama)
    model, report = compress_model(llama, remove=0.15, method="relational", calibration=ids, progress=False,
                                   plan_windows=3)
    assert report["parameters_after"] == _stored(model) == relational_parameter_count(model.config)
    assert report["parameters_after"] <= int(0.85 * source) < source
    assert sum(report["stored"]["by_layer"]) + report["stored"]["by_kind"]["embedding"] < report["parameters_after"] + 1
    for i, layer in enumerate(model.model.layers):
        c = model.config
        expected = sum(
            layer_kind_parameters(c, kind, w)
            for kind, w in (("qk", c.layer_qk_rank(i)), ("vo", c.layer_value_rank(i)), ("mlp", c.layer_intermediate_size(i)))
        )
        assert sum(p.numel() for p in layer.parameters()) == expected
    json.dumps(report)  # JSON-able
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(ids[:1]).logits, model(ids[:1]).logits)
    assert loaded.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_compress_model_rejects_bad_arguments():
    """remove outside (0, 1), an unknown method or option, and malformed calibration ids raise ValueError naming them."""
    llama = _llama(layers=1)
    ids = torch.randint(0, 64, (2, 8))
    for kwargs, word in (
        (dict(remove=0.0), "remove"),
        (dict(remove=1.2), "remove"),
        (dict(remove=0.2, method="magic"), "method"),
        (dict(remove=0.2, calibration=torch.randint(0, 64, (8,))), "calibration"),
        (dict(remove=0.2, nonsense=1), "nonsense"),
        (dict(remove=0.2, heal_steps=-1), "heal_steps"),
        (dict(remove=0.2, mlp_order="random"), "mlp_order"),
        (dict(remove=0.2, gauge="canonical"), "gauge"),
    ):
        with pytest.raises(ValueError, match=word):
            compress_model(llama, **({"calibration": ids, "progress": False} | kwargs))


def test_cli_refuses_bad_arguments(tmp_path, capsys):
    """The compress command names the offending flag: --remove out of range, a missing --calibration file, a
    non-empty OUT (left untouched)."""
    assert main(["compress", "src", str(tmp_path / "o"), "--remove", "1.5"]) == 2
    assert "--remove" in capsys.readouterr().err
    assert main(["compress", "src", str(tmp_path / "o"), "--remove", "0.2", "--heal-steps", "-3"]) == 2
    assert "--heal-steps" in capsys.readouterr().err
    assert main(["compress", "src", str(tmp_path / "o"), "--remove", "0.2", "--gauge", "canonical"]) == 2
    assert "--gauge" in capsys.readouterr().err
    assert main(["compress", "src", str(tmp_path / "o"), "--remove", "0.2", "--calibration", str(tmp_path / "no.txt")]) == 2
    assert "--calibration" in capsys.readouterr().err
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("data")
    assert main(["compress", "src", str(full), "--remove", "0.2"]) == 2
    assert "OUT" in capsys.readouterr().err and (full / "keep.txt").read_text() == "data"


def test_smollm2_first_two_layers(smollm2_dir):
    """The real model cut to its first 2 layers compresses (relational method) below its size and still runs."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    before = _stored(model)
    out, report = compress_model(model, remove=0.02, calibration=ids, progress=False, plan_windows=2, eval_windows=1)
    assert report["parameters_after"] == _stored(out) <= int(0.98 * before)
    assert torch.isfinite(out(ids).logits).all()


def test_healing_keeps_shapes_and_lowers_calibration_loss():
    """LoRA healing with the LM loss merges back into exactly the compressed shapes (same stored count) and lowers
    the calibration perplexity of a learnable sequence set."""
    torch.manual_seed(1)
    llama = _llama(layers=2)
    base = torch.arange(24) % 7 + 3
    ids = torch.stack([base.roll(i) for i in range(8)])
    compressed, _ = compress_model(llama, remove=0.2, calibration=ids, progress=False, plan_windows=2)
    healed, report = compress_model(
        llama, remove=0.2, calibration=ids, progress=False, plan_windows=2, heal_steps=15, heal_loss="lm", heal_lr=5e-3,
        heal_batch_size=4, heal_block_size=16,
    )
    assert _stored(healed) == _stored(compressed) == report["parameters_after"]
    assert report["heal"]["steps"] == 15 and report["heal"]["loss"] == "lm"
    assert report["calibration_perplexity_healed"] < 0.9 * report["calibration_perplexity_after"]


def test_healing_on_its_own_text_with_callbacks():
    """heal_data, not the calibration windows, is what healing trains on: the perplexity of that text falls while
    the stored size stays; extra Trainer callbacks see every step; malformed healing ids raise ValueError."""
    from transformers import TrainerCallback

    from relational_hf.lm.metrics import perplexity
    from relational_hf.training.heal import heal

    torch.manual_seed(2)
    llama = _llama(layers=2)
    calibration = torch.randint(0, 64, (4, 24))  # random tokens: nothing to learn there
    learnable = torch.stack([(torch.arange(24) % 5 + 7).roll(i) for i in range(8)])
    compressed, _ = compress_model(llama, remove=0.2, calibration=calibration, progress=False, plan_windows=2)

    class Count(TrainerCallback):
        steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    before = perplexity(compressed, learnable)
    stored = _stored(compressed)
    healed, report = heal(
        compressed, learnable, steps=12, heal_lr=5e-3, heal_batch_size=4, heal_block_size=16, progress=False,
        callbacks=[Count()],
    )  # fmt: skip
    assert Count.steps == list(range(1, 13))
    assert _stored(healed) == stored
    assert perplexity(healed, learnable) < 0.9 * before
    for bad in (torch.ones(2), [1, 2, 3], torch.ones(2, 2, 2, dtype=torch.long)):
        with pytest.raises(ValueError, match="healing ids"):
            heal(healed, bad, steps=1, progress=False)


def test_cli_heal_text_needs_heal_steps(tmp_path, capsys):
    """--heal-text without --heal-steps is refused with a one-line error naming both flags; OUT is not created."""
    text = tmp_path / "heal.txt"
    text.write_text("some text " * 50)
    src = tmp_path / "src"
    _llama(layers=1).save_pretrained(src)
    out = tmp_path / "o"
    assert main(["compress", str(src), str(out), "--remove", "0.2", "--heal-text", str(text)]) == 2
    err = capsys.readouterr().err
    assert "--heal-text" in err and "--heal-steps" in err and not out.exists()


def test_slice_method_meets_the_size():
    """method='slice' (one global rotation) picks the widest residual width that meets the requested size."""
    llama = _llama(layers=2)
    with torch.no_grad():  # a varying final gain in front of the tied head: the slice keeps the head tied anyway
        llama.model.norm.weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, 64, (4, 16))
    model, report = compress_model(llama, remove=0.3, method="slice", calibration=ids, progress=False)
    assert report["parameters_after"] == _stored(model) <= int(0.7 * _stored(llama))
    assert model.config.hidden_size == report["slice"]["hidden_size"] < 48
    wider = copy.deepcopy(model.config)
    wider.hidden_size += 2
    assert relational_parameter_count(model.config) == report["parameters_after"]  # the closed form it chose by
    assert relational_parameter_count(wider) > int(0.7 * _stored(llama))  # widest (head widths are even) that fits
    assert torch.isfinite(model(ids).logits).all()


def test_cli_compresses_a_checkpoint(tmp_path, capsys, byte_llama_checkpoint):
    """`relational-hf compress SRC OUT --remove` writes a loadable smaller model, its tokenizer and a JSON report
    whose stored count matches the saved model; no temporary folder is left beside OUT."""
    src = byte_llama_checkpoint
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    code = main([
        "compress", str(src), str(out), "--remove", "0.1", "--calibration", str(text), "--eval", str(text),
        "--window", "32", "--calibration-windows", "4", "--eval-windows", "2",
    ])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "compression_report.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert report["parameters_after"] == _stored(model) < report["parameters_before"]
    assert "eval_perplexity_after" in report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.txt", "out", "src"]


def test_error_curves_measured_once_serve_every_budget():
    """The error curves of pass 1 do not depend on the budget: compressing with curves measured beforehand gives the
    same widths and the same function as measuring them inside, at two budgets; a bad sensitivity is refused."""
    from relational_hf.compress.lowrank import measure_error_curves

    rel = to_relational(_llama())
    ids = torch.randint(0, 64, (4, 16))
    opts = LowRankOptions(plan_windows=2, fisher_metric=True)
    curves = measure_error_curves(rel, ids, opts, progress=False)
    assert curves.metrics is not None and curves.metrics[0]["mlp"].shape == (48, 48)
    full = _stored(rel)
    for budget in (int(0.8 * full), int(0.6 * full)):
        inside, r1 = compress_relational(rel, ids, budget, opts, progress=False)
        reused, r2 = compress_relational(rel, ids, budget, opts, progress=False, curves=curves)
        assert r1.widths == r2.widths and _stored(reused) <= budget
        torch.testing.assert_close(reused(ids).logits, inside(ids).logits)
    with pytest.raises(ValueError, match="sensitivity"):
        measure_error_curves(rel, ids, LowRankOptions(sensitivity="kl"), progress=False)


def test_blocked_product_accumulation_equals_the_whole_product():
    """The compression pass sums a^T b over batches into a float64 matrix a block of columns at a time (memory): the
    sum equals the float64 sum of the whole fp32 products, block edges that do not divide the width included."""
    from relational_hf.compress.lowrank import _accumulate_product

    g = torch.Generator().manual_seed(0)
    out, expected = torch.zeros(37, 29, dtype=torch.float64), torch.zeros(37, 29, dtype=torch.float64)
    for _ in range(3):
        a, b = torch.randn(50, 37, generator=g), torch.randn(50, 29, generator=g)
        _accumulate_product(out, a, b, block=8)
        expected += (a.T @ b).double()
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize("kept", [0, 1, 17, 39, 40])
def test_compact_gram_is_the_kept_submatrix_in_place(kept, rows):
    """`compact_gram(G, keep)` is G[keep][:, keep] for any increasing `keep` (random, the first k units: the most
    overlap of sources and destinations, the last k), in G's own storage (no second matrix), whatever the number of
    rows packed per step; indices that are not increasing, or a matrix that is not square, are refused."""
    from relational_hf.compress.truncation import compact_gram

    g = torch.Generator().manual_seed(kept)
    for keep in (
        torch.sort(torch.randperm(40, generator=g)[:kept]).values,
        torch.arange(kept),
        torch.arange(40 - kept, 40),
    ):
        gram = torch.randn(40, 40, generator=g, dtype=torch.float64)
        expected = gram[keep[:, None], keep[None, :]].clone()
        out = compact_gram(gram, keep, rows=rows)
        assert torch.equal(out, expected)
        assert out.untyped_storage().data_ptr() == gram.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="increasing"):
        compact_gram(torch.zeros(5, 5), torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="square"):
        compact_gram(torch.zeros(5, 4), torch.tensor([1]))


def test_greedy_unit_order_picks_the_best_next_unit_for_the_refit():
    """Each unit of `greedy_unit_order` is, among those not chosen yet, the one whose addition leaves the smallest
    refit error (`mlp_error_curve`, brute force over every candidate) on correlated units; the order is a
    permutation; a target made by a few units is explained, to the ridge, by exactly those first; bad shapes are
    refused."""
    from relational_hf.compress.truncation import greedy_unit_order, mlp_error_curve

    g = torch.Generator().manual_seed(0)
    z = torch.randn(200, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 12, generator=g, dtype=torch.float64)
    y = torch.randn(200, 5, generator=g, dtype=torch.float64)
    gram, cross, energy = z.T @ z, z.T @ y, float(y.pow(2).sum())
    order = greedy_unit_order(gram, cross, ridge=1e-3)
    assert sorted(order.tolist()) == list(range(12))
    for k in range(12):
        rest = [i for i in range(12) if i not in order[:k].tolist()]
        errors = {i: float(mlp_error_curve(gram, cross, energy, torch.cat([order[:k], torch.tensor([i])]), 1e-3)[k])
                  for i in rest}  # fmt: skip
        assert errors[int(order[k])] <= min(errors.values()) * (1 + 1e-9) + 1e-9
    support = torch.tensor([7, 2, 9])
    y = z[:, support] @ torch.randn(3, 5, generator=g, dtype=torch.float64)
    order = greedy_unit_order(gram, z.T @ y, ridge=1e-9)
    assert set(order[:3].tolist()) == set(support.tolist())
    curve = mlp_error_curve(gram, z.T @ y, float(y.pow(2).sum()), order, 1e-9)
    assert float(curve[2]) < 1e-6 * float(y.pow(2).sum())
    with pytest.raises(ValueError, match="d_ff"):
        greedy_unit_order(gram, cross[:5])


def _first_layer_output(model, ids: torch.Tensor) -> torch.Tensor:
    seen = {}
    handle = model.model.layers[0].register_forward_hook(lambda _m, _a, out: seen.setdefault("h", out))
    with torch.no_grad():
        model(ids)
    handle.remove()
    out = seen["h"]
    return out[0] if isinstance(out, tuple) else out


def test_dense_correction_is_the_least_squares_optimum_of_the_distance_to_the_dense_trajectory():
    """correction="dense" refits W_down on the dense model's next hidden states: with the same widths and kept units
    (ranked on statistics both targets share) its layer output on the calibration windows is closer to the dense
    model's than the output of the "local" refit (the dense MLP's output on the compressed attention's output, blind
    to the attention's error) or of no refit at all: it is the least-squares optimum of that distance."""
    torch.manual_seed(0)
    rel = to_relational(_llama(1))
    ids = torch.randint(0, 64, (6, 16))
    reference = _first_layer_output(rel, ids)
    budget = _stored(rel) - 40 * 3 * 48  # about 40 SwiGLU units' worth, from the attention and the MLP
    distances, widths = {}, []
    for correction in ("dense", "local", "none"):
        opts = LowRankOptions(correction=correction, sensitivity="uniform", ridge=1e-9, plan_windows=6)
        new, result = compress_relational(copy.deepcopy(rel), ids, budget, opts, progress=False)
        widths.append(result.widths)
        distances[correction] = float((_first_layer_output(new, ids) - reference).double().pow(2).sum())
    assert widths[0] == widths[1] == widths[2] and widths[0]["mlp"][0] < 96
    assert widths[0]["qk"][0] < 8 or widths[0]["vo"][0] < 8  # the attention's error reaches the MLP
    assert distances["dense"] < 0.99 * distances["local"]
    assert distances["dense"] < distances["none"]


def test_dense_correction_frees_the_dense_layer_and_keeps_the_result():
    """With correction="dense" the dense layer is still released once it has carried the dense trajectory on (its
    weights go to the meta device), and releasing it changes nothing in the compressed layer."""
    from relational_hf.compress.lowrank import _new_model, _positions, compress_layer

    torch.manual_seed(1)
    rel = to_relational(_llama(1))
    ids = torch.randint(0, 64, (4, 16))
    widths = {"qk": 6, "vo": 6, "mlp": 64}
    opts = LowRankOptions(correction="dense").resolved(rel.config, ids)
    outputs, layers = [], []
    for release in (False, True):
        model = copy.deepcopy(rel)
        new = _new_model(model, {k: [w] for k, w in widths.items()}, "pivot")
        h = model.model.embed_tokens(ids).detach()
        layer = model.model.layers[0]
        out, out_dense = compress_layer(
            layer, new.model.layers[0], h, h.clone(), widths, opts, _positions(model.config, 16), release=release
        )
        outputs.append((out.clone(), out_dense))
        layers.append(layer)
    assert all(p.device.type == "meta" for p in layers[1].parameters())
    assert all(p.device.type != "meta" for p in layers[0].parameters())
    torch.testing.assert_close(outputs[1][0], outputs[0][0])
    torch.testing.assert_close(outputs[1][1], outputs[0][1])
    torch.testing.assert_close(outputs[0][1], _first_layer_output(rel, ids))
