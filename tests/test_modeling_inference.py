"""The relational model's inference paths (what makes a compressed model fast) compute the same function and never
serve stale weights: the assembled gauge-fixed weight kept between inference calls, one head width for the fused
attention kernels of a layer whose QK rank differs from its value width, the decoding kernel of such a layer, and the
rotary layout a layer keeps."""

from __future__ import annotations

import copy

import pytest
import torch

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.modeling import GaugeFixedLinear, clear_weight_caches, weight_cache
from relational_hf.modeling.modeling_relational import (
    apply_rotary,
    apply_rotary_pair_subset,
    apply_rotary_pos_emb,
    eager_attention_parts,
    grouped_decode_attention,
    rotary_layout,
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


def test_rotary_layout_rotates_each_kept_pair_with_its_own_frequency():
    """apply_rotary (the flat rotation of a decoding step) and apply_rotary_pair_subset (per head, over many
    positions) with a layer's rotary_layout turn coordinates j and j + r/2 of key head h (and of its query heads) by
    the angle of pair pairs[h, j] of the model's table: checked head by head against the explicit rotation
    x cos + rotate_half(x) sin; with every pair kept in order both are Llama's rotary embedding; a half-precision
    input stays in its dtype."""
    b, t, h, h_kv, full = 2, 5, 4, 2, 8  # the model's table has full/2 = 4 pairs
    angles = torch.randn(b, t, full // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def explicit(x, a):  # x (b, t, r) of one head, a (b, t, r/2) its angles
        c, s = torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1)
        return x * c + rotate_half(x) * s

    for pairs in (torch.tensor([[3, 1], [0, 2]]), torch.arange(full // 2).expand(h_kv, -1)):
        r = 2 * pairs.shape[1]
        q, k = torch.randn(b, t, h * r), torch.randn(b, t, h_kv * r)
        out = apply_rotary(torch.cat((q, k), -1), cos, sin, rotary_layout(pairs, h))
        q_rot, k_rot = out[..., : h * r].view(b, t, h, r), out[..., h * r :].view(b, t, h_kv, r)
        columns, _, sign = rotary_layout(pairs, h)
        q4, k4 = q.view(b, t, h, r).transpose(1, 2), k.view(b, t, h_kv, r).transpose(1, 2)
        q_sub, k_sub = apply_rotary_pair_subset(q4, k4, cos, sin, columns[-h_kv * r :], sign[-h_kv * r :])
        for head in range(h):
            kv = head // (h // h_kv)
            a = angles[..., pairs[kv]]
            torch.testing.assert_close(q_rot[:, :, head], explicit(q4[:, head], a))
            torch.testing.assert_close(k_rot[:, :, kv], explicit(k4[:, kv], a))
            torch.testing.assert_close(q_sub[:, head], explicit(q4[:, head], a))
            torch.testing.assert_close(k_sub[:, kv], explicit(k4[:, kv], a))
    for got, want in zip((q_sub, k_sub), apply_rotary_pos_emb(q4, k4, cos, sin)):  # every pair, in order
        torch.testing.assert_close(got, want)
    half = (out.bfloat16(), cos.bfloat16(), sin.bfloat16(), rotary_layout(pairs, h))  # the sign does not promote
    assert apply_rotary(*half).dtype == torch.bfloat16


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


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_cached_decoding_steps_give_the_logits_of_the_whole_sequence(implementation):
    """Logits of positions decoded one at a time with the cache (the decoding step's flat rotation, and under SDPA its
    grouped kernel) equal those of one forward pass over the whole sequence (the per-head rotations), in every layer
    kind: all pairs in order, a subset, another order."""
    model = compressed_shape_model()
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        for layer in model.model.layers:  # sharp attention patterns, so that a wrong angle shows in the logits
            layer.self_attn.q_proj.weight.mul_(30)
        ids = torch.randint(0, VOCAB, (2, 9))
        whole = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        steps = [out.logits]
        for i in range(5, 9):
            out = model(ids[:, i : i + 1], cache=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-5)


def test_the_kept_rotary_layout_follows_edits_of_the_pairs():
    """A layer keeps its rotary layout between calls; an edit of `rope_pair_index` in place, or a new tensor in its
    place, gives the next call the new pairs' function (equal to a fresh copy's), not the kept layout's."""
    model = compressed_shape_model()
    ids = torch.randint(0, VOCAB, (1, 7))
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        before = model(ids).logits
        attn.rope_pair_index[0] = torch.tensor([0, 2])  # in place
        edited = model(ids).logits
        assert not torch.allclose(edited, before)
        torch.testing.assert_close(edited, copy.deepcopy(model)(ids).logits, rtol=0, atol=0)
        attn.rope_pair_index = torch.tensor([[3, 1], [0, 2]])  # replaced: the original pairs again
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


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
