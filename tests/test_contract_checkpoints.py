"""Checkpoints and configs of the relational classes: the compact gauge layout (a saved model stores its parameters
and small pivot tensors, nothing else), strict loading (missing / unexpected tensors are errors naming them), and
configs: every value Llama accepts for a shared field saves and loads,
validation on assignment, NaN refused."""

from __future__ import annotations

import json
import math
import re
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.modeling import GaugeFixedLinear
from relational_hf.modeling.configuration_relational import RelationalConfigError

VOCAB = 61
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4)
VARIANTS = {
    "pivot": dict(),
    "thin_keys_gqa": dict(num_key_value_heads=2, qk_rank=4),
    "no_rope_bias": dict(position_encoding="none", attention_bias=True),
    "value_removal_untied": dict(value_parallel_removal=True, tie_word_embeddings=False),
}


def model_for(seed: int = 0, **overrides) -> RelationalForCausalLM:
    torch.manual_seed(seed)
    model = RelationalForCausalLM(RelationalConfig(**{**BASE, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def ids(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def data_bytes(file) -> int:
    """Bytes of tensor data in a safetensors file (file size minus the 8-byte length and the JSON header)."""
    raw = open(file, "rb").read(8)
    return file.stat().st_size - 8 - struct.unpack("<Q", raw)[0]


# ---- compact layout ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_saved_model_stores_its_parameters_and_small_pivot_tensors_only(variant, tmp_path):
    model = model_for(**VARIANTS[variant])
    model.save_pretrained(tmp_path / "pivot")
    file = tmp_path / "pivot" / "model.safetensors"
    params = {n: p for n, p in model.named_parameters()}  # tied weights counted once
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    pivots = [m.pivots for m in model.modules() if isinstance(m, GaugeFixedLinear)]
    pivot_bytes = sum(t.numel() * t.element_size() for t in pivots)
    assert all(t.dtype == torch.int32 for t in pivots)  # small, and broadcastable by every DDP backend
    assert data_bytes(file) == param_bytes + pivot_bytes
    with safe_open(file, framework="pt") as st:
        assert not [k for k in st.keys() if k.rsplit(".", 1)[-1] in ("fixed_index", "free_index", "fixed_value")]
    # the fixed entries were parameters in the free gauge: the pivot checkpoint holds less data
    free = model_for(**VARIANTS[variant], gauge="free")
    free.save_pretrained(tmp_path / "free")
    assert data_bytes(file) < data_bytes(tmp_path / "free" / "model.safetensors")


def test_converted_smollm2_layers_are_not_larger_on_disk_than_the_source(smollm2_dir, tmp_path):
    """The first two layers of SmolLM2-135M (fp32): the converted checkpoint is smaller than the source's."""
    from transformers import AutoConfig, LlamaForCausalLM

    from relational_hf.convert import to_relational

    config = AutoConfig.from_pretrained(smollm2_dir)
    config.num_hidden_layers = 2
    state = load_file(smollm2_dir / "model.safetensors")
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    source = LlamaForCausalLM(config)
    source.load_state_dict(keep, strict=False)
    source.save_pretrained(tmp_path / "source")
    converted = to_relational(source.eval())
    converted.save_pretrained(tmp_path / "relational")
    src = (tmp_path / "source" / "model.safetensors").stat().st_size
    out = (tmp_path / "relational" / "model.safetensors").stat().st_size
    assert out < src, (out, src)


def test_noncanonical_layout_is_exact_in_state_dict_and_regauged_by_save_pretrained(tmp_path):
    model = model_for()
    up = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        up.set_layout(up.fixed_index.clone(), up.fixed_value * 1.5)
    x = ids()
    expected = model(x).logits
    state = model.state_dict()
    assert "model.layers.0.mlp.up_proj.fixed_value" in state  # the non-canonical layout travels exactly
    fresh = model_for(seed=5)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x).logits, expected, rtol=0, atol=0)
    model.save_pretrained(tmp_path)
    assert up.is_canonical  # moved back into the canonical gauge, same function
    torch.testing.assert_close(model(x).logits, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path)(x).logits, expected, rtol=1e-4, atol=1e-5)


# ---- strict loading -----------------------------------------------------------------------------------------------


def test_more_layers_in_config_than_in_the_weights_is_an_error_naming_them(tmp_path):
    model_for().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing tensors \(\d+\): .*model\.layers\.2\.mlp"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_fewer_layers_in_config_than_in_the_weights_is_an_error_naming_them(tmp_path):
    model_for(num_hidden_layers=3).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unexpected tensors \(\d+\): .*model\.layers\.2\."):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "drop", ["model.layers.0.self_attn.k_proj.pivots", "model.layers.1.mlp.up_proj.pivots", "lm_head.weight"]
)
def test_a_missing_tensor_is_an_error_naming_it(drop, tmp_path):
    model_for(tie_word_embeddings=False).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state[drop]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \(1\): " + re.escape(drop)):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_an_extra_tensor_is_an_error_naming_it(tmp_path):
    model_for().save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.mlp.extra"] = torch.zeros(3)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensors \(1\): model\.layers\.0\.mlp\.extra"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_other_task_heads_load_from_a_causal_lm_checkpoint(tmp_path):
    """As for every Transformers model, the body loads under another head: a new classification head is initialised,
    the unused LM head skipped; the body is exact."""
    model = model_for(tie_word_embeddings=False, pad_token_id=0)
    model.save_pretrained(tmp_path)
    x = ids()
    base = AutoModel.from_pretrained(tmp_path)
    torch.testing.assert_close(base(x).last_hidden_state, model.model(x).last_hidden_state, rtol=0, atol=0)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    assert classifier(x).logits.shape == (2, 3)


