"""The Transformers loading and initialisation contract on the relational classes, for the pivot, free,
value-removal, thin-keys + GQA and per-layer-width (compressed) configurations, with Transformers' Llama as the
control wherever the behaviour is the library's own:

- initialisation: `init_weights()` on a model built on the meta device (then `to_empty`) gives the buffers a model
  built without initialisation has; from one random state, every initialisation path (`init_weights()`, meta +
  `to_empty()` + `init_weights()`, `from_pretrained(None, config=..., state_dict={})`) draws the same model; every
  tensor is a parameter or a buffer (nothing left on meta);
- the initial gauge layout is derived from the config alone (pivots spread over the residual coordinates), the
  factors are drawn in that gauge with the free model's second moments of every invariant and no heavy tails, and
  conversion keeps choosing pivots from the weights;
- loading: a checkpoint without its weights is reported through `output_loading_info` exactly as Llama reports it
  (and refused with a ValueError naming the tensors when the report is not asked for); heads of another
  architecture are reported as for Llama; loading with a device map gives materialised modules whose derived layout
  buffers follow the stored pivots, also for layers offloaded to disk; tied weights stay tied on every path."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import CONTRACT_BASE as BASE
from tiny_models import CONTRACT_CONFIGS
from tiny_models import CONTRACT_VOCAB as VOCAB
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel
from transformers.initialization import no_init_weights

from relational_hf import (
    RelationalConfig,
    RelationalForCausalLM,
    RelationalForSequenceClassification,
    RelationalModel,
)
from relational_hf.modeling import GaugeFixedLinear
from relational_hf.modeling.modeling_gauge import max_volume_rows

CONFIGS = {
    **CONTRACT_CONFIGS,
    "per_layer_widths": dict(
        num_key_value_heads=2,
        layer_qk_ranks=[8, 4],
        layer_value_ranks=[8, 5],
        layer_intermediate_sizes=[40, 24],
        tie_word_embeddings=False,
    ),
}
CLASSES = {
    "causal_lm": RelationalForCausalLM,
    "model": RelationalModel,
    "sequence": RelationalForSequenceClassification,
}
LLAMA = {"causal_lm": LlamaForCausalLM, "model": LlamaModel, "sequence": LlamaForSequenceClassification}


def config(name: str, **overrides) -> RelationalConfig:
    return RelationalConfig(**{**BASE, **CONFIGS[name], **overrides})


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by name."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


def ids(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def assert_same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> None:
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    different = sorted(k for k in ta if ta[k].shape != tb[k].shape or not torch.equal(ta[k], tb[k]))
    assert different == []


def assert_layouts_follow_pivots(model: torch.nn.Module) -> None:
    """Each gauge-fixed map's derived buffers are the canonical layout of its stored pivots."""
    for module in model.modules():
        if isinstance(module, GaugeFixedLinear):
            fixed_index, fixed_value = module.fixed_index.clone(), module.fixed_value.clone()
            free_index = module.free_index.clone()
            module._sync_layout()
            assert torch.equal(fixed_index, module.fixed_index) and torch.equal(fixed_value, module.fixed_value)
            assert torch.equal(free_index, module.free_index)


@pytest.fixture(params=list(CONFIGS))
def name(request) -> str:
    return request.param


# ---- initialisation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CLASSES))
def test_init_weights_on_the_meta_device_gives_the_constructors_buffers(name, kind):
    """Buffers are not drawn: the ones `init_weights()` writes after `to_empty` equal those `__init__` leaves."""
    cls = CLASSES[kind]
    with no_init_weights():
        plain = cls(config(name))
    with torch.device("meta"):
        empty = cls(config(name))
    empty.to_empty(device="cpu")
    empty.init_weights()
    buffers_plain, buffers_empty = dict(plain.named_buffers()), dict(empty.named_buffers())
    assert sorted(buffers_plain) == sorted(buffers_empty)
    assert sorted(k for k, v in buffers_plain.items() if not torch.equal(v, buffers_empty[k])) == []
    assert not any(t.is_meta for t in tensors(empty).values())
    empty.eval()(ids())  # every tensor the forward reads is a parameter or a buffer


