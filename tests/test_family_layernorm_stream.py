"""Layer-streamed compression of GPT-2 and GPT-NeoX checkpoints and of their relational conversions
(`compress.streamed` with `convert.layernorm_stream.LayerNormEnds`): the same model as the in-memory path to float
tolerance, on tiny random checkpoints of Transformers' own classes (random LayerNorm gains and biases, the parallel
residual on for GPT-NeoX, GPT-2's head tied, GPT-NeoX's untied); the layer source's ends are the conversion's; the
command streams these checkpoints and refuses bad input in one line."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import nonlinear_weights, randomize_gains_and_biases
from family_helpers import error_line, run, save, stored, text_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

from relational_hf.compress.mlp_fit import embedded
from relational_hf.compress.streamed import RelationalCheckpointLayers, streamed_perplexity
from relational_hf.convert import to_relational
from relational_hf.convert.streaming import LlamaCheckpointLayers
from relational_hf.jobs import compress_checkpoint, compress_model
from relational_hf.lm.metrics import perplexity
from relational_hf.params import stored_parameters

V, D, L, H, F, P = 259, 32, 2, 4, 48, 64  # the byte-level vocabulary (the command's tokenizer)
OPTIONS = dict(mlp_step=8, plan_windows=4, batch_size=2, refine_epochs=0)


@torch.no_grad()
def family(name: str) -> torch.nn.Module:
    """A tiny GPT-2 (tied head, or untied: "gpt2_untied"; learned positions) or GPT-NeoX (untied head, partial rotary,
    parallel residual), every matrix at unit scale, every gain and bias moved at random."""
    torch.manual_seed(0)
    if name.startswith("gpt2"):
        config = GPT2Config(
            vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_inner=F, n_positions=P, tie_word_embeddings=name == "gpt2"
        )
        model = GPT2LMHeadModel(config)
    else:
        config = GPTNeoXConfig(
            vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F,
            max_position_embeddings=P, rotary_pct=0.25, use_parallel_residual=True,
        )  # fmt: skip
        model = GPTNeoXForCausalLM(config)
    return randomize_gains_and_biases(nonlinear_weights(model)).float().eval()


def ids(n: int = 4, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("converted", [False, True], ids=["checkpoint", "conversion"])
@pytest.mark.parametrize("name", ["gpt2", "gpt_neox"])
def test_streamed_compression_equals_in_memory(name, converted, tmp_path):
    """From the family's checkpoint (converted layer by layer as it is read) or from its relational conversion on disk,
    the streamed compression plans the same widths as the in-memory `compress_model`, stores the same count (the
    report's, the saved checkpoint's, at most the budget), computes the same logits to float tolerance and the same
    calibration perplexities; the result loads with AutoModelForCausalLM; GPT-2's tied head stays tied, GPT-NeoX's
    untied one untied; the QK forms are reported as kept at full width."""
    model = family(name)
    model = to_relational(model).eval() if converted else model
    model.save_pretrained(tmp_path / "src")
    calibration = ids()
    ref, ref_report = compress_model(model, remove=0.2, calibration=calibration, progress=False, eval_windows=2, **OPTIONS)
    out = tmp_path / "out"
    report = compress_checkpoint(
        tmp_path / "src", out, remove=0.2, calibration=calibration, progress=False, eval_windows=2, **OPTIONS
    )
    assert report["widths"] == ref_report["widths"]
    assert report["parameters_before"] == ref_report["parameters_before"]
    assert report["parameters_after"] == ref_report["parameters_after"] <= report["parameters_budget"]
    assert report["qk_kept_full"] == ref_report["qk_kept_full"] and len(report["qk_kept_full"]) == L
    for key in ("calibration_perplexity_before", "calibration_perplexity_after"):
        assert report[key] == pytest.approx(ref_report[key], rel=1e-4)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert stored(loaded) == stored_parameters(loaded)["total"] == report["parameters_after"]
    assert json.loads((out / "compression_report.json").read_text())["parameters_after"] == report["parameters_after"]
    tied = name == "gpt2"
    assert loaded.config.tie_word_embeddings == tied
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    probe = ids(2, 12, seed=7)
    with torch.no_grad():
        expected, got = ref(probe).logits, loaded(probe).logits
    assert float((got - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("name", ["gpt2", "gpt2_untied", "gpt_neox"])
@torch.no_grad()
def test_the_layer_sources_ends_are_the_conversions(name, tmp_path):
    """The layer source of the family's checkpoint embeds (positions added, input centred: by the model with a tied
    head, in storage with an untied one) and reads out (final LayerNorm's gain and bias, tied or folded head) as the
    in-memory conversion does, and writes the same tensors
    outside the layers; the streamed perplexity of either source (the checkpoint, its conversion on disk) is the
    source model's."""
    model = family(name)
    rel = to_relational(model).eval()
    model.save_pretrained(tmp_path / "src")
    rel.save_pretrained(tmp_path / "rel")
    window = ids(2, 12, seed=3)
    for source in (LlamaCheckpointLayers(tmp_path / "src"), RelationalCheckpointLayers(tmp_path / "rel")):
        h = source.embed(window)
        assert torch.allclose(h, embedded(rel, window), atol=1e-6)
        hidden = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(5))
        expected = rel.lm_head(rel.model.norm(hidden))
        assert torch.allclose(source.head()(hidden), expected, atol=1e-5 * float(expected.abs().max()))
        state = rel.state_dict()
        outside = {n: torch.cat([b.float() for b in blocks]) for n, _, blocks in source.static_tensors()}
        assert set(outside) == {n for n in state if not n.startswith("model.layers.")} - (
            {"lm_head.weight"} if rel.config.tie_word_embeddings else set()
        )
        for n, t in outside.items():
            assert torch.allclose(t, state[n].float(), atol=1e-6), n
        assert streamed_perplexity(source, window) == pytest.approx(perplexity(model, window), rel=1e-5)


def test_compress_streams_a_gpt2_checkpoint_and_refuses_a_window_beyond_its_positions(tmp_path, capsys):
    """`compress --stream` of a GPT-2 checkpoint runs one layer at a time (the report says so) and stores what it
    reports; a window longer than the learned position table is refused in one line naming the table before any
    work, and OUT is not written: streamed or in memory, with the user's text alone or with a sampled share (which
    the whole model would generate first)."""
    src = save(family("gpt2"), tmp_path / "src")
    argv = ["compress", src, tmp_path / "out", "--remove", 0.1, "--calibration", text_file(tmp_path)]
    run([*argv, "--window", 16, "--calibration-windows", 4, "--eval-windows", 2, "--stream"], capsys)
    report = json.loads((tmp_path / "out" / "compression_report.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert report["streamed"] and report["parameters_after"] == stored(loaded) < report["parameters_before"]
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    argv = ["compress", src, tmp_path / "long", "--remove", 0.1, "--calibration", text_file(tmp_path)]
    for extra in (["--self-calibration", 0, "--stream"], [], ["--no-stream"], ["--heal-steps", 1, "--heal-length", P + 1]):
        window = P if "--heal-length" in extra else P + 8
        _, err = run([*argv, "--window", window, "--calibration-windows", 2, *extra], capsys, code=2)
        assert "position table" in error_line(err) and not (tmp_path / "long").exists(), extra
