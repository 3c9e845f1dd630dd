"""Directional decomposition: the sites' (y, z), the statistics against an independent computation from the model's
own hidden states and attention weights, the component edits and their exact reversal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import corpus_or_skip
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.architectures import UnsupportedModelError, get_adapter
from relational_hf.directional import (
    EDIT_SITES,
    SITES,
    collect_updates,
    decompose,
    decompose_dataset,
    perplexity,
    plot_parallel_profile,
    plot_sweeps,
    scale_components,
    sweep_components,
)
from relational_hf.directional.sites import _ATTENTION_HOOKS, ATTENTION_IMPLEMENTATION, tap_sites
from relational_hf.directional.statistics import DEGENERATE_TOLERANCE

VOCAB = 256  # byte-level ids



#: the tiny decoder both families share here (eager attention: the directional hooks read attention weights)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="eager",
)


def tiny_llama(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


def tiny_relational(**overrides) -> RelationalForCausalLM:
    return RelationalForCausalLM(RelationalConfig(**{**TINY, **overrides})).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def trained_llama() -> LlamaForCausalLM:
    """The tiny Llama after 60 AdamW steps (batch 8 x 64) on Tiny Shakespeare bytes (trained, not random, weights)."""
    shakespeare = corpus_or_skip("tinyshakespeare")
    torch.manual_seed(0)
    ids = torch.tensor(list(shakespeare.read_bytes()[:200_000]), dtype=torch.long)
    model = tiny_llama().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        starts = torch.randint(0, ids.numel() - 65, (8,))
        batch = torch.stack([ids[s : s + 64] for s in starts])
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(config).eval()  # q/k/v biases


MODELS = {"llama": tiny_llama, "relational": tiny_relational, "gpt2": tiny_gpt2, "qwen2": tiny_qwen2}


@pytest.fixture(params=["llama", "relational", "gpt2", "trained_llama"])
def model(request):
    if request.param == "trained_llama":
        return request.getfixturevalue("trained_llama")
    return MODELS[request.param]()


def batch(rows: int = 3, length: int = 12, pad_right: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte ids and a mask whose last row is right-padded by `pad_right` tokens."""
    ids = torch.randint(0, VOCAB, (rows, length))
    mask = torch.ones_like(ids)
    mask[-1, length - pad_right :] = 0
    return ids, mask


def hooks(model: torch.nn.Module) -> list:
    """Every forward (pre-)hook on the model's modules and every directional attention hook, by identity
    (Transformers installs its own output-capturing hooks once, so compare before/after rather than with zero)."""
    found = []
    for m in model.modules():
        found += [(id(m), "pre", k) for k in m._forward_pre_hooks] + [(id(m), "post", k) for k in m._forward_hooks]
        found += [(id(m), "attention", id(h)) for h in _ATTENTION_HOOKS.get(m, ())]
    return found


# ----------------------------------------------------------------------------------------------------------------
# Decomposition
# ----------------------------------------------------------------------------------------------------------------


def test_parallel_and_perpendicular_parts_reconstruct_y_and_perpendicular_is_orthogonal_at_every_site(model):
    from relational_hf.modeling.modeling_directional import parallel_component

    ids, mask = batch()
    updates = collect_updates(model, ids, attention_mask=mask)
    assert set(updates) == set(SITES)
    for site, layers in updates.items():
        assert sorted(layers) == [0, 1]
        for y, z in layers.values():
            y, z = y.double(), z.double()
            y_par = parallel_component(y, z)
            y_perp = y - y_par
            assert y.abs().max() > 0, site
            assert torch.allclose(y_par + y_perp, y, rtol=0, atol=1e-12)
            cos = (y_perp * z).sum(-1) / (y_perp.norm(dim=-1) * z.norm(dim=-1)).clamp_min(1e-30)
            assert cos.abs().max() < 1e-4, site
            assert ((y_par / z).nan_to_num(0).std(-1) < 1e-4 * (y_par / z).nan_to_num(0).abs().mean(-1) + 1e-7).all()


