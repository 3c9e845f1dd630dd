"""GPT-2 through convert, on a tiny checkpoint of Transformers' own GPT2LMHeadModel (no download) with random
LayerNorm gains and biases and random biases on every linear map (gains at one and biases at zero would hide folding
mistakes).

GPT-2 has LayerNorms (centring, gain, bias), learned absolute positions, a fused Conv1D q/k/v stored (in, out), a
plain tanh-GELU MLP with biases and a head tied to the token embedding. The conversion (`relational_hf.convert.
layernorm`) makes every write into the residual stream mean-free (output maps and biases multiplied by the centring
projector C; the embedded input centred by the relational model itself, `embedding_centring`, since the tied embedding
is also the head), so each LayerNorm is a gain-free RMS norm whose gain and bias fold into its readers (W diag(g),
b + W beta); the final norm keeps its gain and bias (`final_norm_bias`) in front of the tied head. QK and VO go to the
pivot gauge (a block pivot per head: no rotary positions); the plain MLP has no gauge."""

from __future__ import annotations

import json
import math

import pytest
import torch
from family_helpers import (
    VOCAB,
    assert_canonicalize,
    assert_compress,
    assert_finetune,
    assert_remote_code_load,
    convert_both_ways,
    error_line,
    load,
    perplexity_of,
    relative_logit_difference,
    run,
    save,
    stored,
    text_file,
    token_ids,
)
from transformers import GPT2Config, GPT2LMHeadModel

from relational_hf.convert import to_relational

D, L, H, DH, F, P = 32, 3, 4, 8, 48, 64


@torch.no_grad()
def gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """d = 32, 3 layers, 4 heads of width 8, MLP 48, tied head. LayerNorm gains 1 + 0.3 N(0, 1), every bias (the
    LayerNorms', c_attn's, both c_proj's, c_fc's) 0.3 N(0, 1), weights at 20 x GPT-2's initial scale (logits of a few
    units)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=D, n_layer=L, n_head=H, n_inner=F, n_positions=P,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        noise = 0.3 * torch.randn(p.shape, generator=generator)
        if p.ndim == 1:
            p.copy_(1 + noise if ".ln_" in f".{name}" and name.endswith("weight") else noise)
        else:
            p.mul_(20.0)
    return model.float().eval()


@pytest.fixture(scope="module")
def source():
    return gpt2()


@pytest.fixture(scope="module")
def checkpoint(source, tmp_path_factory):
    return save(source, tmp_path_factory.mktemp("gpt2") / "src")


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    from relational_hf.commands.main import main

    out = tmp_path_factory.mktemp("gpt2_rel") / "relational"
    assert main(["convert", str(checkpoint), str(out)]) == 0
    return out


def test_the_test_model_has_random_norms_biases_and_logits_of_a_few_units(source):
    """The properties below would not catch a folding mistake on gains at 1, biases at 0 or near-zero logits."""
    block = source.transformer.h[0]
    for t in (
        block.ln_1.weight,
        block.ln_1.bias,
        block.attn.c_attn.bias,
        block.mlp.c_fc.bias,
        source.transformer.ln_f.bias,
    ):
        assert float(t.detach().std()) > 0.1
    assert 1.0 < float(source(token_ids()).logits.detach().abs().max()) < 100.0


# ---- conversion ---------------------------------------------------------------------------------------------------


def test_convert_is_exact_streamed_and_in_memory(source, checkpoint, tmp_path, capsys):
    """Logits within 1e-4 of the logit scale both ways; the stored count drops by exactly the four LayerNorm vectors
    of each layer (2 gains, 2 biases: folded) and the QK and VO gauges (d_h^2 per head each: block pivots)."""
    folder, report = convert_both_ways(source, checkpoint, tmp_path, capsys)
    model = load(folder)
    c = model.config
    assert (c.position_encoding, c.mlp_gated, c.mlp_bias, c.hidden_act) == ("learned", False, True, "gelu_new")
    assert c.embedding_centring and c.final_norm_gain and c.final_norm_bias and c.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report["removed_orbit_dimensions"] == {"qk_gauge": L * H * DH * DH, "vo_gauge": L * H * DH * DH}
    assert stored(model) == stored(source) - 4 * L * D - 2 * L * H * DH * DH
    for group in ("norm_gain", "layernorm_bias_shift", "centring_translation", "reader_centring_translation"):
        assert group not in report["remaining_symmetries"]  # folded away with the LayerNorms
    # the tied embedding is the source's (the model centres the embedded input itself), positions kept as they are
    assert torch.equal(model.model.embed_tokens.weight, source.transformer.wte.weight)
    assert torch.equal(model.model.embed_positions.weight, source.transformer.wpe.weight)


def test_every_write_into_the_stream_is_mean_free(converted):
    """What makes the LayerNorms RMS norms: the embedded input (centred by the model), every output map and bias."""
    model = load(converted)
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda _, args: seen.append(args[0])) for layer in model.model.layers]
    with torch.no_grad():
        model(token_ids())
    for h in hooks:
        h.remove()
    assert all(float(x.mean(-1).abs().max()) < 1e-5 * float(x.abs().max()) for x in seen)
    for layer in model.model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert float(lin.weight.sum(0).abs().max()) < 1e-5 and abs(float(lin.bias.sum())) < 1e-5


def test_untied_head_converts_with_a_centred_embedding_and_no_input_centring():
    source = gpt2(seed=4, tie_word_embeddings=False)
    model, report = to_relational(source, return_report=True)
    assert not model.config.embedding_centring and not model.config.tie_word_embeddings
    assert relative_logit_difference(source, model, token_ids()) < 1e-4
    assert float(model.model.embed_tokens.weight.mean(-1).abs().max()) < 1e-6
    assert stored(model) == report.relational_parameters == report.expected_parameters


@pytest.mark.parametrize(
    "variant",
    [dict(scale_attn_weights=False), dict(scale_attn_by_inverse_layer_idx=True), dict(reorder_and_upcast_attn=True)],
    ids=["unscaled_attention", "scale_by_inverse_layer", "reorder_and_upcast"],
)
def test_attention_scale_variants_convert_exactly(variant):
    """The source's attention scale becomes a factor on W_Q and b_Q; reordering and upcasting the eager kernel's
    products is the same function. Each variant changes the source's logits, and the conversion follows."""
    source, plain = gpt2(seed=2, attn_implementation="eager", **variant), gpt2(seed=2, attn_implementation="eager")
    if "reorder_and_upcast_attn" not in variant:
        assert relative_logit_difference(plain, source, token_ids()) > 1e-3
    model = to_relational(source)
    assert relative_logit_difference(source, model, token_ids()) < 1e-4


