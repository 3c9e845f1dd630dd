"""Properties of the relational-transformer architecture: Auto round trips, attention kernels, cache, padding,
parameter counts, gauge equivalence, value-space parallel removal and input validation."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

import relational_hf
from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.params import llama_parameter_count, orbit_dimensions_fixed, relational_parameter_count

VOCAB = 97

# Variants covering rotary / no rotary, GQA, thin keys, biases, untied head and parallel removal.
VARIANTS = {
    "rope": dict(),
    "gqa_thin": dict(num_key_value_heads=2, qk_rank=4),
    "norope_bias": dict(position_encoding="none", attention_bias=True, attention_output_bias=True),
    "untied_vpr": dict(tie_word_embeddings=False, value_parallel_removal=True, num_key_value_heads=2),
}


def tiny_config(**overrides) -> RelationalConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(overrides)
    return RelationalConfig(**base)


def trained(model: RelationalForCausalLM, steps: int = 5) -> RelationalForCausalLM:
    """A few AdamW steps so the tests also see weights away from their initialisation."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (4, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.fixture(params=list(VARIANTS))
def model(request) -> RelationalForCausalLM:
    return trained(RelationalForCausalLM(tiny_config(**VARIANTS[request.param])))


def test_registered_with_auto_classes_and_static_tables():
    from transformers.models.auto import modeling_auto

    cfg = AutoConfig.for_model(
        "relational-transformer",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
    )
    assert isinstance(cfg, RelationalConfig)
    assert type(AutoModelForCausalLM.from_config(cfg)).__name__ == "RelationalForCausalLM"
    assert type(AutoModel.from_config(cfg)).__name__ == "RelationalModel"
    assert type(AutoModelForSequenceClassification.from_config(cfg)).__name__ == "RelationalForSequenceClassification"
    assert modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["relational-transformer"] == "RelationalForCausalLM"


def test_save_and_load_roundtrip_gives_identical_logits(model, tmp_path):
    ids = torch.randint(3, VOCAB, (2, 10))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_relational.RelationalForCausalLM"
    # every code file of the model family travels (the model file imports its siblings relatively)
    code = {p.name for p in Path(relational_hf.modeling.__file__).parent.glob("*.py")} - {"__init__.py"}
    assert {"modeling_relational.py", "configuration_relational.py", "modeling_gauge.py"} <= code
    assert code <= {p.name for p in tmp_path.glob("*.py")}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    low = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert low.model.embed_tokens.weight.dtype == torch.bfloat16
    diff = (low(ids).logits.float() - model(ids).logits).abs().max().item()
    assert diff < 0.1 * model(ids).logits.abs().max().item() + 0.05