def _independent_updates(model, ids, mask) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(y, z) per site and layer from output_hidden_states and output_attentions (plus v_proj, o_proj, the pre-norms
    and the MLP applied to those states); real tokens only, float64. In Transformers v5 the last hidden state is the
    final-normed one, so each layer's output is rebuilt as z_mlp + MLP(norm(z_mlp)) and checked against the next
    hidden state where one exists."""
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    hs, attentions = out.hidden_states, out.attentions
    valid = mask.bool()
    result = {site: [] for site in SITES}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h, a = hs[i], attentions[i]  # (B, T, d), (B, H, T, T)
        b, t, _ = h.shape
        heads = a.shape[1]
        v = attn.v_proj(layer.input_layernorm(h)).view(b, t, -1, attn.head_dim).transpose(1, 2)  # (B, H_kv, T, d_h)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)  # (B, H, T, d_h)
        o = a @ v  # (B, H, T, d_h)
        y_attn = attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))  # (B, T, d)
        d = torch.diagonal(a, dim1=-2, dim2=-1).unsqueeze(-1) * v
        per_head = valid[:, None, :].expand(b, heads, t)
        z_mlp = h + y_attn
        h_next = z_mlp + layer.mlp(layer.post_attention_layernorm(z_mlp))
        if i + 1 < len(model.model.layers):
            assert torch.allclose(h_next, hs[i + 1], atol=1e-6)
        result["residual_attention"].append((y_attn[valid], h[valid]))
        result["residual_mlp"].append(((h_next - z_mlp)[valid], z_mlp[valid]))
        result["block"].append(((h_next - h)[valid], h[valid]))
        result["value"].append((o[per_head], v[per_head]))
        result["value_exclude_self"].append(((o - d)[per_head], v[per_head]))
    return {site: [(y.double(), z.double()) for y, z in pairs] for site, pairs in result.items()}


def _independent_statistics(y: torch.Tensor, z: torch.Tensor) -> dict[str, float]:
    nonzero = y.norm(dim=-1) > 0  # a zero update (c_0 at exclude-self: empty context) has no direction
    y, z = y[nonzero], z[nonzero]
    alpha = (y * z).sum(-1) / (z * z).sum(-1)
    y_par = alpha[:, None] * z
    y_perp = y - y_par
    defined = y_perp.norm(dim=-1) > DEGENERATE_TOLERANCE * y.norm(dim=-1)
    ratio = y_par.norm(dim=-1) / y_perp.norm(dim=-1)
    cos = (z * (z + y)).sum(-1) / (z.norm(dim=-1) * (z + y).norm(dim=-1))
    return {
        "count": y.shape[0],
        "degenerate": int((~defined).sum()),
        "parallel_ratio": ratio[defined].mean().item(),
        "parallel_energy": (y_par.norm(dim=-1) ** 2 / (y.norm(dim=-1) ** 2)).mean().item(),
        "alpha_mean": alpha.mean().item(),
        "alpha_std": alpha.std(unbiased=False).item(),
        "cosine": cos.mean().item(),
    }


@pytest.mark.parametrize("family", ["llama", "relational", "trained_llama"])
def test_hooked_statistics_match_an_independent_computation_from_hidden_states_and_attentions(family, request):
    model = request.getfixturevalue("trained_llama") if family == "trained_llama" else MODELS[family]()
    ids, mask = batch()
    with torch.no_grad():
        expected = _independent_updates(model, ids, mask)
    report = decompose(model, ids, attention_mask=mask)
    for site in SITES:
        for i, stats in enumerate(report.sites[site]):
            want = _independent_statistics(*expected[site][i])
            got = stats.to_dict()
            assert got["layer"] == i
            assert got["count"] == want["count"] and got["degenerate"] == want["degenerate"], (site, i)
            for key in ("parallel_ratio", "parallel_energy", "alpha_mean", "alpha_std", "cosine"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), (site, i, key)
    # the first token's own value is its whole aggregate (A_00 = 1): degenerate at the value site, one per head
    assert report.sites["value"][0].degenerate >= ids.shape[0] * 4


def test_padding_positions_are_excluded():
    model = tiny_relational()
    ids, mask = batch(rows=2, length=12, pad_right=5)
    padded = decompose(model, ids[1:], attention_mask=mask[1:])
    short = decompose(model, ids[1:, :7])
    for site in SITES:
        for a, b in zip(padded.sites[site], short.sites[site]):
            assert a.count == b.count
            assert a.parallel_energy == pytest.approx(b.parallel_energy, rel=1e-5)
            assert a.alpha_mean == pytest.approx(b.alpha_mean, rel=1e-5, abs=1e-7)


def test_dataset_helper_pools_batches_like_one_batch():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (4, 10))
    pooled = decompose_dataset(model, [ids[:2], {"input_ids": ids[2:]}], progress=True)
    whole = decompose(model, ids)
    for site in SITES:
        for a, b in zip(pooled.sites[site], whole.sites[site]):
            assert a.count == b.count
            for key in ("parallel_ratio", "parallel_energy", "alpha_mean", "alpha_std", "cosine"):
                assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-6, abs=1e-9), (site, key)


def test_model_output_is_unchanged_while_tapped_and_hooks_are_gone_afterwards(model):
    ids, mask = batch()
    expected = model(input_ids=ids, attention_mask=mask).logits
    installed = hooks(model)
    seen = []
    with tap_sites(model, SITES, lambda site, layer, y, z: seen.append((site, layer))):
        assert model.config._attn_implementation == ATTENTION_IMPLEMENTATION
        hooked = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(hooked, expected)
    assert len(set(seen)) == len(SITES) * 2
    assert model.config._attn_implementation == "eager"
    assert hooks(model) == installed


def test_sdpa_model_is_close_while_tapped_and_its_implementation_is_restored():
    model = tiny_llama(attn_implementation="sdpa")
    ids, mask = batch()
    expected = model(input_ids=ids, attention_mask=mask).logits
    with tap_sites(model, "value", lambda *args: None):
        hooked = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(hooked, expected, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_hooks_are_removed_when_the_forward_pass_fails():
    model = tiny_llama()
    ids, mask = batch()
    installed = hooks(model)

    def fail(site, layer, y, z):
        raise RuntimeError(f"failing at {site}")

    for site in SITES:
        with pytest.raises(RuntimeError, match=f"failing at {site}"):
            with tap_sites(model, site, fail):
                model(input_ids=ids, attention_mask=mask)
        assert hooks(model) == installed
        assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError):
        decompose(model, ids, attention_mask=mask[:, :-1])  # a mask of the wrong length fails inside the forward
    assert hooks(model) == installed
    assert model.config._attn_implementation == "eager"


def test_unsupported_model_and_bad_site_names_raise_clear_errors():
    from transformers import OPTConfig, OPTForCausalLM  # a family no adapter knows (GPT-NeoX has one now)

    opt = OPTForCausalLM(
        OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64,
                  word_embed_proj_dim=32, max_position_embeddings=64)  # fmt: skip
    )
    ids = torch.randint(0, 64, (1, 5))
    with pytest.raises(UnsupportedModelError, match="unsupported: OPTForCausalLM"):
        decompose(opt, ids)
    with pytest.raises(UnsupportedModelError, match="unsupported"):
        with scale_components(opt, "value", parallel=0.0):
            pass
    model = tiny_llama()
    with pytest.raises(ValueError, match="allowed sites: residual_attention, residual_mlp, block, value"):
        decompose(model, ids, sites=["values"])
    with pytest.raises(ValueError, match="diagonal"):
        with scale_components(model, "attention", parallel=0.0):
            pass
    with pytest.raises(ValueError, match="out of range"):
        decompose(model, ids, layers=[2])


# ----------------------------------------------------------------------------------------------------------------
# Component edits
# ----------------------------------------------------------------------------------------------------------------


def _capture_value_space(model, ids, **kwargs):
    """Run the model recording, per layer, the attention module's input x, the pre-W_O output o (B, T, H, d_h) and
    the attention weights A."""
    inputs, pre_wo = {}, {}
    handles = []
    for roles in get_adapter(model).layers():
        attn = roles.attention
        handles.append(
            attn.register_forward_pre_hook(
                lambda m, a, k, i=roles.index: inputs.__setitem__(i, k.get("hidden_states", a[0] if a else None)),
                with_kwargs=True,
            )
        )
        handles.append(attn.o_proj.register_forward_pre_hook(lambda m, a, i=roles.index: pre_wo.__setitem__(i, a[0])))
    try:
        out = model(input_ids=ids, output_attentions=True, **kwargs)
    finally:
        for h in handles:
            h.remove()
    values = {}
    for roles in get_adapter(model).layers():
        attn = roles.attention
        b, t, _ = inputs[roles.index].shape
        v = attn.v_proj(inputs[roles.index]).view(b, t, -1, attn.head_dim)  # (B, T, H_kv, d_h)
        heads = out.attentions[roles.index].shape[1]
        values[roles.index] = v.repeat_interleave(heads // v.shape[2], dim=2)  # (B, T, H, d_h)
        pre_wo[roles.index] = pre_wo[roles.index].view(b, t, heads, -1)
    return out, pre_wo, values


@pytest.mark.parametrize("family", ["llama", "relational", "gpt2", "qwen2"])
@pytest.mark.parametrize("site", [s for s in EDIT_SITES if s != "diagonal"])
def test_unit_scaling_is_an_exact_no_op(family, site):
    model = MODELS[family]()
    ids, mask = batch()
    expected = model(input_ids=ids, attention_mask=mask).logits
    with scale_components(model, site, parallel=1, perpendicular=1.0):
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)


@pytest.mark.parametrize("family", ["llama", "relational"])
def test_removing_the_value_parallel_part_makes_the_pre_wo_output_orthogonal_to_the_own_value(family):
    model = MODELS[family]()
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad(), scale_components(model, "value", parallel=0.0, perpendicular=1.0):
        _, pre_wo, values = _capture_value_space(model, ids)
    for i in pre_wo:
        o, v = pre_wo[i], values[i]
        cos = F.cosine_similarity(o, v, dim=-1)
        assert cos.abs().max() < 1e-5
        assert o.norm(dim=-1)[:, 1:].min() > 0  # not orthogonal by being zero (token 0: o_0 = v_0, removed whole)
    with torch.no_grad():
        _, plain, values = _capture_value_space(model, ids)
    assert F.cosine_similarity(plain[0], values[0], dim=-1).abs().mean() > 1e-2  # the edit did something


@pytest.mark.parametrize("family", ["llama", "relational"])
def test_exclude_self_edit_keeps_the_direct_term_and_scales_only_the_context_term(family):
    model = MODELS[family]()
    ids = torch.randint(0, VOCAB, (2, 10))
    s_par, s_perp = 0.3, 2.0
    with torch.no_grad():
        for layer in (0, 1):
            # edit only this layer, so its input (and hence A, v) is the unedited model's
            with scale_components(model, "value_exclude_self", parallel=0.0, perpendicular=0.0, layers=[layer]):
                out, pre_wo, values = _capture_value_space(model, ids)
            a = out.attentions[layer].transpose(1, 2)  # (B, T, H, T)
            direct = torch.diagonal(a, dim1=1, dim2=3).transpose(1, 2).unsqueeze(-1) * values[layer]  # A_tt v_t
            assert torch.allclose(pre_wo[layer], direct, atol=1e-6)  # (0, 0): exactly d_t is left
            with scale_components(model, "value_exclude_self", parallel=s_par, perpendicular=s_perp, layers=[layer]):
                out, pre_wo, values = _capture_value_space(model, ids)
            v = values[layer]
            o = torch.einsum("bths,bshe->bthe", a, v)  # o_t = sum_s A_ts v_s
            c = o - direct
            c_par = ((c * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True)) * v
            expected = direct + s_par * c_par + s_perp * (c - c_par)
            assert torch.allclose(pre_wo[layer], expected, atol=1e-6)


def test_diagonal_control_zeroes_the_self_weight_and_renormalises_rows():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad(), scale_components(model, "diagonal"):
        out, pre_wo, values = _capture_value_space(model, ids)
    for i, a in enumerate(out.attentions):
        assert torch.diagonal(a, dim1=-2, dim2=-1).abs().max() == 0
        rows = a.sum(-1)
        assert torch.allclose(rows[..., 1:], torch.ones_like(rows[..., 1:]), atol=1e-6)
        assert rows[..., 0].abs().max() == 0  # the first token has no other key
        assert torch.allclose(pre_wo[i], torch.einsum("bhts,bshe->bthe", a, values[i]), atol=1e-6)
    with pytest.raises(ValueError, match="takes no scales"):
        with scale_components(model, "diagonal", parallel=0.5):
            pass


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("site", EDIT_SITES)
@pytest.mark.parametrize("fail", [False, True])
def test_model_is_bit_identical_after_the_context_exits(site, fail):
    model = tiny_relational()
    ids, mask = batch()
    before, logits = _snapshot(model), model(input_ids=ids, attention_mask=mask).logits
    installed = hooks(model)
    scales = {} if site == "diagonal" else {"parallel": 0.0, "perpendicular": 0.5}
    try:
        with scale_components(model, site, **scales):
            edited = model(input_ids=ids, attention_mask=mask).logits
            assert not torch.allclose(edited, logits)
            if fail:
                raise RuntimeError("boom")
    except RuntimeError:
        assert fail
    after = _snapshot(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits)
    assert model.config._attn_implementation == "eager"
    assert hooks(model) == installed


def test_nested_contexts_unwind_one_level_at_a_time():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 8))
    base, installed = model(input_ids=ids).logits, hooks(model)
    with scale_components(model, "diagonal"):
        once = model(input_ids=ids).logits
        with scale_components(model, "diagonal"), scale_components(model, "value", parallel=0.5):
            inner = model(input_ids=ids).logits
            decompose(model, ids)  # measuring inside an edit
        assert torch.equal(model(input_ids=ids).logits, once) and not torch.equal(inner, once)
        assert model.config._attn_implementation == ATTENTION_IMPLEMENTATION
    assert torch.equal(model(input_ids=ids).logits, base)
    assert hooks(model) == installed and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("site", ["value", "value_exclude_self", "diagonal", "residual_attention"])
def test_edits_agree_between_a_full_pass_and_cached_decoding(site):
    """With a key/value cache the T queries are the last T key positions: decoding token by token under an edit
    gives the same logits as one pass over the whole sequence."""
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 12))
    scales = {} if site == "diagonal" else {"parallel": 0.25, "perpendicular": 1.5}
    with torch.no_grad(), scale_components(model, site, **scales):
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :8], use_cache=True)
        steps = [out.logits[:, -1]]
        cache = out.cache
        for t in range(8, 12):
            out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[:, -1])
    assert torch.allclose(torch.stack(steps[:-1], 1), full[:, 7:11], atol=1e-5)


def test_layers_argument_restricts_the_edit():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 8))
    plain = model(input_ids=ids, output_hidden_states=True).hidden_states
    with scale_components(model, "residual_mlp", parallel=0.0, perpendicular=0.0, layers=[-1]):
        edited = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.equal(edited[1], plain[1])  # layer 0 untouched
    assert not torch.allclose(edited[2], plain[2])


@pytest.mark.parametrize("bad", ["0.5", None, True, float("nan"), [1.0]])
def test_bad_scale_values_raise_value_error(bad):
    model = tiny_llama()
    installed = hooks(model)
    with pytest.raises(ValueError, match="must be a finite real number"):
        with scale_components(model, "value", parallel=bad):
            pass
    assert hooks(model) == installed


# ----------------------------------------------------------------------------------------------------------------
# Perplexity and sweeps
# ----------------------------------------------------------------------------------------------------------------


def test_perplexity_is_exp_of_the_mean_token_nll_over_real_targets():
    model = tiny_llama()
    ids, mask = batch(rows=2, length=10, pad_right=3)
    logits = model(input_ids=ids).logits[:, :-1]
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    real = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    assert perplexity(model, ids, mask, batch_size=1) == pytest.approx(nll[real].mean().exp().item(), rel=1e-5)


def test_sweep_reports_delta_perplexity_and_writes_figures(trained_llama, tmp_path):
    shakespeare = corpus_or_skip("tinyshakespeare")  # present: the fixture trained_llama skipped otherwise
    ids = torch.tensor(list(shakespeare.read_bytes()[-2048:]), dtype=torch.long).view(-1, 64)[:8]
    sweeps = [sweep_components(trained_llama, ids, "block", c, [0.0, 1.0]) for c in ("parallel", "perpendicular")]
    for s in sweeps:
        assert s.deltas[1] == 0.0  # s = 1 is the unedited model
    assert sweeps[1].deltas[0] > sweeps[0].deltas[0] > 0  # the block update without its perpendicular part is worse
    plot_sweeps(sweeps, tmp_path / "sweep.png")
    plot_parallel_profile(decompose(trained_llama, ids[:2]), tmp_path / "profile.png")
    for name in ("sweep.png", "profile.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="allowed components: parallel, perpendicular"):
        sweep_components(trained_llama, ids, "block", "orthogonal", [0.0])
