"""The symmetry toolkit on a compressed model, whose QK and value widths differ from layer to layer (free gauge):
the groups take each layer's own widths, act without changing the function, and training with the plugin's Trainer
(balance tracking, update projection) runs on it."""

from __future__ import annotations

import copy

import pytest
import torch
from test_symmetry_projection import _inner
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf.compress import LowRankOptions, compress_relational
from relational_hf.convert import to_relational
from relational_hf.symmetry import UpdateProjector, apply_random_symmetry, orbit_balance, symmetry_groups


@pytest.fixture(scope="module")
def compressed():
    """A tiny Llama (GQA, RoPE) compressed by a third in the free gauge, with distinct per-layer widths."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    rel = to_relational(LlamaForCausalLM(config)).eval()
    ids = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(1))
    budget = int(sum(p.numel() for p in rel.parameters()) * 0.8)
    opts = LowRankOptions(qk_step=1, vo_step=1, mlp_step=8, min_qk_pairs=1, min_vo_rank=1, min_mlp_units=8)
    out, _ = compress_relational(rel, ids, budget, opts, progress=False)
    c = out.config
    assert c.gauge == "free" and c.layer_qk_ranks is not None and c.layer_value_ranks is not None
    assert min(c.layer_value_ranks) < c.head_dim or min(c.layer_qk_ranks) < c.qk_rank, "nothing was cut from attention"
    return out


def test_head_groups_take_each_layers_own_widths(compressed):
    """One QK gauge (a complex scalar per kept rotary pair: r_l dimensions per key head) and one VO gauge (GL(r_v)
    per key/value head) per layer, sized by that layer's widths, and balances of those sizes."""
    c = compressed.config
    groups, _ = symmetry_groups(compressed)
    dims = {(g.name, g.layer): g.dimension() for g in groups}
    balance = orbit_balance(compressed, groups)
    for layer in range(c.num_hidden_layers):
        r, rv, hkv = c.layer_qk_ranks[layer], c.layer_value_ranks[layer], c.num_key_value_heads
        assert dims[("qk_gauge", layer)] == hkv * r
        assert dims[("vo_gauge", layer)] == hkv * rv**2
        assert balance[f"layers.{layer}.qk_gauge"].shape == (hkv, r, r)
        assert balance[f"layers.{layer}.vo_gauge"].shape == (hkv, rv, rv)


def test_a_random_group_element_moves_the_weights_and_keeps_the_function(compressed):
    model = copy.deepcopy(compressed)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
    moved = apply_random_symmetry(model, torch.Generator().manual_seed(3), scale=0.5)
    raw = max((a - b).abs().max().item() for a, b in zip(compressed.parameters(), moved.parameters(), strict=True))
    assert raw > 1e-2
    with torch.no_grad():
        assert (moved(ids).logits - before).abs().max().item() < 1e-4


def test_projected_update_of_a_compressed_model_is_horizontal(compressed):
    """The update projector (what `symmetry_projection="update"` applies) leaves no component along any group's
    vertical directions of the compressed model."""
    model = compressed.double()
    try:
        projector = UpdateProjector(model, tol=1e-11, max_iter=300)
        generator = torch.Generator().manual_seed(4)
        delta = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in projector.params.items()}
        vertical = projector.vertical_part(delta)
        horizontal = {k: delta[k] - vertical[k] for k in delta}
        h_norm = _inner(horizontal, horizontal) ** 0.5
        for group in projector.groups:
            probe = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in projector.params.items()}
            direction = {k: torch.zeros_like(v) for k, v in delta.items()}
            group.vertical(group.adjoint(probe), direction)
            assert abs(_inner(horizontal, direction)) < 1e-8 * h_norm * _inner(direction, direction) ** 0.5, group.key
    finally:
        compressed.float()


@pytest.mark.parametrize("projection", ["none", "update"])
def test_the_plugins_trainer_fine_tunes_a_compressed_model(tmp_path, compressed, projection):
    """Full fine-tuning of a compressed checkpoint with `RelationalTrainer` (balance tracking on, with and without
    the update projection): the loss falls, every weight keeps its compressed shape, and with the projection the
    balance of every group moves far less than the weights."""
    from relational_hf.lm.data import RandomBlockDataset
    from relational_hf.training import RelationalTrainer, RelationalTrainingArguments

    model = copy.deepcopy(compressed).train()
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    start = {k: v.detach().clone() for k, v in orbit_balance(model).items()}
    ids = torch.randint(0, 64, (400,), generator=torch.Generator().manual_seed(5))
    args = RelationalTrainingArguments(
        output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4, learning_rate=3e-3, report_to=[],
        save_strategy="no", logging_steps=4, use_cpu=True, symmetry_projection=projection, disable_tqdm=True,
    )  # fmt: skip
    trainer = RelationalTrainer(model=model, args=args, train_dataset=RandomBlockDataset(ids, 16, 48, seed=0))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    drift = [e["orbit_drift"] for e in trainer.state.log_history if "orbit_drift" in e]
    assert drift and all(torch.isfinite(torch.tensor(drift)))
    if projection == "update":
        moved = sum(float((v - start[k]).norm()) for k, v in orbit_balance(model).items())
        total = sum(float(v.norm()) for v in start.values())
        assert moved < 0.05 * total