def test_trust_remote_code_load_without_the_plugin(tmp_path):
    """In a process that cannot import relational_hf: the checkpoint loads with trust_remote_code, gives identical
    logits, and Trainer label smoothing shifts the labels (the modeling file registers the causal-LM name)."""
    model = trained(RelationalForCausalLM(tiny_config(num_key_value_heads=2)))
    ids = torch.randint(3, VOCAB, (2, 9))
    model.save_pretrained(tmp_path / "ckpt")
    torch.save({"ids": ids, "logits": model(ids).logits.detach()}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["relational_hf"] = None  # the plugin must not be importable here
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads({torch.get_num_threads()})  # same kernels as the parent: the logits agree bit for bit
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True)
        assert "relational_hf" not in type(m).__module__, type(m).__module__
        exp = torch.load({str(tmp_path / "expected.pt")!r})
        diff = (m(exp["ids"]).logits - exp["logits"]).abs().max().item()
        # the modeling file tells the Trainer this is a causal LM: label smoothing on next-token labels
        from transformers import Trainer, TrainingArguments
        x = exp["ids"]
        args = TrainingArguments(output_dir={str(tmp_path / "run")!r}, label_smoothing_factor=0.1, report_to=[],
                                 use_cpu=True)
        loss = Trainer(model=m, args=args).compute_loss(m, {{"input_ids": x, "labels": x}})
        logits = m(x).logits[:, :-1]
        expected = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), label_smoothing=0.1)
        print("SMOOTHING", abs(float(loss) - float(expected)))
        print("DIFF", diff)
    """)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split("DIFF")[-1]) == 0.0
    assert float(out.stdout.split("SMOOTHING")[-1].split()[0]) < 1e-5


def test_sdpa_and_eager_agree(model):
    ids = torch.randint(3, VOCAB, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in one row
    model.set_attn_implementation("eager")
    eager = model(ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    sdpa = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(sdpa[keep], eager[keep], rtol=0, atol=1e-5)


def test_generation_with_cache_equals_without(model):
    ids = torch.randint(3, VOCAB, (2, 6))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without)


def test_left_padded_batch_matches_each_sequence_alone(model):
    a, b = torch.randint(3, VOCAB, (1, 7)), torch.randint(3, VOCAB, (1, 4))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    alone_a, alone_b = model.generate(a, **kwargs), model.generate(b, **kwargs)
    assert torch.equal(together[0, -6:], alone_a[0, -6:])
    assert torch.equal(together[1, -6:], alone_b[0, -6:])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parameter_count_matches_formula_and_pivot_saves_exactly_the_orbit(variant):
    pivot = RelationalForCausalLM(tiny_config(**VARIANTS[variant]))
    free = RelationalForCausalLM(tiny_config(**VARIANTS[variant], gauge="free"))
    n_pivot = sum(p.numel() for p in pivot.parameters())
    n_free = sum(p.numel() for p in free.parameters())
    assert n_pivot == relational_parameter_count(pivot.config)
    assert n_free == relational_parameter_count(free.config)
    # orbit dimensions worked out by hand: L * (QK + VO + MLP scales)
    c = pivot.config
    qk = c.num_key_value_heads * (c.qk_rank if c.position_encoding == "rope" else c.qk_rank**2)
    vo = 0 if c.value_parallel_removal else c.num_key_value_heads * c.head_dim**2
    assert n_free - n_pivot == c.num_hidden_layers * (qk + vo + c.intermediate_size)
    assert n_free - n_pivot == sum(orbit_dimensions_fixed(c).values())


def test_llama_count_matches_transformers_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    c = tiny_config(num_key_value_heads=2)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    assert sum(p.numel() for p in llama.parameters()) == llama_parameter_count(c)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pivot_and_free_gauges_represent_the_same_function(variant):
    pivot = trained(RelationalForCausalLM(tiny_config(**VARIANTS[variant])))
    free = RelationalForCausalLM(tiny_config(**VARIANTS[variant], gauge="free")).eval()
    free.load_state_dict(
        {k: v for k, v in pivot.state_dict().items() if "self_attn" not in k and "mlp" not in k}, strict=False
    )
    for src, dst in zip(pivot.model.layers, free.model.layers):
        dst.self_attn.set_full_weights(src.self_attn.full_weights())
        dst.mlp.set_full_weights(src.mlp.full_weights())
    ids = torch.randint(3, VOCAB, (2, 10))
    torch.testing.assert_close(free(ids).logits, pivot(ids).logits, rtol=0, atol=1e-5)
    # and back: a trained free model moved into the pivot gauge computes the same function
    free = trained(free)
    back = RelationalForCausalLM(tiny_config(**VARIANTS[variant])).eval()
    back.load_state_dict(
        {k: v for k, v in free.state_dict().items() if "self_attn" not in k and "mlp" not in k}, strict=False
    )
    for src, dst in zip(free.model.layers, back.model.layers):
        dst.self_attn.set_full_weights(src.self_attn.full_weights())
        dst.mlp.set_full_weights(src.mlp.full_weights())
    torch.testing.assert_close(back(ids).logits, free(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_free_gauge_with_fix_gauge_stores_the_pivot_representative(variant):
    """`set_full_weights(w, fix_gauge=True)` in the free gauge stores the full weights a pivot-gauge module computes
    with for the same w (the orbit's pivot representative), so the function is unchanged while factors given badly
    scaled against each other (a random element of each gauge group applied) come out as well scaled as the pivot
    gauge's; without it the free gauge stores w as given."""
    torch.manual_seed(0)
    pivot = trained(RelationalForCausalLM(tiny_config(**VARIANTS[variant])))
    free = RelationalForCausalLM(tiny_config(**VARIANTS[variant], gauge="free")).eval()
    free.load_state_dict(
        {k: v for k, v in pivot.state_dict().items() if "self_attn" not in k and "mlp" not in k}, strict=False
    )
    ids = torch.randint(3, VOCAB, (2, 10))
    for src, dst in zip(pivot.model.layers, free.model.layers):
        w, m = src.self_attn.full_weights(), src.mlp.full_weights()
        attn, c = dst.self_attn, pivot.config
        # badly scaled factors of the same function: V x 1e-3 and O x 1e3 per head; up x 1e2 and down x 1e-2
        v = {k: t.detach().clone() for k, t in w.items()}
        if not c.value_parallel_removal:
            v["v"] = v["v"] * 1e-3
            v["o"] = v["o"] * 1e3
            if "v_bias" in v:
                v["v_bias"] = v["v_bias"] * 1e-3
        u = {"gate": m["gate"], "up": m["up"] * 1e2, "down": m["down"] * 1e-2}
        dst.self_attn.set_full_weights(v)
        assert torch.equal(attn.full_weights()["o"], v["o"])  # as given
        dst.self_attn.set_full_weights(v, fix_gauge=True)
        dst.mlp.set_full_weights(u, fix_gauge=True)
        ref = copy.deepcopy(src)  # a pivot-gauge layer given the well-scaled w: its pivots chosen anew from w
        ref.self_attn.set_full_weights(w)
        ref.mlp.set_full_weights(m)
        for key, t in ref.self_attn.full_weights().items():
            torch.testing.assert_close(attn.full_weights()[key], t, rtol=1e-4, atol=1e-5)
        for key, t in ref.mlp.full_weights().items():
            torch.testing.assert_close(dst.mlp.full_weights()[key], t, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(free(ids).logits, pivot(ids).logits, rtol=0, atol=1e-4)


def test_pivot_entries_are_exact_and_stored_factors_are_bounded():
    model = RelationalForCausalLM(tiny_config(position_encoding="none"))
    c = model.config
    k_proj = model.model.layers[0].self_attn.k_proj
    w = k_proj.full_weight().view(c.num_key_value_heads, c.qk_rank, c.hidden_size)
    pivots = k_proj.fixed_index.view(c.num_key_value_heads, c.qk_rank, -1)[:, 0, :]
    block = torch.gather(w, 2, pivots.unsqueeze(1).expand(-1, c.qk_rank, -1))
    torch.testing.assert_close(block, c.pivot_scale * torch.eye(c.qk_rank).expand_as(block), rtol=0, atol=0)
    # a new model's free entries are drawn in the gauge (N(0, c^2 / r)), no block inverted: near the pivot scale
    assert k_proj.weight.abs().max().item() <= 4 * c.pivot_scale


def test_the_pivot_value_splits_each_pairs_scale_between_its_stored_factors():
    """At initialisation the pivot value c decides only how each pair's scale is split between its stored factors
    (free entries of W_K, W_V, W_up ~ c, their partners W_Q, W_O, W_down ~ 1/c); the invariants' scale is c-free."""

    def rms(t: torch.Tensor) -> float:
        return float(t.detach().pow(2).mean().sqrt())

    def scales(c: float) -> tuple[list[float], list[float]]:
        torch.manual_seed(0)
        model = RelationalForCausalLM(tiny_config(hidden_size=128, intermediate_size=384, pivot_scale=c))
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        pairs = [(attn.q_proj, attn.k_proj), (attn.o_proj, attn.v_proj), (mlp.down_proj, mlp.up_proj)]
        stored = [rms(p.weight) / rms(g.weight) for p, g in pairs]
        w = attn.full_weights()
        g_qk = w["q"].view(4, -1, 128).transpose(1, 2) @ w["k"].view(4, -1, 128)
        g_vo = w["v"].view(4, -1, 128).transpose(1, 2) @ w["o"].view(128, 4, -1).permute(1, 2, 0)
        up = mlp.full_weights()
        return stored, [rms(g_qk), rms(g_vo), rms(up["up"].T @ up["down"].T)]

    (stored_1, invariants_1), (stored_2, invariants_2) = scales(0.1), scales(0.2)
    for a, b in zip(stored_1, stored_2):
        assert 3.5 < a / b < 4.5  # partner / gauge-fixed RMS falls as 1/c^2
    for a, b in zip(invariants_1, invariants_2):
        assert 0.9 < a / b < 1.1


def test_value_parallel_removal_makes_head_outputs_orthogonal_to_own_value():
    model = trained(RelationalForCausalLM(tiny_config(value_parallel_removal=True, num_key_value_heads=2)))
    attn = model.model.layers[1].self_attn
    seen = {}
    h1 = attn.v_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("v", o))
    h2 = attn.o_proj.register_forward_pre_hook(lambda m, i: seen.__setitem__("o", i[0]))
    try:
        model(torch.randint(3, VOCAB, (2, 12)))
    finally:
        h1.remove()
        h2.remove()
    c = model.config
    v = seen["v"].view(2, 12, c.num_key_value_heads, 1, c.head_dim).expand(-1, -1, -1, c.num_key_value_groups, -1)
    o = seen["o"].view(2, 12, c.num_key_value_heads, c.num_key_value_groups, c.head_dim)
    cos = torch.nn.functional.cosine_similarity(o, v, dim=-1)
    assert cos.abs().max().item() < 1e-5
    # position 0 attends only to itself (o_0 = v_0, nothing perpendicular); later positions keep their perpendicular part
    assert o[:, 0].abs().max().item() < 1e-6 and o[:, 1:].norm(dim=-1).min().item() > 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("vocab_size", 0),
        ("hidden_size", -4),
        ("intermediate_size", 0),
        ("num_hidden_layers", 0),
        ("num_attention_heads", 0),
        ("num_key_value_heads", 3),
        ("num_key_value_heads", 8),
        ("head_dim", 0),
        ("qk_rank", 9),
        ("qk_rank", 3),
        ("position_encoding", "alibi"),
        ("gauge", "diagonal"),
        ("initializer_range", 0.0),
        ("rms_norm_eps", -1e-6),
        ("rms_norm_eps", float("nan")),
        ("attention_dropout", 1.5),
        ("attention_dropout", float("nan")),
        ("initializer_range", float("nan")),
        ("pivot_scale", float("nan")),
        ("rope_parameters", {"rope_type": "default", "rope_theta": float("nan")}),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.5}),
        ("pad_token_id", VOCAB),
        ("eos_token_id", -1),
        ("hidden_act", "tanh"),
        ("max_position_embeddings", 0),
        ("use_cache", "yes"),
        ("rope_parameters", {"rope_type": "spiral"}),
        ("rope_parameters", {"rope_type": "default", "rope_theta": -1.0}),
        ("pivot_scale", 0.0),
        ("tie_word_embeddings", 1),
        ("final_norm_gain", "yes"),
    ],
)
def test_bad_config_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field.split("[")[0]):
        tiny_config(**{field: value})