def test_converted_checkpoint_loads_with_remote_code_alone(source, converted, tmp_path):
    code = {p.name for p in converted.glob("*.py")}
    assert {"modeling_blocks.py", "modeling_rotary.py"} <= code
    assert_remote_code_load(converted, tmp_path, source, token_ids(length=12))


def test_converted_model_generates_the_sources_greedy_tokens(source, converted):
    model = load(converted)
    prompt = token_ids(batch=2, length=5, seed=4)
    ours = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    theirs = source.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_converted_model_keeps_its_symmetries_and_canonical_form(source, checkpoint, converted, tmp_path, capsys):
    """With the input centred, residual rotations must fix the all-ones direction: a random element of every group
    counted on the converted model keeps its logits, and `canonicalize` keeps the function."""
    import copy

    from relational_hf.symmetry import apply_random_symmetry, redundancy_report

    model = gpt2(seed=5)
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(1.25)  # one final gain value: the residual rotation survives
    relational = to_relational(model)
    assert redundancy_report(relational, descriptors=False).by_group["residual_rotation"] == (D - 1) * (D - 2) // 2
    moved = apply_random_symmetry(copy.deepcopy(relational), torch.Generator().manual_seed(3), scale=0.5)
    assert relative_logit_difference(relational, moved, token_ids()) < 1e-5
    assert_canonicalize(converted, tmp_path, capsys, source, "canonical_relational")


def test_evaluate_gives_the_same_perplexity_before_and_after_conversion(checkpoint, converted, tmp_path, capsys):
    before, after = perplexity_of(checkpoint, tmp_path, capsys), perplexity_of(converted, tmp_path, capsys)
    assert after == pytest.approx(before, rel=1e-4)


def test_finetune_the_converted_model(converted, tmp_path, capsys):
    tuned = assert_finetune(converted, tmp_path, capsys, "tuned")
    assert not tuned.config.mlp_gated and tuned.config.embedding_centring


