"""The fast paths of conversion compute what the plain ones do: gain folding in fp32 equals the float64 product
rounded to fp32, the elementwise rotary gauge equals the r x r product, the preflight's screened rank test equals
the SVD's, casts written block by block equal a whole cast, reused read buffers hold the checkpoint's values, and
the streaming converter reports where its time went."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

import relational_hf  # noqa: F401  (registers the architecture)
from relational_hf import shards
from relational_hf.convert.preflight import RELATIVE_RANK_TOL, _rank_deficient
from relational_hf.convert.relational import PhaseTimes, fold_layer_gains
from relational_hf.convert.streaming import stream_to_relational
from relational_hf.modeling.modeling_gauge import _largest_magnitude, complex_pair_matrix, complex_pair_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gains_folded_in_fp32_equal_the_float64_product_rounded_to_fp32(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {
        key: (torch.randn(48, 40, generator=g) * 10 ** torch.randint(-6, 3, (48, 1), generator=g)).to(dtype)
        for key in ("q", "k", "v", "o", "gate", "up")
    }
    tensors["down"] = torch.randn(40, 48, generator=g).to(dtype)
    tensors["attention_gain"] = (1 + torch.randn(40, generator=g)).to(dtype)
    tensors["mlp_gain"] = (torch.randn(40, generator=g) * 1e-3).to(dtype)
    originals = {k: v.clone() for k, v in tensors.items()}
    attention, mlp = fold_layer_gains(dict(tensors))
    for key, folded in (*attention.items(), *mlp.items()):
        gain = tensors["mlp_gain" if key in ("gate", "up") else "attention_gain"]
        expected = tensors[key].double() * gain.double() if key not in ("o", "down") else tensors[key].double()
        assert folded.dtype == torch.float32
        assert torch.equal(folded, expected.float()), key  # bit for bit
    for key, value in tensors.items():  # not in place: the caller's tensors are unchanged
        assert torch.equal(value, originals[key])


def test_folding_in_place_overwrites_fp32_inputs_only_when_asked():
    q, gain = torch.randn(8, 6), 1 + torch.rand(6)
    kept = q.clone()
    folded = fold_layer_gains({"q": q, "k": q.clone(), "v": q.clone(), "o": q.clone(), "attention_gain": gain})[0]
    assert torch.equal(q, kept) and folded["q"].data_ptr() != q.data_ptr()
    parts = {"q": q, "k": q.clone(), "v": q.clone(), "o": q.clone(), "attention_gain": gain}
    folded = fold_layer_gains(parts, in_place=True)[0]
    assert folded["q"].data_ptr() == q.data_ptr() and torch.equal(q, kept * gain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_rotary_gauge_equals_the_pair_matrix_product(dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 2, 8, 24, generator=g).to(dtype)  # (..., r, d), r = 8: 4 rotary pairs
    z = torch.complex(torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)).to(torch.complex128)
    exact = (w.double().transpose(-1, -2) @ complex_pair_matrix(z)).transpose(-1, -2)  # w^T M, float64
    got = complex_pair_scale(w, z)
    assert got.dtype == dtype and got.shape == w.shape
    scale = exact.abs().amax(-1, keepdim=True)
    tol = 8 * torch.finfo(dtype).eps
    assert bool(((got.double() - exact).abs() <= tol * scale).all())


def test_largest_magnitude_picks_the_first_entry_of_largest_absolute_value():
    w = torch.tensor([[1.0, -3, 3, 2], [-5, 5, 1, 0], [0, 0, 0, 0], [2, -1, -2, 1], [-1, 0, 1, -1]])
    w = torch.cat([w, torch.randn(200, 4)])
    assert torch.equal(_largest_magnitude(w).squeeze(-1), w.abs().argmax(-1))


def test_screened_rank_test_agrees_with_the_svd_rank():
    g = torch.Generator().manual_seed(2)
    heads = []
    for ratio in (1.0, 1e-3, 1e-5, 1e-9, 0.0):  # smallest / largest singular value of each head (1e-5: screened out,
        # then the SVD says full rank)
        u, _ = torch.linalg.qr(torch.randn(40, 8, generator=g, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
        s = torch.ones(8, dtype=torch.float64)
        s[-1] = ratio
        heads.append((u * s) @ v.T)  # (40, 8): a head of rank 8 with those singular values
    blocks = torch.stack(heads).transpose(1, 2).contiguous()  # (H, r, d)
    sv = torch.linalg.svdvals(blocks)
    ranks = (sv > RELATIVE_RANK_TOL * sv[:, :1]).sum(-1).tolist()
    expected = [(h, rank) for h, rank in enumerate(ranks) if rank < 8]
    assert _rank_deficient(blocks) == expected == [(3, 7), (4, 7)]


def test_a_cast_written_block_by_block_equals_the_whole_cast(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "_CAST_BLOCK_BYTES", 96)  # many blocks, the last one partial
    tensor = torch.randn(37, 11)
    writer = shards.ShardWriter(tmp_path, 10**9, 4096)
    writer.add("w", tensor, torch.bfloat16)
    writer.add("same", tensor)
    writer.finish(2 * tensor.numel())
    with safe_open(str(tmp_path / shards.SAFE_WEIGHTS_NAME), framework="pt") as st:
        assert torch.equal(st.get_tensor("w"), tensor.to(torch.bfloat16))
        assert torch.equal(st.get_tensor("same"), tensor)


def test_reused_read_buffers_hold_each_layers_values(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    reader, _config, model = shards.open_checkpoint(tmp_path / "src")
    buffers: dict[str, torch.Tensor] = {}
    seen = []
    for i in range(2):
        plain = {k: v.clone() for k, v in shards.materialize(model, reader, f"model.layers.{i}", dtype=torch.float32)
                 .state_dict().items()}  # fmt: skip
        shards.release(model.get_submodule(f"model.layers.{i}"))
        layer = shards.materialize(model, reader, f"model.layers.{i}", dtype=torch.float32, buffers=buffers)
        state = layer.state_dict()
        assert state.keys() == plain.keys() and all(torch.equal(state[k], plain[k]) for k in plain)
        seen.append({k: v.data_ptr() for k, v in state.items()})
        shards.release(layer)
    assert seen[0] == seen[1]  # the second layer was read into the first one's tensors


def test_streaming_conversion_reports_where_its_time_went(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "src")
    times = PhaseTimes()
    start = time.perf_counter()
    stream_to_relational(tmp_path / "src", tmp_path / "out", progress=False, times=times)
    wall = time.perf_counter() - start
    phases = {"open", "read", "preflight", "check_forward", "fold", "gauge_attention", "gauge_mlp", "write",
              "embedding_head", "finish", "publish"}  # fmt: skip
    assert set(times) == phases and all(v >= 0 for v in times.values())
    assert sum(times.values()) <= wall  # disjoint phases of one run
