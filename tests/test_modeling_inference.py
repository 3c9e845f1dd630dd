"""The relational model's inference paths (what makes a compressed model fast) compute the same function and never
serve stale weights: the assembled gauge-fixed weight kept between inference calls, one head width for the fused
attention kernels of a layer whose QK rank differs from its value width, and the plain rotary path of a layer that
keeps every frequency pair."""

from __future__ import annotations

import copy

import pytest
import torch

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.modeling import GaugeFixedLinear, clear_weight_caches, weight_cache
from relational_hf.modeling.modeling_relational import (
    apply_rotary_pair_subset,
    apply_rotary_pos_emb,
    eager_attention_parts,
    grouped_decode_attention,
    rotate_half,
)

VOCAB = 61


def compressed_shape_model(**overrides) -> RelationalForCausalLM:
    """Per-layer widths as a compression leaves them: QK ranks different from value widths, GQA, pair subsets."""
    config = RelationalConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_qk_ranks=[8, 4, 6], layer_value_ranks=[8, 3, 5],
        layer_intermediate_sizes=[48, 20, 30], **overrides,
    )  # fmt: skip
    model = RelationalForCausalLM(config).eval()
    with torch.no_grad():  # layer 1 keeps pairs 3 and 1 of head 0 and pairs 0 and 2 of head 1
        model.model.layers[1].self_attn.rope_pair_index.copy_(torch.tensor([[3, 1], [0, 2]]))
        model.model.layers[2].self_attn.rope_pair_index.copy_(torch.tensor([[0, 1, 2], [3, 2, 0]]))
    return model


def gauge_modules(model) -> list[GaugeFixedLinear]:
    return [m for m in model.modules() if isinstance(m, GaugeFixedLinear)]


def keeping(model):
    """`model` with the opt-in `keep_assembled` switched on for every gauge-fixed layer (eval-mode inference outside
    `weight_cache` keeps the assembled weights)."""
    for m in gauge_modules(model):
        m.keep_assembled = True
    return model


def fresh_logits(model, ids) -> torch.Tensor:
    """Logits with every gauge-fixed weight assembled anew (no kept weight can be read)."""
    clear_weight_caches(model)
    with torch.no_grad():
        out = model(ids).logits
    clear_weight_caches(model)
    return out


def test_inference_assembles_each_weight_once_and_computes_the_same_logits(monkeypatch):
    """With `keep_assembled` on, eval mode without autograd keeps the assembled weights: a second forward assembles
    nothing, and the logits equal those of the training path (assembled with autograd at every call). Off (the
    default), every forward assembles afresh."""
    model = compressed_shape_model()
    ids = torch.randint(0, VOCAB, (2, 9))
    calls = []
    original = GaugeFixedLinear._assemble
    monkeypatch.setattr(GaugeFixedLinear, "_assemble", lambda self: calls.append(self) or original(self))
    with torch.no_grad():
        model(ids)
        model(ids)
    assert len(calls) == 2 * len(gauge_modules(model))
    monkeypatch.setattr(GaugeFixedLinear, "_assemble", original)
    keeping(model)
    ids = torch.randint(0, VOCAB, (2, 9))
    reference = model(ids).logits.detach()  # autograd on: the training path
    calls = []
    original = GaugeFixedLinear._assemble
    monkeypatch.setattr(GaugeFixedLinear, "_assemble", lambda self: calls.append(self) or original(self))
    with torch.no_grad():
        first = model(ids).logits
        n_first = len(calls)
        second = model(ids).logits
    assert n_first == len(gauge_modules(model)) and len(calls) == n_first  # once per module, then never
    torch.testing.assert_close(first, reference, rtol=0, atol=0)
    torch.testing.assert_close(second, reference, rtol=0, atol=0)


def test_successive_generate_calls_reuse_kept_weights_only_when_keeping(monkeypatch):
    """`generate` enters `weight_cache`: leaving it drops the assembled weights of a model that does not keep them
    (the next call assembles every weight again), and keeps those of a model that does (the next call assembles
    nothing). The greedy continuations are the same either way."""
    model = compressed_shape_model()
    prompt = torch.randint(0, VOCAB, (1, 5))
    calls = []
    original = GaugeFixedLinear._assemble
    monkeypatch.setattr(GaugeFixedLinear, "_assemble", lambda self: calls.append(self) or original(self))

    def generate():
        return model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)

    n = len(gauge_modules(model))
    plain = [generate(), generate()]
    assert len(calls) == 2 * n  # each call assembles every weight once
    keeping(model)
    calls.clear()
    kept = [generate(), generate()]
    assert len(calls) == n  # the first call assembles, the second reuses
    for a, b in zip(plain, kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", ["adamw_foreach", "adamw_fused", "sgd"])
def test_kept_weights_are_never_stale_after_an_optimizer_step(optimizer):
    """Inference, then a training step taken in EVAL mode (fused AdamW does not bump version counters), then
    inference again: the second inference sees the updated weights (keep_assembled on)."""
    model = keeping(compressed_shape_model())
    ids = torch.randint(0, VOCAB, (2, 9))
    params = list(model.parameters())
    opt = {
        "adamw_foreach": lambda: torch.optim.AdamW(params, lr=1e-2, foreach=True),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-2, fused=True),
        "sgd": lambda: torch.optim.SGD(params, lr=1.0, foreach=False),
    }[optimizer]()
    with torch.no_grad():
        before = model(ids).logits
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        after = model(ids).logits
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, fresh_logits(model, ids), rtol=0, atol=0)


