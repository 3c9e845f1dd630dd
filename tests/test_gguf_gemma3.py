"""Relational conversions of Gemma 3 (text) exported to GGUF as llama.cpp's `gemma3` architecture
(`relational_hf.convert.gguf_families`).

The tiny Gemma 3 of tests/gemma3_models.py (Transformers' own Gemma3TextConfig and Gemma3ForCausalLM, no download:
random norm gains, one sliding-window layer of window 4 and one full layer), converted by the project's convert,
exported f32, on contexts of 24 tokens, longer than the window: the file holds Gemma's (1 + w) gains as llama.cpp's
converter writes them, the sliding-window metadata and both rotary bases; a reference forward pass from the file
alone (llama.cpp's gemma3 graph, tests/gguf_helpers.py) gives the plugin's logits (and the Transformers source's) to
1e-4 of the logit scale; llama.cpp itself (its Python binding, `relational_hf.convert.gguf_runtime`) gives the
plugin's greedy tokens and its logits up to llama.cpp's own GELU, which its CPU backend looks up in a table of f16
inputs and outputs (`GGML_GELU_FP16`): about 3e-4 of the logit scale here, and the same reference with that table
accounts for it. Also through the commands (convert, then export streamed), with a linear rotary scaling on the full
layers (Gemma 3 4B and up), at 62 layers (where llama.cpp scales queries by 1/sqrt(n_embd / n_head)), and a compressed
conversion with value widths padded with zeros. What gemma3 cannot hold is refused in one line naming the config field,
before any file is written. The llama.cpp checks skip, naming the `gguf` extra, where llama.cpp cannot be imported."""

from __future__ import annotations

import math

import pytest
import torch
from gemma3_models import convertible, longer_than_the_window
from gguf_helpers import (
    BASE,
    assert_llama_cpp_agrees,
    assert_refused_in_one_line,
    dequantized,
    export_f32,
    export_padded_from_the_command,
    fields,
    needs_llama_cpp,
    plugin_logits,
    reference_logits,
    relative_difference,
)

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install 'relational-hf[real]'")

from relational_hf.commands.main import main  # noqa: E402
from relational_hf.convert import gguf_runtime  # noqa: E402
from relational_hf.modeling import RelationalConfig, RelationalForCausalLM  # noqa: E402

#: 24 tokens: six times the sliding window of 4
IDS = longer_than_the_window(batch=1, length=24)[0]
PROMPT = IDS.tolist()
NEW_TOKENS = 8
#: llama.cpp's f16 GELU table against the exact f32 GELU (module docstring): measured 3.0e-4 (2 layers), 3.6e-3 (62)
GELU_F16_TOLERANCE = 1e-3
LINEAR_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},  # not llama.cpp's default
}
#: 62 layers (llama.cpp's "27B" rule) with head width 16 = twice n_embd / n_head, five sliding layers to a full one
LAYERS_62 = dict(
    num_hidden_layers=62,
    head_dim=16,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10 + ["sliding_attention", "full_attention"],
)


def _source(**overrides):
    """The tiny Gemma 3 (seed 1) with a smaller tied embedding: the layers, not the token itself, decide the next
    token, so greedy continuations differ from step to step."""
    model = convertible(seed=1, **overrides)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.2)
    return model


@pytest.fixture(scope="module")
def pair():
    """(the Transformers Gemma 3, its relational conversion)."""
    from relational_hf.convert import to_relational

    source = _source()
    return source, to_relational(source, verify_length=16).eval()


_export = export_f32


