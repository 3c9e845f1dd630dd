"""Relational conversions of Qwen3 (per-head QK-norm with per-dimension gains) and SmolLM3 (every 4th layer without
rotary positions) exported to GGUF as llama.cpp's `qwen3` and `smollm3` architectures
(`relational_hf.convert.gguf_families`).

Tiny checkpoints of Transformers' own Qwen3 and SmolLM3 classes with random norm gains (the QK-norm's included), converted
by the project's `to_relational`, exported f32: the file holds the right architecture, tensors and gains; a reference
forward pass from the file alone (llama.cpp's conventions, tests/gguf_helpers.py) and llama.cpp itself (its Python
binding, through `relational_hf.convert.gguf_runtime`) give the plugin's logits to 1e-4 of the logit scale and its
greedy tokens, also with per-layer QK and value widths (zero-padded), through the commands (`convert`, then `export
--to gguf` streamed) as from memory, and llama.cpp's quantiser takes the files. What the two architectures cannot hold (a
compressed conversion's per-layer SwiGLU widths, another no-rope pattern, QK-norm below the head width, ...) is refused
in one line naming the config field, before any file is written. The llama.cpp checks skip, naming the `gguf` extra,
where llama.cpp cannot be imported."""

from __future__ import annotations

import pytest
import torch
from family_helpers import TINY, randomize
from gguf_helpers import (
    BASE,
    VOCAB,
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
    spread,
)

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install 'relational-hf[real]'")

from relational_hf.commands.main import main  # noqa: E402
from relational_hf.convert import gguf_runtime  # noqa: E402
from relational_hf.convert.gguf_layout import rope_interleave  # noqa: E402
from relational_hf.modeling import RelationalConfig, RelationalForCausalLM  # noqa: E402

PROMPT = [1, 40, 7, 200, 13, 13, 90, 250, 3, 64, 128, 5]
IDS = torch.tensor(PROMPT)
NEW_TOKENS = 8
DH = 8  # head width of the tiny sources
#: SmolLM3 with 4 layers: layer 3 attends without rotary positions (Transformers' no_rope_layer_interval = 4)
SMOLLM3_ROPE = [True, True, True, False]
CALIBRATION = torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))


def _qwen3_source():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**(TINY | dict(head_dim=DH, tie_word_embeddings=False)))
    return randomize(Qwen3ForCausalLM(config), seed=1, weights=6.0)


def _smollm3_source():
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(0)
    config = SmolLM3Config(**(TINY | dict(num_hidden_layers=4, tie_word_embeddings=True)))
    model = randomize(SmolLM3ForCausalLM(config), seed=2, weights=6.0)
    with torch.no_grad():  # a smaller tied embedding: the layers, not the token itself, decide the next token
        model.model.embed_tokens.weight.mul_(0.5)
    return model


@pytest.fixture(scope="module")
def sources():
    """family -> (Transformers source, its relational conversion)."""
    from relational_hf.convert import to_relational

    out = {}
    for family, build in (("qwen3", _qwen3_source), ("smollm3", _smollm3_source)):
        source = build()
        out[family] = (source, to_relational(source, verify_length=16).eval())
    return out