def test_kept_weights_follow_load_state_dict_moves_and_mode_switches():
    """load_state_dict, a dtype change and a train/eval switch (after a write through .data, which bypasses the
    version counter) each make the next inference use the current weights (keep_assembled on); clear_weight_caches
    does it by hand."""
    model = keeping(compressed_shape_model())
    other = compressed_shape_model()  # other random weights
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        model(ids)
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(model(ids).logits, other(ids).logits, rtol=0, atol=0)
        model.double()
        assert model(ids).logits.dtype == torch.float64
        model.float()
        up = model.model.layers[0].mlp.up_proj
        up.weight.data.mul_(2.0)  # .data: the version counter does not move
        model.train()
        model.eval()
        torch.testing.assert_close(model(ids).logits, fresh_logits(model, ids), rtol=0, atol=0)
        model(ids)
        up.weight.data.mul_(0.5)
        assert clear_weight_caches(model) == len(gauge_modules(model))
        torch.testing.assert_close(model(ids).logits, fresh_logits(model, ids), rtol=0, atol=0)
        model(ids)
        up.pivots[0] = (up.pivots[0] + 1) % up.in_features  # another gauge layout, written in place
        torch.testing.assert_close(model(ids).logits, fresh_logits(model, ids), rtol=0, atol=0)


def test_full_weight_stays_a_new_tensor_outside_weight_cache():
    """full_weight() (what compression and merging read and may edit) is not the kept inference weight."""
    model = compressed_shape_model()
    up = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 5)))
        w = up.full_weight()
        w.mul_(0)  # editing the returned tensor changes nothing the module computes with
        assert up.full_weight().abs().sum() > 0
        with weight_cache(model):
            assert up.full_weight() is up.full_weight()  # generate's context keeps one