def test_final_gain_is_present_exactly_in_front_of_a_tied_head_unless_asked():
    d = 32
    for tie, asked, present in [(True, None, True), (False, None, False), (True, False, False), (False, True, True)]:
        config = tiny_config(tie_word_embeddings=tie, final_norm_gain=asked)
        model = RelationalForCausalLM(config)
        assert config.final_norm_gain is present and (model.model.norm.weight is not None) is present
        assert sum(p.numel() for p in model.parameters()) == relational_parameter_count(config)
        if present:
            assert torch.equal(model.model.norm.weight, torch.ones(d))  # the identity at initialisation
    with_gain = relational_parameter_count(tiny_config())
    assert with_gain - relational_parameter_count(tiny_config(final_norm_gain=False)) == d


def test_checkpoint_saved_before_the_final_gain_field_loads_with_a_unit_gain(tmp_path):
    """A tied checkpoint whose config predates `final_norm_gain` (no gain stored) loads with the gain at one: the
    same function, and the gain then trains."""
    old = trained(RelationalForCausalLM(tiny_config(final_norm_gain=False)))
    old.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["final_norm_gain"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.final_norm_gain and torch.equal(loaded.model.norm.weight, torch.ones(32))
    ids = torch.randint(3, VOCAB, (2, 10))
    torch.testing.assert_close(loaded(ids).logits, old(ids).logits, rtol=0, atol=1e-6)


def test_pivot_gauge_needs_head_dim_within_hidden_size():
    with pytest.raises(ValueError, match="head_dim"):
        tiny_config(head_dim=64, qk_rank=8)
    assert tiny_config(head_dim=64, gauge="free").head_dim == 64


def test_out_of_vocabulary_input_ids_raise_a_clear_error():
    model = RelationalForCausalLM(tiny_config())
    with pytest.raises(ValueError, match=rf"token id {VOCAB}.*vocabulary \[0, {VOCAB}\)"):
        model(torch.tensor([[5, VOCAB]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 4]]))