# ---- refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "named"),
    [(dict(add_cross_attention=True), "cross-attention"), (dict(activation_function="tanh"), "activation 'tanh'")],
)
def test_variants_without_a_relational_form_are_refused_in_one_line(variant, named, tmp_path, capsys):
    src = save(gpt2(**variant), tmp_path / "src")
    for extra in ((), ("--no-stream",)):
        _, err = run(["convert", src, tmp_path / "out", *extra], capsys, code=2)
        assert named in error_line(err)
        assert not (tmp_path / "out").exists()


def test_compress_gpt2_and_its_conversion_and_export_the_result_to_gpt2(checkpoint, converted, tmp_path, capsys):
    """`compress --remove 0.1` of the GPT-2 checkpoint and of its conversion (local folders: streamed, one layer at a
    time, by default; the same model as in memory: `tests/test_family_layernorm_stream.py`): the stored count is the
    report's and the closed form's (`assert_compress`) and at most 90% of the source's, the tied head stays tied, the
    perplexity is finite, the QK forms keep their width (no rotary pairs to remove: reported as `qk_kept_full`) while
    MLP units or VO ranks go, and every write into the stream stays mean-free, so the compressed model exports to
    GPT2LMHeadModel exactly (its narrower layers padded with zeros)."""
    for name, src in (("from_source", checkpoint), ("from_relational", converted)):
        model = assert_compress(src, tmp_path, capsys, name)
        report, c = model.compression_report, model.config
        assert report["parameters_after"] <= math.floor(0.9 * report["parameters_before"])
        assert math.isfinite(report["calibration_perplexity_after"])
        assert sorted(report["qk_kept_full"]) == [str(i) for i in range(L)]
        assert "learned positions" in report["qk_kept_full"]["0"] and c.layer_qk_ranks == [DH] * L
        assert sum(c.layer_intermediate_sizes) + sum(c.layer_value_ranks) < L * (F + DH)
        assert c.embedding_centring and c.final_norm_bias and c.position_encoding == "learned"
        for layer in model.model.layers:
            for w, b in ((p.weight.detach(), p.bias.detach()) for p in (layer.self_attn.o_proj, layer.mlp.down_proj)):
                assert float(w.sum(0).abs().max()) < 1e-5 * D * float(w.abs().max()) and abs(float(b.sum())) < 1e-4
    run(["export", tmp_path / "from_relational", tmp_path / "gpt2", "--to", "gpt2"], capsys)
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", dtype=torch.float32).eval()
    assert relative_logit_difference(load(tmp_path / "from_relational"), exported, token_ids()) < 1e-4
    assert json.loads((tmp_path / "gpt2" / "export_report.json").read_text())["padding_zeros"] > 0


def test_slicing_is_refused_in_one_line(source):
    from relational_hf.convert import ConversionError

    with pytest.raises(ConversionError, match="slicing GPT2LMHeadModel"):
        to_relational(source, slice_fraction=0.25, calibration_data=token_ids(batch=4, length=16))


def test_export_refuses_the_conversion_in_one_line(converted, tmp_path, capsys):
    _, err = run(["export", converted, tmp_path / "llama", "--to", "llama"], capsys, code=2)
    assert "position_encoding='learned'" in error_line(err)
    _, err = run(["export", converted, tmp_path / "gguf", "--to", "gguf"], capsys, code=2)
    assert "has no GGUF form" in error_line(err)


def test_new_options_are_validated_in_one_line():
    from relational_hf import RelationalConfig

    base = dict(vocab_size=16, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"`mlp_bias` needs mlp_gated=False"):
        RelationalConfig(**base, mlp_bias=True)
    with pytest.raises(ValueError, match="position_encoding"):
        RelationalConfig(**base, position_encoding="absolute")
    config = RelationalConfig(**base, mlp_gated=False, mlp_bias=True, position_encoding="learned")
    for field, bad in (("embedding_centring", "yes"), ("final_norm_bias", 1), ("mlp_gated", None)):
        with pytest.raises(ValueError, match=field):
            setattr(config, field, bad)
    json.dumps(config.to_dict())  # the options travel in config.json


