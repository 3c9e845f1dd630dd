"""Layer-streamed compression of a Gemma 3 checkpoint and of its relational conversion (`compress.streamed`: each
layer with its own mask and rotary table, `compress.layer_inputs.layer_positions`; the embedding scale through
`streamed.relational_embed`; the sandwich norms through the shared per-layer functions): through the command line,
`compress --stream` gives the model `compress --no-stream` gives (the same kept widths and stored count, weights and
logits to float tolerance, the same calibration and held-out perplexities), keeps the tied head tied and loads with
AutoModelForCausalLM; the layer sources' ends are the conversion's. The model is conftest.py's `gemma3_source`
(`gemma3_models.convertible`: random norm gains, a sliding-window layer of window 4 and a full one), the windows
longer than the window."""

from __future__ import annotations

import json

import pytest
import torch
from family_helpers import load, run, save, stored, text_file
from gemma3_models import D, L, convertible, longer_than_the_window
from transformers import AutoModelForCausalLM

from relational_hf.compress.mlp_fit import embedded
from relational_hf.compress.streamed import RelationalCheckpointLayers, streamed_perplexity
from relational_hf.convert import to_relational
from relational_hf.convert.streaming import LlamaCheckpointLayers
from relational_hf.lm.metrics import perplexity


def _held_out_text(folder):
    path = folder / "held_out.txt"
    path.write_text("pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump over it. " * 30)
    return path


def _compress(src, out, tmp_path, capsys, *mode) -> dict:
    """`compress SRC OUT --remove 0.15` on 8 windows of 24 tokens of the user's text alone (no sampled share, so both
    modes fit the same windows), held-out perplexity on another text; the report."""
    argv = ["compress", src, out, "--remove", 0.15, "--calibration", text_file(tmp_path), "--self-calibration", 0]
    options = ["--window", 24, "--calibration-windows", 8, "--eval-windows", 4, "--eval", _held_out_text(tmp_path)]
    run([*argv, *options, *mode], capsys)
    return json.loads((out / "compression_report.json").read_text())


@pytest.mark.parametrize("converted", [False, True], ids=["checkpoint", "conversion"])
def test_compress_stream_gives_the_in_memory_model(converted, gemma3_checkpoint, gemma3_converted, tmp_path, capsys):
    """From the Gemma 3 checkpoint (converted layer by layer as it is read) or from its conversion on disk,
    `--stream` (asked for: no longer refused) and `--no-stream` keep the same widths, store the same count (the
    report's, the saved checkpoint's, at most the budget), report the QK forms kept at full width (QK-norm) and the
    local refit target, write the same weights and logits to float tolerance and measure the same calibration and
    held-out perplexities; both outputs load with AutoModelForCausalLM, the head tied to the embedding."""
    src = gemma3_converted if converted else gemma3_checkpoint
    memory = _compress(src, tmp_path / "memory", tmp_path, capsys, "--no-stream")
    streamed = _compress(src, tmp_path / "streamed", tmp_path, capsys, "--stream")
    assert streamed["streamed"] and not memory.get("streamed")
    assert streamed["widths"] == memory["widths"]
    assert streamed["parameters_before"] == memory["parameters_before"]
    assert streamed["parameters_after"] == memory["parameters_after"] <= streamed["parameters_budget"]
    assert streamed["qk_kept_full"] == memory["qk_kept_full"] and len(streamed["qk_kept_full"]) == L
    assert streamed["options"]["correction"] == memory["options"]["correction"] == "local"
    assert sum(streamed["widths"]["mlp"]) + sum(streamed["widths"]["vo"]) < L * (64 + 8)  # it narrowed
    for key in ("calibration_perplexity_before", "calibration_perplexity_after"):
        assert streamed[key] == pytest.approx(memory[key], rel=1e-4)
    held_out = [(r["eval_perplexity_before"], r["eval_perplexity_after"]) for r in (streamed, memory)]
    assert held_out[0] == pytest.approx(held_out[1], rel=1e-4)
    a, b = load(tmp_path / "streamed"), load(tmp_path / "memory")
    assert stored(a) == stored(b) == streamed["parameters_after"]
    assert a.lm_head.weight is a.model.embed_tokens.weight and b.lm_head.weight is b.model.embed_tokens.weight
    mine, theirs = a.state_dict(), b.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        scale = max(1.0, float(theirs[name].abs().max()))
        assert float((tensor - theirs[name]).abs().max()) <= 1e-4 * scale, name
    probe = longer_than_the_window(batch=2, length=20, seed=7)
    with torch.no_grad():
        expected, got = b(probe).logits, a(probe).logits
    assert float((got - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")).__name__ == "RelationalForCausalLM"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@torch.no_grad()
def test_the_layer_sources_ends_are_the_conversions(tied, gemma3_source, tmp_path):
    """The layer source of the Gemma 3 checkpoint and of its conversion embed (times the embedding scale) and read
    out (the final 1 + w gain in front of the tied head, or folded into the untied one) as the converted model does,
    write its tensors outside the layers, and give the source model's perplexity on windows longer than the sliding
    window (each layer's own mask and rotary table: the sliding layer attended fully would differ)."""
    model = gemma3_source if tied else convertible(tie_word_embeddings=False)
    rel = to_relational(model).eval()
    save(model, tmp_path / "src")
    rel.save_pretrained(tmp_path / "rel")
    window = longer_than_the_window(batch=2, length=20, seed=3)
    state = rel.state_dict()
    for source in (LlamaCheckpointLayers(tmp_path / "src"), RelationalCheckpointLayers(tmp_path / "rel")):
        assert torch.allclose(source.embed(window), embedded(rel, window), atol=1e-6)
        hidden = torch.randn(2, 20, D, generator=torch.Generator().manual_seed(5))
        expected = rel.lm_head(rel.model.norm(hidden))
        assert torch.allclose(source.head()(hidden), expected, atol=1e-5 * float(expected.abs().max()))
        outside = {n: torch.cat([b.float() for b in blocks]) for n, _, blocks in source.static_tensors()}
        assert set(outside) == {"model.embed_tokens.weight", "model.norm.weight" if tied else "lm_head.weight"}
        for n, t in outside.items():
            assert torch.allclose(t, state[n].float(), atol=1e-6), n
        assert streamed_perplexity(source, window) == pytest.approx(perplexity(model, window), rel=1e-5)