@torch.no_grad()
def _tiny(overrides: dict, seed: int = 3) -> RelationalForCausalLM:
    """A hand-made relational model (gguf_helpers.BASE | overrides) with random weights, norm gains in [0.5, 1.5]
    (the QK-norm's included) and, in compressed layers, key heads keeping different rotary pairs."""
    torch.manual_seed(seed)
    model = spread(RelationalForCausalLM(RelationalConfig(**(BASE | overrides))).eval())
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        pairs = getattr(layer.self_attn, "rope_pair_index", None)
        if pairs is not None:
            for row in pairs:
                row.copy_(torch.randperm(model.config.qk_rank // 2, generator=generator)[: pairs.shape[1]])
    return model


#: hand-made compressed layouts the two architectures hold exactly (QK and value widths padded with zeros)
HAND_MADE = {
    "qwen3-value-widths": dict(qk_norm=True, layer_value_ranks=[8, 5], attention_bias=True),
    "smollm3-qk-and-value-widths": dict(
        num_hidden_layers=4, rope_layers=SMOLLM3_ROPE, layer_qk_ranks=[8, 4, 6, 4], layer_value_ranks=[8, 5, 3, 6]
    ),
}


_export = export_f32


def test_qwen3_conversion_becomes_qwen3_with_its_qk_norm_gains(sources, tmp_path):
    """Architecture `qwen3`; every layer's attn_q_norm / attn_k_norm are the relational QK-norm gains (random, not
    ones), the query/key rows are not reordered (NEOX rope, the relational layout); a reference forward pass from the
    file alone gives the plugin's logits, which are the Qwen3 source's."""
    source, model = sources["qwen3"]
    report = _export(model, tmp_path / "qwen3.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "qwen3.gguf"))
    meta, w = fields(reader), dequantized(reader)
    assert report.arch == meta["general.architecture"] == "qwen3"
    assert meta["qwen3.attention.key_length"] == meta["qwen3.rope.dimension_count"] == DH
    for i, layer in enumerate(model.model.layers):
        full = layer.self_attn.full_weights()
        for key in ("q_norm", "k_norm"):
            gain = full[key].double()
            assert not torch.allclose(gain, torch.ones_like(gain))
            assert torch.allclose(w[f"blk.{i}.attn_{key}.weight"], gain, atol=1e-6)
        assert torch.allclose(w[f"blk.{i}.attn_q.weight"], full["q"].double(), atol=1e-5)
        assert not torch.allclose(w[f"blk.{i}.attn_q.weight"], rope_interleave(full["q"], 4, DH).double(), atol=1e-3)
    reference = plugin_logits(model, IDS)
    assert relative_difference(plugin_logits(source, IDS), reference) < 1e-4
    assert relative_difference(reference_logits(tmp_path / "qwen3.gguf", IDS), reference) < 1e-4


def test_smollm3_conversion_becomes_smollm3_rotating_in_its_layers(sources, tmp_path):
    """Architecture `smollm3` for the conversion whose every 4th layer has no rotary positions: no QK-norm tensors,
    the query/key rows interleaved for llama.cpp's adjacent-pair rope, and the reference forward pass (no rotation
    in layer 3) gives the plugin's logits, which are the SmolLM3 source's."""
    source, model = sources["smollm3"]
    assert model.config.rope_layers == SMOLLM3_ROPE
    report = _export(model, tmp_path / "smollm3.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "smollm3.gguf"))
    meta, w = fields(reader), dequantized(reader)
    assert report.arch == meta["general.architecture"] == "smollm3"
    assert not any("norm" in n and "attn_q" in n for n in w)
    k = model.model.layers[0].self_attn.full_weights()["k"]
    assert torch.allclose(w["blk.0.attn_k.weight"], rope_interleave(k, 2, DH).double(), atol=1e-5)
    reference = plugin_logits(model, IDS)
    assert relative_difference(plugin_logits(source, IDS), reference) < 1e-4
    assert relative_difference(reference_logits(tmp_path / "smollm3.gguf", IDS), reference) < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_the_commands_convert_and_export_the_family_to_its_architecture(family, sources, tmp_path, capsys):
    """`relational-hf convert SRC REL` then `export REL OUT.gguf --to gguf --outtype f32` (REL read a decoder layer at
    a time): the report names the architecture, the file's reference forward pass gives the Transformers source's
    logits, and the same conversion exported from memory gives the same bytes."""
    from family_helpers import save

    from relational_hf.modeling import RelationalForCausalLM as Loaded

    source = sources[family][0]
    save(source, tmp_path / "src")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "rel")]) == 0
    out = tmp_path / "model.gguf"
    capsys.readouterr()
    assert main(["export", str(tmp_path / "rel"), str(out), "--to", "gguf", "--outtype", "f32"]) == 0
    assert f"Export to GGUF (`{family}`, f32)" in capsys.readouterr().out
    assert relative_difference(reference_logits(out, IDS), plugin_logits(source, IDS)) < 1e-4
    converted = Loaded.from_pretrained(tmp_path / "rel").eval()
    _export(converted, tmp_path / "memory.gguf", name="model")
    assert (tmp_path / "memory.gguf").read_bytes() == out.read_bytes()


@pytest.mark.parametrize("name", HAND_MADE)
def test_per_layer_qk_and_value_widths_are_padded_exactly(name, tmp_path):
    """QK widths below the head width (smollm3, key heads keeping their own rotary pairs) and value widths below it
    (both) are zero rows of the padded heads: the file's reference forward pass gives the plugin's logits."""
    model = _tiny(HAND_MADE[name])
    report = _export(model, tmp_path / "m.gguf")
    assert report.arch == name.split("-")[0] and report.padding_zeros > 0
    assert relative_difference(reference_logits(tmp_path / "m.gguf", IDS), plugin_logits(model, IDS)) < 1e-4


def _llama_cpp_matches(model, path):
    return assert_llama_cpp_agrees(model, path, IDS, NEW_TOKENS, 1e-4)[2]


@needs_llama_cpp
@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_llama_cpp_gives_the_converted_familys_logits_and_greedy_tokens(family, sources, tmp_path):
    """llama.cpp runs the exported conversion (its own qwen3 / smollm3 graph) with the plugin's logits (all
    positions, f32 cache) and greedy continuation (a token at a time with its cache)."""
    _, model = sources[family]
    _export(model, tmp_path / f"{family}.gguf")
    _llama_cpp_matches(model, tmp_path / f"{family}.gguf")


@needs_llama_cpp
@pytest.mark.parametrize("name", HAND_MADE)
def test_llama_cpp_runs_the_padded_widths_exactly(name, tmp_path):
    model = _tiny(HAND_MADE[name])
    _export(model, tmp_path / "m.gguf")
    _llama_cpp_matches(model, tmp_path / "m.gguf")


@needs_llama_cpp
@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_llama_cpp_quantises_the_family_and_still_predicts_like_the_plugin(family, sources, tmp_path):
    """llama.cpp's own quantiser (Q8_0) takes the exported qwen3 / smollm3 file (the QK-norm gains stay f32) and the
    quantised model still predicts like the plugin: within 1e-1 of the logit scale (measured 4e-2 and 6e-2: these
    tiny models' weights are six times their initial scale; the same file with unit QK-norm gains is 0.38 off)."""
    _, model = sources[family]
    src = tmp_path / "f32.gguf"
    _export(model, src)
    gguf_runtime.quantize(src, tmp_path / "q8.gguf", "Q8_0")
    assert (tmp_path / "q8.gguf").stat().st_size < src.stat().st_size
    with gguf_runtime.LlamaCpp(tmp_path / "q8.gguf", n_ctx=64) as llm:
        logits = torch.from_numpy(llm.logits(PROMPT)).double()
    assert relative_difference(logits, plugin_logits(model, IDS)) < 1e-1


def _compressed(model, remove: float = 0.2, **options):
    from relational_hf.jobs import compress_model

    out, _ = compress_model(
        model, remove=remove, calibration=CALIBRATION, progress=False, plan_windows=2, mlp_step=8, **options
    )
    return out.eval()


@needs_llama_cpp
def test_a_compressed_qwen3_conversion_with_one_swiglu_width_runs_in_llama_cpp(sources, tmp_path):
    """`compress` of the Qwen3 conversion keeping the SwiGLU whole (value widths cut per layer, the QK pair kept
    whole under its norm): `qwen3` holds it exactly, values padded with zeros, in llama.cpp as in the plugin."""
    compressed = _compressed(sources["qwen3"][1], kinds=("qk", "vo"), remove=0.05)
    c = compressed.config
    assert c.layer_value_ranks is not None and min(c.layer_value_ranks) < DH
    assert c.qk_norm and len({c.layer_intermediate_size(i) for i in range(c.num_hidden_layers)}) == 1
    report = _export(compressed, tmp_path / "c.gguf")
    assert report.arch == "qwen3" and report.padding_zeros > 0
    _llama_cpp_matches(compressed, tmp_path / "c.gguf")


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_a_compressed_conversion_with_per_layer_swiglu_widths_is_refused_in_one_line(family, sources, tmp_path, capsys):
    """llama.cpp's qwen3 and smollm3 make every layer's SwiGLU one width: a compressed conversion whose layers keep
    different widths is refused naming layer_intermediate_sizes, by the function and the command, before any file is
    written (no zero units added silently); with --pad-mlp the command writes it at the widest width, exactly."""
    import copy

    model = copy.deepcopy(sources[family][1])
    with torch.no_grad():  # one layer's MLP made heavier, so that the plan keeps different widths
        model.model.layers[1].mlp.down_proj.weight.mul_(8)
    compressed = _compressed(model)
    widths = compressed.config.layer_intermediate_sizes
    assert widths is not None and len(set(widths)) > 1
    assert_refused_in_one_line(compressed, "layer_intermediate_sizes", tmp_path, capsys, also=family)
    # asked for, the narrower layers are padded with zero units: exact, from the file alone and in llama.cpp
    path, written = export_padded_from_the_command(compressed, IDS, tmp_path, capsys)
    assert written == max(widths)
    if gguf_runtime.available():
        _llama_cpp_matches(compressed, path)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(qk_norm=True, qk_rank=4), "qk_rank"),  # a QK-norm over a head padded with zeros: another RMS
        (dict(num_hidden_layers=4, rope_layers=[True, False, True, True]), "rope_layers"),  # not every 4th layer
        (dict(rope_layers=[True, False]), "rope_layers"),
        (dict(num_hidden_layers=4, qk_norm=True, rope_layers=SMOLLM3_ROPE), "qk_norm"),
        (dict(qk_norm=True, attention_bias=True, attention_output_bias=True), "attention_output_bias"),
        (dict(num_hidden_layers=4, rope_layers=SMOLLM3_ROPE, attention_output_bias=True), "attention_output_bias"),
        (dict(qk_norm=True, layer_intermediate_sizes=[40, 24]), "layer_intermediate_sizes"),
    ],
)
def test_what_qwen3_and_smollm3_cannot_hold_is_refused_in_one_line(overrides, field, tmp_path, capsys):
    assert_refused_in_one_line(RelationalForCausalLM(RelationalConfig(**(BASE | overrides))).eval(), field, tmp_path, capsys)