# ---- export back to GPT-2 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_to_gpt2_gives_the_sources_logits_streamed_and_in_memory(tie, tmp_path, capsys):
    """convert (streamed and in memory) -> export --to gpt2 -> Transformers' own GPT2LMHeadModel: the source's logits
    (< 1e-4 of the logit scale) on random LayerNorm gains and biases, the same stored count as the source (the folded
    LayerNorms come back as unit gains and zero biases, the gauge coordinates are stored again), the head tied as the
    source's, and every layer's LayerNorm the identity's gain and bias."""
    source = gpt2(seed=6, tie_word_embeddings=tie)
    src = save(source, tmp_path / "src")
    for name, extra in (("streamed", ()), ("in_memory", ("--no-stream",))):
        run(["convert", src, tmp_path / name, *extra], capsys)
        out = tmp_path / f"{name}_gpt2"
        run(["export", tmp_path / name, out, "--to", "gpt2"], capsys)
        exported = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
        assert relative_logit_difference(source, exported, token_ids(batch=3, length=P)) < 1e-4
        assert stored(exported) == stored(source)
        assert (exported.lm_head.weight is exported.transformer.wte.weight) == tie
        for block in exported.transformer.h:
            for norm in (block.ln_1, block.ln_2):
                assert bool((norm.weight == 1).all()) and bool((norm.bias == 0).all())
        report = json.loads((out / "export_report.json").read_text())
        assert report["target"] == "gpt2" and report["padding_zeros"] == 0


def test_export_to_gpt2_refuses_what_gpt2_cannot_hold_in_one_line(converted, tmp_path, capsys):
    """Each refusal names the config field (or the tensor) and writes nothing: a conversion fine-tuned so that a write
    is no longer mean-free (a LayerNorm would remove what the RMS norm reads), a GPT-NeoX conversion (rotary positions,
    parallel residual), a Llama-family conversion (SwiGLU)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    from relational_hf.convert.export import ExportError
    from relational_hf.convert.export_families import to_family

    model = load(converted)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.bias.add_(0.5)
    with pytest.raises(ExportError, match=r"^--to gpt2: layers\.1\.mlp\.down_proj\.bias writes .* non-zero mean"):
        to_family(model, "gpt2")
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                            intermediate_size=F, rotary_pct=0.5))  # fmt: skip
    save(to_relational(neox.eval()), tmp_path / "neox")
    _, err = run(["export", tmp_path / "neox", tmp_path / "out", "--to", "gpt2"], capsys, code=2)
    assert "position_encoding='rope'" in error_line(err) and not (tmp_path / "out").exists()
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                         intermediate_size=F))  # fmt: skip
    with pytest.raises(ExportError, match=r"^--to gpt2: mlp_gated=True has no equivalent .*a SwiGLU MLP"):
        to_family(to_relational(llama.eval()), "gpt2")
    with pytest.raises(ExportError, match=r"^--to gpt_neox: position_encoding='learned'"):
        to_family(load(converted), "gpt_neox")


@pytest.mark.parametrize("command", ["evaluate", "finetune"])
def test_a_window_past_the_learned_position_table_is_refused_in_one_line(checkpoint, tmp_path, capsys, command):
    """GPT-2 has no position past its table (a rotary model only warns): every command that reads windows refuses
    a longer one before any work, naming the table, instead of failing deep inside the embedding lookup."""
    out = tmp_path / "out"
    argv = {
        "evaluate": ["evaluate", checkpoint, "--text", text_file(tmp_path), "--window", P + 1, "--windows", 2],
        "finetune": ["finetune", checkpoint, "--train-file", text_file(tmp_path), "--block-size", P + 1,
                     "--max-steps", 1, "--output-dir", out],
    }[command]
    _, err = run(argv, capsys, code=2)
    assert "position table" in error_line(err) and not out.exists()


def test_compress_by_slicing_is_refused_in_one_line(checkpoint, converted, tmp_path, capsys):
    """The slice method rotates the residual stream, which LayerNorm's centring and biases do not commute with: it is
    refused before any work, for the checkpoint and for its conversion, and writes nothing."""
    for name, src in (("source", checkpoint), ("converted", converted)):
        for extra in (["--method", "slice"], ["--slice-fraction", 0.1]):
            out = tmp_path / f"{name}{len(extra[0])}"
            argv = ["compress", src, out, "--remove", 0.1, "--calibration", text_file(tmp_path), "--window", 16]
            _, err = run([*argv, "--calibration-windows", 2, "--self-calibration", 0, "--no-stream", *extra], capsys, code=2)
            assert "not sliced" in error_line(err) and not out.exists(), (name, extra)
