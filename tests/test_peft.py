"""PEFT LoRA on relational models: every projection is a target (including the gauge-fixed k_proj, v_proj, up_proj
of the pivot gauge), training with RelationalTrainer moves only the adapters, the adapter round-trips through
save_pretrained / PeftModel.from_pretrained / AutoPeftModelForCausalLM, and merging gives the adapter model's logits
with the merged layers back in the canonical pivot gauge."""

from __future__ import annotations

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
from tiny_models import VOCAB, periodic_data, tiny_relational
from transformers import AutoModelForCausalLM

from relational_hf import RelationalForCausalLM
from relational_hf.modeling import GaugeFixedLinear
from relational_hf.training import RelationalTrainer, RelationalTrainingArguments
from relational_hf.training.peft_support import (
    GaugeFixedLoraLinear,
    load_lora,
    lora_config_from_pretrained,
    merge_and_unload,
    relational_lora_config,
)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def canonical_pivots(model: RelationalForCausalLM) -> bool:
    """Every pivot entry of every gauge-fixed layer is 0 or c = pivot_scale (the canonical c I / (c, 0) layouts)."""
    c = model.config.pivot_scale
    values = [m.fixed_value for m in model.modules() if isinstance(m, GaugeFixedLinear)]
    return bool(values) and all(bool(((v == 0) | ((v - c).abs() < 1e-6 * c)).all()) for v in values)


@pytest.fixture
def base_dir(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "base"
    tiny_relational("pivot").save_pretrained(path)
    return path


def test_lora_trains_round_trips_and_merges_into_the_pivot_gauge(base_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, relational_lora_config(r=8, lora_alpha=64, lora_dropout=0.05))
    attention, mlp = model.base_model.model.model.layers[0].self_attn, model.base_model.model.model.layers[0].mlp
    for module in (attention.k_proj, attention.v_proj, mlp.up_proj):
        assert isinstance(module, GaugeFixedLoraLinear)
    args = RelationalTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, max_steps=12, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        parallel_suppression_coef=0.1,
    )  # fmt: skip
    trainer = RelationalTrainer(model=model, args=args, train_dataset=periodic_data(32))
    trainer.train()
    losses = [h["task_loss"] for h in trainer.state.log_history if "task_loss" in h]
    assert losses[-1] < losses[0] - 0.3
    for name, value in model.get_base_model().state_dict().items():  # base weights never move
        key = name.replace(".base_layer", "")
        if "lora_" not in name:
            assert torch.equal(value, frozen[key]), name
    ids = torch.randint(0, VOCAB, (2, 12))
    adapted = logits(model, ids)
    with model.disable_adapter():
        assert (logits(model, ids) - adapted).abs().max() > 1e-3  # the adapters changed the function

    model.save_pretrained(tmp_path / "adapter")
    reloaded = load_lora(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    assert isinstance(reloaded, PeftModel)
    torch.testing.assert_close(logits(reloaded, ids), adapted, rtol=0, atol=0)
    auto = AutoPeftModelForCausalLM.from_pretrained(
        tmp_path / "adapter", config=lora_config_from_pretrained(tmp_path / "adapter")
    )
    torch.testing.assert_close(logits(auto, ids), adapted, rtol=0, atol=0)

    merged = merge_and_unload(reloaded)
    assert not any(isinstance(m, GaugeFixedLoraLinear) for m in merged.modules())
    assert isinstance(merged.model.layers[0].self_attn.k_proj, GaugeFixedLinear)
    assert canonical_pivots(merged)
    torch.testing.assert_close(logits(merged, ids), adapted, rtol=1e-4, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(loaded, ids), adapted, rtol=1e-4, atol=1e-5)
    # PEFT's own merge_and_unload is exact too; it keeps the pivot positions and stores the merged pivot values
    plain = auto.merge_and_unload()
    torch.testing.assert_close(logits(plain, ids), adapted, rtol=1e-4, atol=1e-5)
    assert not canonical_pivots(plain)


def test_merge_then_unmerge_restores_the_base_layer(base_dir):
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir), relational_lora_config(r=2, init_lora_weights="gaussian")
    )
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    base = layer.get_base_layer()
    before = base.full_weight().detach().clone()
    delta = layer.get_delta_weight("default")
    assert delta.shape == before.shape and torch.linalg.matrix_rank(delta) <= 2  # a rank-r update of the full W
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = layer(x)
        layer.merge()
        assert layer.merged
        torch.testing.assert_close(base(x), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(base.full_weight(), before + delta, rtol=1e-6, atol=1e-7)
        layer.unmerge()
    torch.testing.assert_close(base.full_weight(), before, rtol=1e-6, atol=1e-7)


def test_lora_layer_refuses_what_needs_a_plain_linear_weight(base_dir):
    with pytest.raises(ValueError, match="gauge-fixed"):
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(base_dir), relational_lora_config(init_lora_weights="pissa")
        )
    with pytest.raises(ValueError, match="symmetry_projection"):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), relational_lora_config())
        args = RelationalTrainingArguments(
            output_dir="unused", use_cpu=True, report_to=[], symmetry_projection="update"
        )
        RelationalTrainer(model=model, args=args)