def test_broken_checkpoint_directories_give_one_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    model = RelationalForCausalLM(tiny_config())
    model.save_pretrained(tmp_path / "good")
    weights = (tmp_path / "good" / "model.safetensors").read_bytes()
    for name in ("missing", "truncated", "shapes"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    (tmp_path / "truncated" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    state = load_file(tmp_path / "good" / "model.safetensors")
    state["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(5, 32)
    save_file(state, tmp_path / "shapes" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OSError, match=r"missing[/\\]model\.safetensors: weights file is missing"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "missing")
    with pytest.raises(OSError, match=r"truncated[/\\]model\.safetensors: .*truncated"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "truncated")
    with pytest.raises(ValueError, match=r"gate_proj\.weight' has shape \[5, 32\] but config\.json implies \[48, 32\]"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "shapes")


def test_sequence_classification_pools_last_non_padding_token():
    cfg = tiny_config(num_labels=3)
    clf = AutoModelForSequenceClassification.from_config(cfg).eval()
    ids = torch.randint(3, VOCAB, (1, 6))
    padded = torch.cat([ids, torch.zeros(1, 2, dtype=torch.long)], 1)  # right padding with pad id 0
    out = clf(torch.cat([padded, padded]), labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and torch.isfinite(out.loss)
    torch.testing.assert_close(out.logits[0], clf(ids).logits[0], rtol=0, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = RelationalForCausalLM(tiny_config(num_key_value_heads=2)).train()
    ids = torch.randint(3, VOCAB, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.activation_checkpointing_enable()
    model(input_ids=ids, labels=ids).loss.backward()
    for g, p in zip(plain, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_trainer_label_smoothing_shifts_labels_for_relational_models(tmp_path):
    """The Trainer decides label shifting from MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: with smoothing 0.1 its loss must
    equal the smoothed cross-entropy of next-token predictions."""
    from transformers import Trainer, TrainingArguments

    model = RelationalForCausalLM(tiny_config()).eval()
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args)
    ids = torch.randint(3, VOCAB, (2, 10))
    loss = trainer.compute_loss(model, {"input_ids": ids, "labels": ids})
    logits = model(ids).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), label_smoothing=0.1)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_version_and_public_names():
    for name in ("RelationalConfig", "RelationalModel", "RelationalForCausalLM", "RelationalForSequenceClassification"):
        assert hasattr(relational_hf, name)


def test_inference_weight_cache_follows_parameter_updates():
    model = RelationalForCausalLM(tiny_config()).eval()
    ids = torch.randint(3, VOCAB, (2, 8))
    with torch.no_grad():
        before = model(ids).logits
        model.model.layers[0].self_attn.k_proj.weight.add_(0.05)  # an optimizer-like in-place update
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
        cached = model(ids).logits
    fresh = model(ids).logits  # with autograd: assembled from scratch
    assert not torch.allclose(before, cached)
    torch.testing.assert_close(cached, fresh.detach(), rtol=0, atol=0)


def test_gauge_fixed_weight_follows_a_new_layout_and_its_gradient_is_the_free_entries_of_the_full_one():
    from relational_hf.modeling import GaugeFixedLinear

    lin = GaugeFixedLinear(6, 4, 2)
    torch.nn.init.normal_(lin.weight)
    for fixed in (torch.tensor([[0, 1], [2, 3], [4, 5], [1, 3]]), torch.tensor([[5, 0], [1, 2], [3, 4], [0, 2]])):
        values = torch.randn(4, 2)
        lin.set_layout(fixed, values)
        w = lin.full_weight()  # with autograd: the training path
        assert torch.equal(torch.gather(w.detach(), 1, lin.fixed_index), values)
        assert torch.equal(torch.gather(w.detach(), 1, lin.free_index), lin.weight.detach())
        upstream = torch.randn(4, 6)
        (w * upstream).sum().backward()
        assert torch.equal(lin.weight.grad, torch.gather(upstream, 1, lin.free_index))
        lin.weight.grad = None


def test_gauge_setters_act_on_a_model_loaded_with_from_pretrained(tmp_path):
    """Transformers flags loaded tensors as initialised; the gauge setters must still write them."""
    RelationalForCausalLM(tiny_config()).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    attn = loaded.model.layers[0].self_attn
    weights = {k: v.detach().clone() for k, v in attn.full_weights().items()}
    weights["k"] = weights["k"] * 2.0  # a different QK form
    attn.set_full_weights(weights)
    r = loaded.config.qk_rank

    def forms(w):  # per head G_QK = W_Q W_K^T (d x d), invariant under the per-head QK gauge
        q, k = w["q"].view(-1, r, w["q"].shape[-1]), w["k"].view(-1, r, w["k"].shape[-1])
        return q.transpose(1, 2) @ k

    torch.testing.assert_close(forms(attn.full_weights()), forms(weights), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(forms(attn.full_weights()), forms(loaded.model.layers[1].self_attn.full_weights()))
