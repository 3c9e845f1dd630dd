"""Weight compression (`relational_hf.compress.ops`): fake quantisation, magnitude and Wanda pruning (unstructured and
N:M), and the named settings, on Llama, GPT-2 and relational models; `compressed_view` computes as the compressed copy
does, in memory and with layers offloaded to disk, and leaves the model dense."""

from __future__ import annotations

import pytest
import torch
from test_directional import VOCAB, tiny_gpt2, tiny_llama, tiny_relational
from transformers import LlamaForCausalLM

from relational_hf.compress.ops import (
    COMPRESSION_SETTINGS,
    compress_weights,
    compressed_view,
    fake_quantize,
    prune_weights,
    quantize_weights,
    weight_matrices,
)


def wide_llama() -> LlamaForCausalLM:
    return tiny_llama(hidden_size=64, intermediate_size=128)


MODELS = {"llama": wide_llama, "relational": tiny_relational, "gpt2": tiny_gpt2}


def ids(rows: int = 4, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length))


def test_fake_quantisation_uses_at_most_2_to_the_b_levels_per_group_and_keeps_the_original():
    model = wide_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    w = torch.randn(8, 40)
    q = fake_quantize(w, bits=4, group_size=16)
    for g in range(0, 40, 16):
        group = q[:, g : g + 16]
        for row in range(8):
            assert group[row].unique().numel() <= 16
        assert (group - w[:, g : g + 16]).abs().max() <= w[:, g : g + 16].abs().max() / 7 / 2 + 1e-6
    compressed = quantize_weights(model, bits=4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the dense model is untouched
    assert torch.equal(compressed.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert not torch.equal(compressed.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("pattern,n,m", [("2:4", 2, 4), ("4:8", 4, 8)])
def test_n_m_pruning_leaves_at_most_n_nonzeros_in_every_m_consecutive_inputs(family, pattern, n, m):
    model = MODELS[family]()
    for score in ("magnitude", "wanda"):
        pruned = prune_weights(model, score, pattern, calibration_ids=ids())
        matrices = weight_matrices(pruned)
        assert len(matrices) == len(weight_matrices(model)) > 0
        for matrix in matrices:
            rows = matrix.rows.detach()  # (outputs, inputs), whatever the storage layout
            full = rows[:, : rows.shape[1] // m * m].reshape(rows.shape[0], -1, m)
            assert (full.ne(0).sum(-1) <= n).all(), (family, pattern, score)


def test_wanda_scores_weights_by_input_activation_norms():
    model = wide_llama()
    calibration = ids(4, 16)
    pruned = prune_weights(model, "wanda", "unstructured", 0.5, calibration_ids=calibration)
    layer = model.model.layers[0]
    seen = []
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=calibration)
    handle.remove()
    norms = torch.cat(seen).norm(dim=0)  # ||x_j||_2 over all calibration tokens
    w = layer.mlp.down_proj.weight
    score = w.abs() * norms
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(1, score.topk(w.shape[1] // 2, dim=1).indices, True)
    assert torch.equal(pruned.model.layers[0].mlp.down_proj.weight, w * keep)
    magnitude = prune_weights(model, "magnitude", "unstructured", 0.5)
    assert not torch.equal(magnitude.model.layers[0].mlp.down_proj.weight.ne(0), keep)
    assert magnitude.model.layers[0].mlp.down_proj.weight.eq(0).float().mean().item() == pytest.approx(0.5, abs=1e-3)
    with pytest.raises(ValueError, match="needs calibration_ids"):
        prune_weights(model, "wanda")


def test_wanda_on_a_gauge_fixed_map_scores_each_free_entry_by_the_norm_of_its_own_input_feature():
    model = tiny_relational()
    calibration = ids(4, 16)
    pruned = prune_weights(model, "wanda", "unstructured", 0.5, calibration_ids=calibration)
    v_proj = model.model.layers[1].self_attn.v_proj  # GaugeFixedLinear: free entries (out, in - d_h), per-row columns
    seen = []
    handle = v_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=calibration)
    handle.remove()
    norms = torch.cat(seen).norm(dim=0)
    score = v_proj.weight.abs() * torch.gather(norms.expand(v_proj.out_features, -1), 1, v_proj.free_index)
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(score.shape[1] // 2, dim=1).indices, True)
    assert torch.equal(pruned.model.layers[1].self_attn.v_proj.weight, v_proj.weight * keep)


def test_relational_pivot_entries_stay_exact_under_compression():
    model = tiny_relational()
    compressed = compress_weights(model, "int4")
    for dense, quantised in zip(model.model.layers, compressed.model.layers):
        k, k_q = dense.self_attn.k_proj, quantised.self_attn.k_proj
        assert torch.equal(k.fixed_value, k_q.fixed_value) and torch.equal(k.fixed_index, k_q.fixed_index)
        assert not torch.equal(k.weight, k_q.weight)


def test_every_listed_setting_compresses_as_its_name_says():
    model = tiny_gpt2()
    calibration = ids(2, 8)
    direct = {"int8": lambda: quantize_weights(model, 8), "int4": lambda: quantize_weights(model, 4)}
    for score in ("magnitude", "wanda"):
        for pattern in ("unstructured", "2:4", "4:8"):
            name = score if pattern == "unstructured" else f"{score}-{pattern}"
            direct[name] = lambda s=score, p=pattern: prune_weights(model, s, p, 0.5, calibration)
    assert sorted(direct) == sorted(COMPRESSION_SETTINGS)
    results = {}
    for setting in COMPRESSION_SETTINGS:
        compressed = compress_weights(model, setting, calibration_ids=calibration)
        rows = [m.rows.detach() for m in weight_matrices(compressed)]
        assert all(torch.equal(a, b.rows) for a, b in zip(rows, weight_matrices(direct[setting]())))
        assert any(not torch.equal(a, b.rows) for a, b in zip(rows, weight_matrices(model)))
        results[setting] = rows
    for pattern in ("", "-2:4", "-4:8"):  # Wanda's activation-aware score picks other weights than magnitude
        assert any(not torch.equal(a, b) for a, b in zip(results[f"wanda{pattern}"], results[f"magnitude{pattern}"]))
    with pytest.raises(ValueError, match="allowed settings: int8, int4"):
        compress_weights(model, "int2")


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_compressed_view_computes_as_the_compressed_copy_and_leaves_the_model_dense(kind):
    """Inside `compressed_view` the model's logits are those of `compress_weights`' copy for every setting (twice: the
    kept compressed weights are swapped back in); afterwards every tensor and the logits are the dense ones again."""
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    calibration, x = ids(2, 8), ids(3, 12)
    before = _state(model)
    with torch.no_grad():
        dense = model(x).logits
        for setting in COMPRESSION_SETTINGS:
            expected = compress_weights(model, setting, calibration_ids=calibration)(x).logits
            with compressed_view(model, setting, calibration) as viewed:
                assert viewed is model
                for _ in range(2):
                    torch.testing.assert_close(model(x).logits, expected, rtol=0, atol=1e-6)
                assert not torch.allclose(expected, dense)
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        torch.testing.assert_close(model(x).logits, dense, rtol=0, atol=0)


def test_the_compressed_view_restores_the_dense_weights_after_an_error_and_refuses_bad_use():
    model = tiny_relational().eval()
    before = _state(model)
    matrix = weight_matrices(model)[0]

    def fail(module, args, output):
        raise RuntimeError("stop in the middle of a call")

    with pytest.raises(RuntimeError, match="stop in the middle"):
        with torch.no_grad(), compressed_view(model, "int4"):
            handle = matrix.module.register_forward_hook(fail, prepend=True)  # runs before the view's swap back
            try:
                model(ids(1, 6))
            finally:
                handle.remove()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="needs calibration_ids"):
        with compressed_view(model, "wanda"):
            pass
    with pytest.raises(ValueError, match="allowed settings"):
        with compressed_view(model, "int3"):
            pass
    with compressed_view(model, "int8"):
        with pytest.raises(ValueError, match="do not nest"):
            with compressed_view(model, "int4"):
                pass


@pytest.mark.parametrize("kind", ["llama", "relational"])
def test_the_compressed_view_of_an_offloaded_model_compresses_each_layer_as_it_comes_in(kind, tmp_path):
    """Layers offloaded to disk by a device map: the view gives the compressed copy's logits for every setting, the
    offloaded weights stay on the meta device between calls (nothing kept) and the model is dense again after."""
    from relational_hf.lm.offload import load_offloaded

    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    model.save_pretrained(tmp_path / "model")
    embed = model.get_input_embeddings().weight.numel() * 4
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    offloaded = load_offloaded(tmp_path / "model", max_memory={"cpu": embed + layer + layer // 2})
    assert "disk" in {str(v) for v in offloaded.hf_device_map.values()}
    meta = [m for m in weight_matrices(offloaded) if m.module.weight.is_meta]
    assert len(meta) >= len(weight_matrices(offloaded)) // 2  # most weights really are on disk
    calibration, x = ids(2, 8), ids(3, 12)
    with torch.no_grad():
        dense = offloaded(x).logits
        for setting in COMPRESSION_SETTINGS:
            expected = compress_weights(model, setting, calibration_ids=calibration)(x).logits
            with compressed_view(offloaded, setting, calibration):
                torch.testing.assert_close(offloaded(x).logits, expected, rtol=0, atol=1e-5)
                assert all(m.module.weight.is_meta for m in meta)
        torch.testing.assert_close(offloaded(x).logits, dense, rtol=0, atol=0)