def test_padded_head_widths_give_the_eager_function_with_and_without_cache():
    """A layer whose QK rank differs from its value width runs the fused SDPA kernels on zero-padded heads: logits
    equal eager attention's (which takes any widths), left padding included, and cached greedy decoding equals
    decoding without cache."""
    model = compressed_shape_model()
    attn = model.model.layers[1].self_attn
    model.set_attn_implementation("sdpa")
    assert attn.kernel_width() == 4  # max(QK rank 4, value width 3)
    ids = torch.randint(0, VOCAB, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        sdpa = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        assert attn.kernel_width() is None
        eager = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(sdpa[keep], eager[keep], rtol=0, atol=1e-5)
    model.set_attn_implementation("sdpa")
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.testing.assert_close(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_rotary_pair_subset_rotates_each_kept_pair_with_its_own_frequency():
    """apply_rotary_pair_subset turns coordinates j and j + r/2 of key head h (and of its query heads) by the angle of
    pair pairs[h, j] of the model's table: checked against an explicit per-head rotation; with every pair kept in
    order it is the plain rotary embedding."""
    b, t, h, h_kv, full = 2, 5, 4, 2, 8  # the model's table has full/2 = 4 pairs
    angles = torch.randn(b, t, full // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    pairs = torch.tensor([[3, 1], [0, 2]])
    q, k = torch.randn(b, h, t, 4), torch.randn(b, h_kv, t, 4)
    q_rot, k_rot = apply_rotary_pair_subset(q, k, cos, sin, pairs)
    for head in range(h):
        kv = head // (h // h_kv)
        a = angles[..., pairs[kv]]  # (b, t, 2)
        c, s = torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1)
        torch.testing.assert_close(q_rot[:, head], q[:, head] * c + rotate_half(q[:, head]) * s)
        if head % (h // h_kv) == 0:
            torch.testing.assert_close(k_rot[:, kv], k[:, kv] * c + rotate_half(k[:, kv]) * s)
    q, k = torch.randn(b, h, t, full), torch.randn(b, h_kv, t, full)
    identity = torch.arange(full // 2).expand(h_kv, -1)
    for got, want in zip(apply_rotary_pair_subset(q, k, cos, sin, identity), apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(got, want)
    half = (q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16(), identity)  # the sign does not promote
    assert all(x.dtype == torch.bfloat16 for x in apply_rotary_pair_subset(*half))


@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_grouped_decode_attention_is_the_attention_of_one_query_position(mask_kind):
    """The decoding kernel of thin heads (query heads of a group as rows of one product, no padding) equals the eager
    kernel for QK and value widths that differ, GQA, and SDPA's masks (boolean: True attends; additive); more than
    one query position is refused."""
    b, h, h_kv, s, r, dh = 3, 6, 2, 9, 5, 7
    q, k, v = torch.randn(b, h, 1, r), torch.randn(b, h_kv, s, r), torch.randn(b, h_kv, s, dh)
    keep = torch.ones(b, 1, 1, s, dtype=torch.bool)
    keep[0, ..., :4] = False  # a left-padded row
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    mask = {None: None, "bool": keep, "additive": additive}[mask_kind]
    got = grouped_decode_attention(q, k, v, mask, 0.3)
    want = eager_attention_parts(q, k, v, None if mask is None else additive, 0.3)[2].transpose(1, 2)
    assert got.shape == (b, 1, h, dh)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="one query position"):
        grouped_decode_attention(torch.randn(b, h, 2, r), k, v, None, 0.3)


def test_decoding_steps_of_thin_heads_under_sdpa_equal_eager_ones(monkeypatch):
    """A cached decoding step of a compressed model under SDPA (which takes `grouped_decode_attention` in layers
    whose QK rank differs from the value width) gives eager attention's logits, with a left-padded row."""
    from relational_hf.modeling import modeling_relational

    calls = []
    kernel = modeling_relational.grouped_decode_attention
    monkeypatch.setattr(modeling_relational, "grouped_decode_attention", lambda *a: calls.append(1) or kernel(*a))
    model = compressed_shape_model()
    with torch.no_grad():  # sharp attention patterns, so that a wrong score shows in the logits
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
    ids = torch.randint(0, VOCAB, (2, 8))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    step = {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out = model(ids, attention_mask=mask[:, :8], use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            step[impl] = model(nxt, attention_mask=mask, cache=out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step["sdpa"], step["eager"], rtol=0, atol=1e-5)
    assert len(calls) == 2  # the decoding step of the two layers with QK rank != value width, and no other call


def test_layers_keeping_every_pair_in_order_take_the_plain_rotary_path():
    """The layer that keeps all pairs in order computes with the plain rotary embedding, the ones with a subset or
    another order do not; the decision follows an edit of `rope_pair_index`, and the function is the same either way."""
    model = compressed_shape_model()
    flags = [layer.self_attn.keeps_rotary_subset() for layer in model.model.layers]
    assert flags == [False, True, True]
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        plain = model(ids).logits
        reference = copy.deepcopy(model)
        attn = reference.model.layers[0].self_attn
        attn.__dict__["_pairs_key"] = None
        attn.keeps_rotary_subset = lambda: True  # force the general path on layer 0
        torch.testing.assert_close(reference(ids).logits, plain, rtol=0, atol=1e-6)
        model.model.layers[0].self_attn.rope_pair_index[0] = torch.tensor([1, 0, 2, 3])
        assert model.model.layers[0].self_attn.keeps_rotary_subset()


def test_an_offloaded_model_keeps_no_assembled_weight(tmp_path, monkeypatch):
    """With Accelerate's disk offload the layers' weights come in for one call each: no gauge-fixed layer keeps an
    assembled copy (which would hold the offloaded weights in memory again), even with keeping switched on for every
    layer, and the logits are unchanged."""
    from relational_hf.lm.offload import load_offloaded

    monkeypatch.setattr(GaugeFixedLinear, "keep_assembled", True)  # the opt-in, for every layer the load builds
    model = compressed_shape_model()
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        expected = model(ids).logits
    assert all("_weight_cache" in m.__dict__ for m in gauge_modules(model))  # in memory: kept
    embed = model.model.embed_tokens.weight.numel() * 4
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    offloaded = load_offloaded(tmp_path / "model", max_memory={"cpu": embed + layer + layer // 2})
    assert "disk" in {str(v) for v in offloaded.hf_device_map.values()}
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, expected, rtol=0, atol=1e-5)
    modules = gauge_modules(offloaded)
    assert modules and not any("_weight_cache" in m.__dict__ for m in modules) and all(m._offloaded for m in modules)
    kept = []
    original = GaugeFixedLinear._kept_weight
    monkeypatch.setattr(GaugeFixedLinear, "_kept_weight", lambda self: kept.append(self) or original(self))
    offloaded.generate(ids, max_new_tokens=3, do_sample=False)  # generate's weight_cache keeps nothing either
    assert not kept and not any("_weight_cache" in m.__dict__ for m in modules)
