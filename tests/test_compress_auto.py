"""The automatic choices of the compression (`LowRankOptions(mlp_order="auto", refine_epochs=None)`, the defaults):
forward selection and the refinement for models small enough, the cheap settings otherwise, recorded in the report."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf.commands.main import main
from relational_hf.compress import LowRankOptions
from relational_hf.compress.lowrank import compress_layer, layer_error_curves
from relational_hf.compress.options import AUTO_GREEDY_MAX_UNITS, AUTO_REFINE_EPOCHS, AUTO_REFINE_MAX_BYTES
from relational_hf.convert import to_relational
from relational_hf.modeling import RelationalConfig


def _config(hidden: int = 576, d_ff: list[int] | None = None) -> RelationalConfig:
    d_ff = d_ff or [1536, 1024]
    return RelationalConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=max(d_ff), num_hidden_layers=len(d_ff),
        num_attention_heads=4, head_dim=16, layer_intermediate_sizes=d_ff,
    )  # fmt: skip


def _ids(n: int, t: int) -> torch.Tensor:
    return torch.zeros(n, t, dtype=torch.long)


@pytest.mark.parametrize(("widest", "order"), [(AUTO_GREEDY_MAX_UNITS, "greedy"), (AUTO_GREEDY_MAX_UNITS + 64, "score")])
def test_auto_order_is_greedy_up_to_the_widest_layer_limit(widest, order):
    """The order follows the widest layer (per-layer widths of a compressed source included)."""
    resolved = LowRankOptions().resolved(_config(d_ff=[256, widest, 512]), _ids(4, 16))
    assert resolved.mlp_order == order and not resolved.automatic()


def test_auto_refinement_follows_the_memory_of_its_two_copies():
    """Four epochs while 2 x windows x tokens x hidden float32 fit in the limit, none beyond it; none with a single
    window (nothing to hold back) or with correction "none" (nothing refitted)."""
    config = _config(hidden=576)
    fits = AUTO_REFINE_MAX_BYTES // (2 * 512 * 576 * 4)  # windows of 512 tokens that fit
    assert LowRankOptions().resolved(config, _ids(fits, 512)).refine_epochs == AUTO_REFINE_EPOCHS
    assert LowRankOptions().resolved(config, _ids(fits + 1, 512)).refine_epochs == 0
    assert LowRankOptions().resolved(config, _ids(1, 512)).refine_epochs == 0
    assert LowRankOptions(correction="none").resolved(config, _ids(8, 512)).refine_epochs == 0
    assert LowRankOptions().resolved(_config(hidden=2048), _ids(128, 512)).refine_epochs == 0  # a 1B-wide stream


def test_explicit_values_are_kept_and_the_report_names_the_automatic_fields():
    config, ids = _config(), _ids(8, 64)
    explicit = LowRankOptions(mlp_order="score", refine_epochs=2)
    assert explicit.resolved(config, ids) == explicit and explicit.automatic() == ()
    report = LowRankOptions().as_report(config, ids)
    assert report["mlp_order"] == "greedy" and report["refine_epochs"] == AUTO_REFINE_EPOCHS
    assert report["automatic"] == ["mlp_order", "refine_epochs"]
    assert "automatic" not in LowRankOptions().as_report()  # without the model, the settings as given


def test_per_layer_functions_refuse_options_left_to_the_automatic_choice():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=32)  # fmt: skip
    rel = to_relational(LlamaForCausalLM(config)).eval()
    layer, h = rel.model.layers[0], torch.randn(2, 8, 32)
    with pytest.raises(ValueError, match="automatic choice"):
        layer_error_curves(rel.config, layer, h, LowRankOptions(), (None, None, None, None))
    with pytest.raises(ValueError, match="automatic choice"):
        compress_layer(layer, layer, h, None, {"qk": 8, "vo": 8, "mlp": 32}, LowRankOptions(), (None, None, None, None))


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_the_command_records_its_automatic_choices(tmp_path, capsys, stream, byte_llama_checkpoint):
    """By default the command refines with forward selection on a small model and says so in its report; explicit
    flags are taken as given, and the report then names no automatic field."""
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    base = ["compress", str(byte_llama_checkpoint), "OUT", "--remove", "0.1", "--calibration", str(text), "--window",
            "32", "--calibration-windows", "4", stream]  # fmt: skip
    for name, extra in (("auto", []), ("given", ["--mlp-order", "score", "--refine-epochs", "0"])):
        args = [str(tmp_path / name) if a == "OUT" else a for a in base]
        assert main([*args, *extra]) == 0, capsys.readouterr().err
        report = json.loads((tmp_path / name / "compression_report.json").read_text())
        options = report["options"]
        if name == "auto":
            assert (options["mlp_order"], options["refine_epochs"]) == ("greedy", AUTO_REFINE_EPOCHS)
            assert options["automatic"] == ["mlp_order", "refine_epochs"]
            assert len(report["refits"]) == 2 and all("refine_epoch" in r for r in report["refits"])
        else:
            assert (options["mlp_order"], options["refine_epochs"], options["automatic"]) == ("score", 0, [])
            assert "refits" not in report