def test_every_initialisation_path_draws_the_same_model(name):
    """From the same random state, `init_weights()` of a model built without initialisation, `to_empty()` +
    `init_weights()` of a meta model, and `from_pretrained(None, config, state_dict={})` give one model: every weight,
    layout and derived buffer is written by `_init_weights` (one it missed would keep `to_empty`'s arbitrary values)."""
    with no_init_weights():
        plain = RelationalForCausalLM(config(name))
    torch.manual_seed(7)
    plain.init_weights()
    with torch.device("meta"):
        meta = RelationalForCausalLM(config(name))
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    torch.manual_seed(7)
    loaded = RelationalForCausalLM.from_pretrained(None, config=config(name), state_dict={})
    x = ids()
    for other in (meta.eval(), loaded.eval()):
        assert not any(t.is_meta for t in tensors(other).values())
        assert_same_tensors(plain, other)
        assert_layouts_follow_pivots(other)
        torch.testing.assert_close(other(x).logits, plain.eval()(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_weights_stay_tied_on_every_path(tied, tmp_path):
    cfg = config("pivot", tie_word_embeddings=tied)
    model = RelationalForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        meta = RelationalForCausalLM(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights()
    for m in (
        model,
        meta,
        RelationalForCausalLM.from_pretrained(None, config=cfg, state_dict={}),
        RelationalForCausalLM.from_pretrained(tmp_path),
        RelationalForCausalLM.from_pretrained(tmp_path, device_map="cpu"),
    ):
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied


# ---- the initial gauge ------------------------------------------------------------------------------------------


def test_the_initial_layout_is_the_configs_and_spreads_heads_over_the_residual_coordinates():
    cfg = RelationalConfig(**{**BASE, "hidden_size": 64, "num_key_value_heads": 2}, position_encoding="none")
    a, b = RelationalForCausalLM(cfg), RelationalForCausalLM(cfg)
    for la, lb in zip(a.model.layers, b.model.layers):
        for lin_a, lin_b in ((la.self_attn.k_proj, lb.self_attn.k_proj), (la.mlp.up_proj, lb.mlp.up_proj)):
            assert torch.equal(lin_a.pivots, lin_b.pivots)  # the layout does not depend on the draw
        k = la.self_attn.k_proj.pivots  # (key heads, r): the pivot rows of each key head
        assert k.unique().numel() == k.numel()  # 2 heads x 16 rows <= 64 coordinates: all different
        up = la.mlp.up_proj.pivots.flatten()  # one pivot per hidden unit: as even a spread as possible
        counts = torch.bincount(up.long(), minlength=cfg.hidden_size)
        assert counts.max() - counts.min() <= 1


def test_conversion_still_chooses_pivots_from_the_weights():
    """Only initialisation uses the config's layout: `set_full_weights` (conversion) picks well-conditioned pivots
    of the given factors, with the same function."""
    model = RelationalForCausalLM(config("pivot", position_encoding="none")).eval()
    attn = model.model.layers[0].self_attn
    before = attn.k_proj.pivots.clone()
    weights = {k: torch.randn_like(w) for k, w in attn.full_weights().items()}
    attn.set_full_weights(weights)
    assert not torch.equal(attn.k_proj.pivots, before)
    k_rows = weights["k"].view(4, 8, 32).transpose(1, 2)  # W_K (d x r) per key head
    assert torch.equal(attn.k_proj.pivots.long(), max_volume_rows(k_rows, 8))
    g_qk = weights["q"].view(4, 8, 32).transpose(1, 2) @ weights["k"].view(4, 8, 32)  # (H, d, d) = W_Q W_K^T
    full = attn.full_weights()
    got = full["q"].view(4, 8, 32).transpose(1, 2) @ full["k"].view(4, 8, 32)
    torch.testing.assert_close(got, g_qk, rtol=1e-4, atol=1e-4)
    assert attn.k_proj.weight.abs().max() <= 4 * model.config.pivot_scale  # max-volume pivots: bounded free entries


def _invariants(model: RelationalForCausalLM) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, the invariant products (d x d) and, for each, a mask of its entries at pivot rows: G_QK = W_Q W_K^T
    per query head, G_VO = W_V W_O per head, u_k (x) d_k per SwiGLU unit (stacked)."""
    out: dict[str, list] = {"qk": [], "vo": [], "mlp": []}
    c = model.config
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w = attn.full_weights()
        r, dh, h, hkv, d = attn.qk_rank, attn.head_dim, c.num_attention_heads, c.num_key_value_heads, c.hidden_size
        q = w["q"].view(h, r, d).transpose(1, 2)  # (H, d, r)
        k = w["k"].view(hkv, r, d).transpose(1, 2).repeat_interleave(h // hkv, 0)
        v = w["v"].view(hkv, dh, d).transpose(1, 2).repeat_interleave(h // hkv, 0)  # (H, d, dh)
        o = w["o"].view(d, h, dh).permute(1, 2, 0)  # (H, dh, d)
        k_rows = torch.zeros(h, d, dtype=torch.bool)
        if isinstance(attn.k_proj, GaugeFixedLinear):
            piv = attn.k_proj.pivots.long().view(hkv, -1).repeat_interleave(h // hkv, 0)
            k_rows.scatter_(1, piv, True)
        v_rows = torch.zeros(h, d, dtype=torch.bool)
        if isinstance(attn.v_proj, GaugeFixedLinear):
            v_rows.scatter_(1, attn.v_proj.pivots.long().view(hkv, -1).repeat_interleave(h // hkv, 0), True)
        out["qk"].append((q @ k.transpose(1, 2), k_rows[:, None, :].expand(h, d, d)))  # G[i, j], j a key row
        out["vo"].append((v @ o, v_rows[:, :, None].expand(h, d, d)))  # G[i, j], i a value row
        u, dn = mlp.full_weights()["up"], mlp.full_weights()["down"]  # (f, d), (d, f)
        unit = u[:, :, None] * dn.T[:, None, :]  # (f, d, d): u_k (x) d_k
        u_rows = torch.zeros(u.shape, dtype=torch.bool)
        if isinstance(mlp.up_proj, GaugeFixedLinear):
            u_rows.scatter_(1, mlp.up_proj.pivots.long().view(u.shape[0], 1), True)
        out["mlp"].append((unit, u_rows[:, :, None].expand_as(unit)))
    return out


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(position_encoding="none"), dict(num_key_value_heads=2, qk_rank=8), dict(pivot_scale=0.05)],
    ids=["rope", "no_rope", "thin_gqa", "other_pivot_value"],
)
def test_the_initial_invariants_have_the_free_models_second_moments(overrides):
    """Every entry of G_QK, G_VO and of each SwiGLU unit's u (x) d has, at initialisation, the second moment of the
    free model's (N(0, s^2) factors: r s^4, d_h s^4, s^4), at pivot rows and elsewhere; the stored free entries are
    Gaussian (no heavy tail from inverting a block)."""
    cfg = RelationalConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, **overrides
    )
    torch.manual_seed(0)
    model = RelationalForCausalLM(cfg)
    s = cfg.initializer_range
    want = {"qk": cfg.qk_rank * s**4, "vo": cfg.head_dim * s**4, "mlp": s**4}
    for kind, blocks in _invariants(model).items():
        values = torch.cat([g.flatten() for g, _ in blocks])
        at_pivots = torch.cat([g[m] for g, m in blocks])
        elsewhere = torch.cat([g[~m] for g, m in blocks])
        assert at_pivots.numel() > 1000, kind
        for part in (values, at_pivots, elsewhere):
            ratio = part.double().pow(2).mean().item() / want[kind]
            assert 0.85 < ratio < 1.15, (kind, ratio)
    for module in model.modules():
        if isinstance(module, GaugeFixedLinear):
            w = module.weight.detach()
            assert w.abs().max() < 6 * w.std()  # Gaussian tails (a Cauchy-like draw exceeds this at once)


# ---- loading ----------------------------------------------------------------------------------------------------


def _nuke_weights(folder) -> None:
    """Replace the checkpoint's weights by one tensor that no model has."""
    save_file({"tensor": torch.tensor([1, 2])}, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize("family", ["llama", *CONFIGS])
def test_a_checkpoint_without_its_weights_is_reported_like_llamas(family, kind, tmp_path):
    """With `output_loading_info=True` the model loads, fully initialised, and the report names every parameter
    and persistent buffer missing and the foreign tensor unexpected: the library's contract (Llama is the control)."""
    if family == "llama":
        cls, cfg = LLAMA[kind], LlamaConfig(**{**BASE, "num_key_value_heads": 2})
    else:
        cls, cfg = CLASSES[kind], config(family)
    cls(cfg).save_pretrained(tmp_path)
    _nuke_weights(tmp_path)
    model, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == set(model.state_dict())
    assert set(info["unexpected_keys"]) == {"tensor"}
    assert not any(t.is_meta for t in tensors(model).values())
    out = model.eval()(ids())
    assert torch.isfinite(out.logits if kind != "model" else out.last_hidden_state).all()
    if family != "llama":
        assert_layouts_follow_pivots(model)
        with no_init_weights():
            fresh = cls(cfg)  # the initial layout: what a re-initialised model holds
        assert all(torch.equal(b, dict(fresh.named_buffers())[n]) for n, b in model.named_buffers())


def test_without_output_loading_info_a_checkpoint_that_disagrees_is_refused_naming_the_tensors(tmp_path):
    RelationalForCausalLM(config("pivot")).save_pretrained(tmp_path)
    _nuke_weights(tmp_path)
    with pytest.raises(ValueError, match=r"missing tensors \(\d+\): .*pivots.*unexpected tensors \(1\): tensor"):
        RelationalForCausalLM.from_pretrained(tmp_path)


def test_a_missing_pivots_tensor_is_reported_alone(tmp_path):
    from safetensors.torch import load_file

    RelationalForCausalLM(config("pivot")).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.pivots"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, info = RelationalForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == {"model.layers.1.mlp.up_proj.pivots"} and not info["unexpected_keys"]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kind", ["model", "sequence"])
def test_heads_of_another_architecture_are_reported_like_llamas(kind, tied, tmp_path):
    """A causal-LM checkpoint loaded as the base model or for sequence classification: the same missing and
    unexpected keys as Llama's, and it loads without being asked for the report."""
    reports = []
    for family, lm, cls, cfg in (
        ("llama", LlamaForCausalLM, LLAMA[kind], LlamaConfig(**BASE, tie_word_embeddings=tied)),
        ("relational", RelationalForCausalLM, CLASSES[kind], config("pivot", tie_word_embeddings=tied)),
    ):
        lm(cfg).save_pretrained(tmp_path / family)
        _, info = cls.from_pretrained(tmp_path / family, output_loading_info=True)
        reports.append((set(info["missing_keys"]), set(info["unexpected_keys"])))
        cls.from_pretrained(tmp_path / family)
    assert reports[0] == reports[1]


@pytest.mark.parametrize("device_map", ["cpu", {"": "cpu"}, "auto"])
def test_loading_with_a_device_map_gives_materialised_modules_and_consistent_layouts(name, device_map, tmp_path):
    torch.manual_seed(3)
    model = RelationalForCausalLM(config(name)).eval()
    with torch.no_grad():  # move away from the initial layout: conversion-like pivots chosen from the weights
        for module in model.modules():
            if hasattr(module, "set_full_weights"):
                module.set_full_weights({k: torch.randn_like(w) * 0.05 for k, w in module.full_weights().items()})
    model.save_pretrained(tmp_path)
    loaded = RelationalForCausalLM.from_pretrained(tmp_path, device_map=device_map).eval()
    assert not any(t.is_meta for t in tensors(loaded).values())
    assert_same_tensors(model, loaded)
    assert_layouts_follow_pivots(loaded)
    torch.testing.assert_close(loaded(ids()).logits, model(ids()).logits, rtol=0, atol=0)


def test_without_the_plugin_the_remote_code_initialises_the_same_way(tmp_path):
    """Loaded with trust_remote_code in a process without relational_hf, the classes initialise as the plugin's do:
    the same layouts (from the constructor and from meta + to_empty + init_weights), the partner factors drawn with
    the matched std, and from one random state the same model on both paths."""
    import json

    from checkpoint_helpers import run_without_plugin

    cfg = config("thin_keys_gqa")
    RelationalForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    with no_init_weights():
        plugin = RelationalForCausalLM(cfg)
    pivots = {n: b.tolist() for n, b in plugin.named_buffers() if n.endswith("pivots")}
    (tmp_path / "pivots.json").write_text(json.dumps(pivots))
    q_std = plugin.model.layers[0].self_attn.k_proj.init_stds(cfg.initializer_range)[1]
    code = f"""
import json
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True)
from transformers.initialization import no_init_weights
with no_init_weights():
    built = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True)
with torch.device("meta"):
    meta = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True)
meta.to_empty(device="cpu")
torch.manual_seed(1)
built.init_weights()
torch.manual_seed(1)
meta.init_weights()
want = json.load(open({str(tmp_path / "pivots.json")!r}))
assert type(built).__module__.startswith("transformers_modules"), type(built).__module__
for m in (built, meta):
    got = {{n: b.tolist() for n, b in m.named_buffers() if n.endswith("pivots")}}
    assert got == want
same = all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), meta.state_dict().values()))
print("SAME", same, "QSTD", built.model.layers[0].self_attn.q_proj.weight.std().item())
"""
    result = run_without_plugin(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("SAME"))
    assert line.split()[1] == "True"
    assert abs(float(line.split()[3]) / q_std - 1) < 0.15


def test_layers_offloaded_to_disk_by_a_device_map_compute_with_their_stored_layouts(tmp_path):
    """Layers offloaded to disk keep their weights on the meta device until their forward; their layouts (buffers,
    kept in memory) are the stored ones, so the logits are the saved model's."""
    cfg = config("thin_keys_gqa", num_hidden_layers=3)
    torch.manual_seed(0)
    model = RelationalForCausalLM(cfg).eval()
    with torch.no_grad():  # layouts chosen from the weights (conversion), not the initial ones
        for module in model.modules():
            if hasattr(module, "set_full_weights"):
                module.set_full_weights({k: torch.randn_like(w) * 0.05 for k, w in module.full_weights().items()})
    model.save_pretrained(tmp_path / "ckpt")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map |= {"model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    loaded = RelationalForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    assert loaded.model.layers[1].self_attn.k_proj.weight.is_meta  # really offloaded
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()).logits, model(ids()).logits, rtol=0, atol=0)