# ---- configs ------------------------------------------------------------------------------------------------------

LLAMA_ACCEPTS = [
    ("rms_norm_eps", 1.0),
    ("rms_norm_eps", 0.0),
    ("initializer_range", 1.0),
    ("attention_dropout", 0.5),
    ("max_position_embeddings", 1),
    ("hidden_act", "gelu"),
    ("use_cache", False),
    ("attention_bias", True),
    ("tie_word_embeddings", False),
    ("eos_token_id", [1, 2]),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    (
        "rope_parameters",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
    ),
]


@pytest.mark.parametrize("field,value", LLAMA_ACCEPTS, ids=[f"{f}={v}" for f, v in LLAMA_ACCEPTS])
def test_values_llama_accepts_save_and_load(field, value, tmp_path):
    LlamaConfig(**BASE, **{field: value})  # the premise: Llama accepts it
    model = model_for(**{field: value}, bos_token_id=1, eos_token_id=2) if field != "eos_token_id" else None
    model = model or model_for(eos_token_id=value)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(loaded.config, field) == getattr(model.config, field)
    x = ids(length=40)  # longer than the scaled rotary types' original context
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_a_field_set_after_construction_is_validated_then_and_round_trips(tmp_path):
    model = model_for()
    model.config.rms_norm_eps = 1.0  # Llama accepts it; so do we, and the checkpoint loads
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.rms_norm_eps == 1.0
    config = RelationalConfig(**BASE)
    for field, value in [("gauge", "bogus"), ("rms_norm_eps", math.nan), ("pivot_scale", math.inf), ("vocab_size", 0)]:
        with pytest.raises(ValueError, match=field):
            setattr(config, field, value)
    config.qk_rank = 3  # valid alone; odd rotary width only shows with the other fields
    with pytest.raises(ValueError, match="qk_rank"):
        RelationalForCausalLM(config)
    with pytest.raises(ValueError, match="qk_rank"):
        config.save_pretrained(tmp_path / "bad")
    assert isinstance(pytest.raises(RelationalConfigError, RelationalConfig, gauge="x").value, ValueError)


def test_odd_head_dim_is_fine_without_rotary_and_refused_with_it():
    config = RelationalConfig(**{**BASE, "hidden_size": 28}, head_dim=7, position_encoding="none")
    assert config.qk_rank == 7
    model = RelationalForCausalLM(config).eval()
    assert model(ids()).logits.shape == (2, 9, VOCAB)
    with pytest.raises(ValueError, match="qk_rank` must be even"):
        RelationalConfig(**{**BASE, "hidden_size": 28}, head_dim=7)
    assert RelationalConfig(**{**BASE, "hidden_size": 28}, head_dim=7, qk_rank=6).qk_rank == 6  # thin even keys


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
        dict(partial_rotary_factor=0.5),
    ],
)
def test_partial_rotary_turns_the_first_coordinates_and_bad_factors_are_refused_with_a_clear_error(kwargs):
    """Partial rotary (GPT-NeoX's rotary_pct): half of each head's 8 query/key coordinates turn, the model runs; a
    factor outside (0, 1] or one that turns an odd number of coordinates is refused naming the field."""
    config = RelationalConfig(**BASE, **kwargs)
    assert config.rotary_dim == 4
    assert RelationalForCausalLM(config).eval()(ids()).logits.shape == (2, 9, VOCAB)
    for bad in (1.5, 0.375):
        rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": bad}
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            RelationalConfig(**BASE, rope_parameters=rope)


def test_legacy_top_level_rope_theta_is_moved_into_rope_parameters(tmp_path):
    config = RelationalConfig(**BASE, rope_theta=123456.0)
    assert config.rope_parameters["rope_theta"] == 123456.0


def test_pivot_scale_edited_after_construction_is_applied_by_save_with_the_same_function(tmp_path):
    model = model_for(num_key_value_heads=2)
    x = ids()
    expected = model(x).logits
    model.config.pivot_scale = 0.37
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.pivot_scale == 0.37
    torch.testing.assert_close(loaded(x).logits, expected, rtol=1e-4, atol=1e-5)
    v = loaded.model.layers[0].self_attn.v_proj
    torch.testing.assert_close(torch.gather(v.full_weight(), 1, v.fixed_index)[:4, :4], 0.37 * torch.eye(4))


@pytest.mark.parametrize("in_features,out_features,m", [(6, 4, 2), (32, 16, 8), (50, 12, 1), (7, 7, 7)])
def test_derived_free_columns_are_the_complement_of_the_pivots_in_order(in_features, out_features, m):
    lin = GaugeFixedLinear(in_features, out_features, m)
    g = torch.Generator().manual_seed(in_features)
    for _ in range(10):
        index = torch.stack([torch.randperm(in_features, generator=g)[:m] for _ in range(out_features)])
        lin.set_layout(index, torch.randn(out_features, m, generator=g))
        free = torch.ones(out_features, in_features, dtype=torch.bool).scatter_(1, index, False)
        expected = torch.arange(in_features).expand(out_features, -1)[free].view(out_features, -1)
        assert torch.equal(lin.free_index, expected)