def test_the_conversion_becomes_gemma3_with_gemmas_gains_and_windows(pair, tmp_path):
    """Architecture `gemma3`: every norm weight is Gemma's 1 + w (the sandwich norms', the QK-norms' (the query's times
    the conversion's sqrt(head_dim / query_pre_attn_scalar)) and the final one, as llama.cpp's converter adds 1), the
    pre-norms unit weights (their gains folded), query/key rows not reordered (NEOX rope); the sliding window, the
    per-layer pattern and both rotary bases in the metadata; no soft-capping key."""
    source, model = pair
    report = _export(model, tmp_path / "g.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "g.gguf"))
    meta, w = fields(reader), dequantized(reader)
    assert report.arch == meta["general.architecture"] == "gemma3"
    assert meta["gemma3.attention.sliding_window"] == 4
    assert meta["gemma3.attention.sliding_window_pattern"] == [True, False]
    assert meta["gemma3.rope.freq_base"] == 1e6 and meta["gemma3.rope.freq_base_swa"] == 1e4
    assert meta["gemma3.attention.key_length"] == meta["gemma3.rope.dimension_count"] == 8
    assert "gemma3.final_logit_softcapping" not in meta and "gemma3.rope.scaling.type" not in meta
    q_factor = math.sqrt(8 / source.config.query_pre_attn_scalar)
    for i, (src, layer) in enumerate(zip(source.model.layers, model.model.layers, strict=True)):
        b = f"blk.{i}."
        for name, norm, factor in (
            ("post_attention_norm", src.post_attention_layernorm, 1.0),
            ("post_ffw_norm", src.post_feedforward_layernorm, 1.0),
            ("attn_q_norm", src.self_attn.q_norm, q_factor),
            ("attn_k_norm", src.self_attn.k_norm, 1.0),
        ):
            gemma = (1.0 + norm.weight.double()) * factor
            assert not torch.allclose(gemma, torch.ones_like(gemma))
            assert torch.allclose(w[b + name + ".weight"], gemma, atol=1e-6), name
        assert torch.equal(w[b + "attn_norm.weight"], torch.ones(32, dtype=torch.float64))
        assert torch.equal(w[b + "ffn_norm.weight"], torch.ones(32, dtype=torch.float64))
        assert torch.allclose(w[b + "attn_k.weight"], layer.self_attn.full_weights()["k"].double(), atol=1e-5)
    assert torch.allclose(w["output_norm.weight"], 1.0 + source.model.norm.weight.double(), atol=1e-6)
    assert "output.weight" not in w  # tied


def test_the_files_forward_pass_gives_the_plugins_and_the_sources_logits(pair, tmp_path):
    """The reference forward pass from the file alone (llama.cpp's gemma3 conventions, exact GELU) gives the plugin's
    logits, which are the Transformers source's, at all 24 positions (past the window of 4)."""
    source, model = pair
    _export(model, tmp_path / "g.gguf")
    reference = plugin_logits(model, IDS)
    assert relative_difference(plugin_logits(source, IDS), reference) < 1e-4
    assert relative_difference(reference_logits(tmp_path / "g.gguf", IDS), reference) < 1e-4


def test_the_commands_convert_and_export_gemma3(gemma3_source, gemma3_converted, tmp_path, capsys):
    """`relational-hf convert` (the conftest's Gemma 3 conversion) then `export REL OUT.gguf --to gguf --outtype f32`
    (REL read a decoder layer at a time): the report names gemma3, the file's forward pass gives the Transformers
    source's logits past the window, and the same conversion exported from memory gives the same bytes."""
    out = tmp_path / "model.gguf"
    capsys.readouterr()
    assert main(["export", str(gemma3_converted), str(out), "--to", "gguf", "--outtype", "f32"]) == 0
    assert "Export to GGUF (`gemma3`, f32)" in capsys.readouterr().out
    assert relative_difference(reference_logits(out, IDS), plugin_logits(gemma3_source, IDS)) < 1e-4
    converted = RelationalForCausalLM.from_pretrained(gemma3_converted).eval()
    _export(converted, tmp_path / "memory.gguf", name="model")
    assert (tmp_path / "memory.gguf").read_bytes() == out.read_bytes()


def _llama_cpp_matches(model, path, tolerance=GELU_F16_TOLERANCE):
    """llama.cpp's logits of PROMPT (f32 cache) against the plugin's, and its greedy tokens (a token at a time with
    its sliding-window cache); the difference of the logits, the same with the file's reference forward pass that
    computes the GELU through llama.cpp's f16 table."""
    logits, greedy, difference = assert_llama_cpp_agrees(model, path, IDS, NEW_TOKENS, tolerance)
    assert len(set(greedy)) > 1  # a continuation that depends on the context
    return logits, difference


@needs_llama_cpp
def test_llama_cpp_gives_the_plugins_greedy_tokens_and_logits_up_to_its_f16_gelu(pair, tmp_path):
    """llama.cpp runs the exported conversion with the plugin's greedy tokens and its logits within its f16 GELU
    table's rounding (measured 3.0e-4 of the logit scale). The file's reference forward pass with that table gives
    llama.cpp's logits at the first position to 1e-5 (measured 2.7e-7), the exact one only to 2.7e-4: the GELU table
    is the difference. (Later positions mix in gate values that sit on an f16 rounding boundary, where llama.cpp's
    f32 sums and the reference's round to neighbouring table entries: about 1e-5 to 3e-4 there.)"""
    _, model = pair
    path = tmp_path / "g.gguf"
    _export(model, path)
    logits, _ = _llama_cpp_matches(model, path)
    scale = plugin_logits(model, IDS).abs().max()
    table = (reference_logits(path, IDS, gelu_f16=True) - logits).abs().max(-1).values / scale
    exact = (reference_logits(path, IDS) - logits).abs().max(-1).values / scale
    assert float(table[0]) < 1e-5 < float(exact[0])


@needs_llama_cpp
@pytest.mark.parametrize("case", ["linear-rope", "62-layers"])
def test_llama_cpp_runs_the_linear_rope_and_the_62_layer_scale_exactly(case, tmp_path):
    """A linear rotary scaling (factor 8) on the full layers, the sliding ones unscaled at base 2e4 (not llama.cpp's
    default 1e4): `rope.scaling.*` and `rope.freq_base_swa` written, and llama.cpp turns each kind of layer as the
    plugin does. 62 layers (llama.cpp's "27B" scale 1/sqrt(n_embd / n_head) = 1/sqrt(8) against the relational
    1/sqrt(16)): the query-norm gains carry sqrt(8 / 16) and llama.cpp gives the plugin's logits (measured 3.6e-3 of
    the scale: 62 layers of f16 GELU) and greedy tokens."""
    from relational_hf.convert import to_relational

    overrides = dict(rope_parameters=LINEAR_ROPE) if case == "linear-rope" else LAYERS_62
    model = to_relational(_source(**overrides), verify_length=16).eval()
    _export(model, tmp_path / "g.gguf")
    meta = fields(gguf.GGUFReader(str(tmp_path / "g.gguf")))
    assert relative_difference(reference_logits(tmp_path / "g.gguf", IDS), plugin_logits(model, IDS)) < 1e-4
    if case == "linear-rope":
        assert meta["gemma3.rope.scaling.type"] == "linear" and meta["gemma3.rope.scaling.factor"] == 8.0
        assert meta["gemma3.rope.freq_base_swa"] == 2e4
        _llama_cpp_matches(model, tmp_path / "g.gguf")
    else:
        w = dequantized(gguf.GGUFReader(str(tmp_path / "g.gguf")))
        gain = model.model.layers[0].self_attn.full_weights()["q_norm"].double()
        assert torch.allclose(w["blk.0.attn_q_norm.weight"], gain * math.sqrt(0.5), atol=1e-6)
        _llama_cpp_matches(model, tmp_path / "g.gguf", tolerance=1e-2)


def _compressed(model, **options):
    from relational_hf.jobs import compress_model

    calibration = longer_than_the_window(batch=4, length=16, seed=3)
    small = dict(plan_windows=2, mlp_step=8, min_mlp_units=8, vo_step=2, min_vo_rank=2)  # grids for d_ff 64, width 8
    out, _ = compress_model(model, calibration=calibration, progress=False, **(small | options))
    return out.eval()


@needs_llama_cpp
def test_a_compressed_conversion_with_one_mlp_width_runs_in_llama_cpp(pair, tmp_path):
    """`compress` of the conversion cutting value widths only (the QK pair kept whole under its norm, the MLP whole):
    gemma3 holds it exactly, values padded with zeros, in llama.cpp as in the plugin."""
    compressed = _compressed(pair[1], kinds=("vo",), remove=0.02)
    c = compressed.config
    assert c.layer_value_ranks is not None and min(c.layer_value_ranks) < c.head_dim
    report = _export(compressed, tmp_path / "c.gguf")
    assert report.arch == "gemma3" and report.padding_zeros > 0
    assert relative_difference(reference_logits(tmp_path / "c.gguf", IDS), plugin_logits(compressed, IDS)) < 1e-4
    _llama_cpp_matches(compressed, tmp_path / "c.gguf")


def test_a_compressed_conversion_with_per_layer_mlp_widths_is_refused_in_one_line(pair, tmp_path, capsys):
    """llama.cpp's gemma3 makes every layer's gated MLP one width: a compressed conversion whose layers keep different
    widths is refused naming layer_intermediate_sizes, by the function and the command, before any file is written;
    with --pad-mlp the command writes it at the widest width, exactly."""
    import copy

    model = copy.deepcopy(pair[1])
    with torch.no_grad():  # one layer's MLP made lighter (its sandwich norm's gain), so that the widths differ
        model.model.layers[0].mlp_output_norm.weight.mul_(0.1)
    compressed = _compressed(model, kinds=("mlp",), remove=0.1)
    widths = compressed.config.layer_intermediate_sizes
    assert widths is not None and len(set(widths)) > 1
    assert_refused_in_one_line(compressed, "layer_intermediate_sizes", tmp_path, capsys, also="gemma3")
    # asked for, the narrower layers are padded with zero units (GELU-tanh(0) * 0 = 0): exact
    path, written = export_padded_from_the_command(compressed, IDS, tmp_path, capsys)
    assert written == max(widths)
    if gguf_runtime.available():
        _llama_cpp_matches(compressed, path)


#: a linear rotary table: held on the full layers only
LINEAR_FULL = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
#: a hand-made relational model with Gemma 3's options, which gemma3 holds
GEMMA = BASE | dict(
    qk_norm=True,
    sandwich_norms=True,
    embedding_scale=32**0.5,
    hidden_act="gelu_pytorch_tanh",
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=4,
    sliding_rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def test_a_hand_made_model_with_gemmas_options_and_no_sliding_layer_is_gemma3_without_a_window(tmp_path):
    """Without sliding layers (`layer_types` all full) no window key is written (llama.cpp attends to everything)."""
    model = RelationalForCausalLM(RelationalConfig(**(GEMMA | dict(layer_types=None, sliding_window=None,
                                                                   sliding_rope_parameters=None)))).eval()  # fmt: skip
    assert _export(model, tmp_path / "g.gguf").arch == "gemma3"
    meta = fields(gguf.GGUFReader(str(tmp_path / "g.gguf")))
    assert "gemma3.attention.sliding_window" not in meta and "gemma3.attention.sliding_window_pattern" not in meta


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(embedding_scale=4.0), "embedding_scale"),  # llama.cpp scales by sqrt(n_embd) itself
        (dict(sandwich_norms=False), "sandwich_norms"),  # post_attention_norm / post_ffw_norm are required
        (dict(qk_norm=False), "qk_norm"),  # attn_q_norm / attn_k_norm are required
        (dict(hidden_act="gelu"), "hidden_act"),  # the erf GELU: gemma3 computes the tanh one
        (dict(qk_rank=4), "qk_rank"),  # a QK-norm over a head padded with zeros: another RMS
        (dict(rope_layers=[True, False]), "rope_layers"),  # gemma3 rotates every layer
        (dict(layer_intermediate_sizes=[40, 24]), "layer_intermediate_sizes"),
        (dict(attention_bias=True, attention_output_bias=True), "attention_output_bias"),
        (dict(sliding_rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "sliding_rope"),
        (dict(rope_parameters=LINEAR_FULL, sliding_rope_parameters=None), "rope_parameters"),  # sliding layers too
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}), "rope_parameters"),
        (dict(embedding_centring=True), "embedding_centring"),
    ],
)
def test_what_gemma3_cannot_hold_is_refused_in_one_line(overrides, field, tmp_path, capsys):
    """Each option llama.cpp's gemma3 has no exact form for is refused naming its config field, by the function and
    by the command (one line on stderr), before any file is written."""
    assert_refused_in_one_line(RelationalForCausalLM(RelationalConfig(**(GEMMA | overrides))).eval(), field, tmp_path, capsys)
