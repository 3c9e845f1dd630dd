"""`relational-hf export SRC OUT.gguf --to gguf`: every tensor and metadata key read back with gguf.GGUFReader, and a
reference forward pass from the GGUF file alone (llama.cpp's conventions, tests/gguf_helpers.py) giving the plugin's
logits for every configuration the exporter takes; tokenizers as vocabulary metadata; types; refusals before any
write; atomic, streamed writing. llama.cpp itself: tests/test_gguf_llama_cpp.py."""

from __future__ import annotations

import pytest
import torch
from gguf_helpers import BASE as CASE_BASE
from gguf_helpers import (
    CASES,
    VOCAB,
    compressed_model,
    dequantized,
    fields,
    plugin_logits,
    reference_logits,
    relative_difference,
)
from gguf_helpers import tiny_case as _case

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install 'relational-hf[real]'")

from relational_hf.commands.main import main  # noqa: E402
from relational_hf.convert.gguf_export import export_gguf  # noqa: E402
from relational_hf.convert.gguf_layout import GGUFExportError  # noqa: E402
from relational_hf.convert.gguf_vocab import CONTROL, NEVER_MERGE, NORMAL, USER_DEFINED  # noqa: E402
from relational_hf.lm.data import byte_level_tokenizer  # noqa: E402
from relational_hf.modeling import RelationalConfig, RelationalForCausalLM  # noqa: E402

IDS = torch.tensor([1, 40, 7, 200, 13, 13, 90, 250, 3, 64, 128, 5])


def _save(model, folder, tokenizer=True):
    model.save_pretrained(folder)
    if tokenizer:
        byte_level_tokenizer().save_pretrained(folder)
    return folder


def _check_contents(path, model, outtype="f32"):
    """Every tensor (names, shapes, types, unit norms, embedding and gains as stored) and every metadata key."""
    c = model.config
    reader = gguf.GGUFReader(str(path))
    meta = fields(reader)
    widths = [c.layer_intermediate_size(i) for i in range(c.num_hidden_layers)]
    arch = "llama" if len(set(widths)) == 1 else "deci"
    width = c.qk_rank * -(-c.head_dim // c.qk_rank)
    layers = range(c.num_hidden_layers)
    expected = {
        "general.architecture": arch,
        "general.type": "model",
        "general.name": path.stem,
        "general.file_type": {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}[outtype],
        f"{arch}.vocab_size": c.vocab_size,
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.feed_forward_length": widths if arch == "deci" else widths[0],
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": [c.num_key_value_heads] * len(layers)
        if arch == "deci"
        else c.num_key_value_heads,
        f"{arch}.attention.key_length": width,
        f"{arch}.attention.value_length": width,
        f"{arch}.rope.dimension_count": width,
        f"{arch}.rope.freq_base": pytest.approx(c.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": pytest.approx(c.rms_norm_eps),
    }
    if outtype in ("q8_0", "bf16"):
        expected["general.quantization_version"] = 2
    vocab_keys = {k for k in meta if k.startswith("tokenizer.")}
    assert {k: v for k, v in meta.items() if k not in vocab_keys} == expected
    assert "tokenizer.ggml.model" in vocab_keys

    names = ["token_embd.weight", "output_norm.weight"] + ([] if c.tie_word_embeddings else ["output.weight"])
    for i in layers:
        parts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
        names += [f"blk.{i}.{p}.weight" for p in parts]
        names += [f"blk.{i}.attn_{p}.bias" for p in ("q", "k", "v") if c.attention_bias]
        names += [f"blk.{i}.attn_output.bias"] if c.attention_output_bias else []
    tensors = {t.name: t for t in reader.tensors}
    assert sorted(tensors) == sorted(names)
    w = dequantized(reader)
    d, h, h_kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    for i, f in zip(layers, widths, strict=True):
        b = f"blk.{i}."
        shapes = {"attn_q": (h * width, d), "attn_k": (h_kv * width, d), "attn_v": (h_kv * width, d)}
        shapes |= {"attn_output": (d, h * width), "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}
        for part, shape in shapes.items():
            assert tuple(w[b + part + ".weight"].shape) == shape, (b + part, shape)
        for part in ("attn_norm", "ffn_norm"):  # gain-free norms: unit weights, f32
            assert torch.equal(w[b + part + ".weight"], torch.ones(d, dtype=torch.float64))
            assert tensors[b + part + ".weight"].tensor_type == gguf.GGMLQuantizationType.F32
        # a QK width r_l < D and a value width r_v < D leave exactly zero rows / columns
        r_l, r_v = c.layer_qk_rank(i), c.layer_value_rank(i)
        assert int((w[b + "attn_k.weight"].abs().sum(1) == 0).sum()) >= h_kv * (width - r_l)
        assert int((w[b + "attn_v.weight"].abs().sum(1) == 0).sum()) >= h_kv * (width - r_v)
        assert int((w[b + "attn_output.weight"].abs().sum(0) == 0).sum()) >= h * (width - r_v)
    if outtype == "f32":
        assert torch.equal(w["token_embd.weight"], model.model.embed_tokens.weight.double())
        gain = model.model.norm.weight
        assert torch.equal(w["output_norm.weight"], torch.ones(d).double() if gain is None else gain.double())
        if not c.tie_word_embeddings:
            assert torch.equal(w["output.weight"], model.lm_head.weight.double())
    return meta


@pytest.mark.parametrize("name", list(CASES))
def test_the_gguf_file_computes_the_plugin_logits(name, tmp_path):
    """Exported from a checkpoint folder (streamed) in f32, every tensor and key checked, the reference forward pass
    from the file alone gives the plugin's logits (max relative difference < 1e-4 of the logit scale); the same
    model exported from memory gives the same bytes."""
    model = _case(name)
    out = tmp_path / "model.gguf"
    report = export_gguf(_save(model, tmp_path / "src"), out, outtype="f32", tokenizer=byte_level_tokenizer())
    _check_contents(out, model)
    assert report.arch == ("deci" if "per-layer" in name else "llama")
    assert report.tied_head == model.config.tie_word_embeddings
    assert relative_difference(reference_logits(out, IDS), plugin_logits(model, IDS)) < 1e-4
    export_gguf(model, tmp_path / "memory.gguf", outtype="f32", tokenizer=byte_level_tokenizer(), name="model")
    assert (tmp_path / "memory.gguf").read_bytes() == out.read_bytes()


@pytest.fixture(scope="module")
def compressed():
    return compressed_model()


def test_a_model_compressed_by_compress_exports_as_deci_with_its_widths(compressed, tmp_path):
    c = compressed.config
    assert len(set(c.layer_intermediate_sizes)) > 1 and min(c.layer_qk_ranks) < c.qk_rank
    out = tmp_path / "compressed.gguf"
    report = export_gguf(_save(compressed, tmp_path / "src"), out, outtype="f32", tokenizer=byte_level_tokenizer())
    meta = _check_contents(out, compressed)
    assert report.arch == "deci" and meta["deci.feed_forward_length"] == c.layer_intermediate_sizes
    assert relative_difference(reference_logits(out, IDS), plugin_logits(compressed, IDS)) < 1e-4


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_outtypes_store_the_matrices_in_their_type_and_norms_in_f32(outtype, tmp_path):
    """f16 / bf16 / q8_0: matrices in that type (q8_0: rows not a multiple of 32 long fall back to f16 and are
    reported), 1-D tensors f32; the file's logits stay close to the plugin's; smaller than f32."""
    model = _case("pivot-per-layer-widths")
    T = gguf.GGMLQuantizationType
    full = tmp_path / "f32.gguf"
    export_gguf(model, full, outtype="f32", tokenizer=byte_level_tokenizer())
    out = tmp_path / f"{outtype}.gguf"
    report = export_gguf(model, out, outtype=outtype, tokenizer=byte_level_tokenizer())
    _check_contents(out, model, outtype)
    want = {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[outtype]
    for t in gguf.GGUFReader(str(out)).tensors:
        rows = int(t.shape[0])  # ne0: the row length
        if len(t.shape) == 1:
            assert t.tensor_type == T.F32, t.name
        elif outtype == "q8_0" and rows % 32:
            assert t.tensor_type == T.F16 and t.name in report.fallback_f16, t.name
        else:
            assert t.tensor_type == want, t.name
    if outtype == "q8_0":
        assert report.fallback_f16 == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]  # rows of 40 and 24
    assert out.stat().st_size < full.stat().st_size
    tolerance = {"f16": 2e-3, "bf16": 2e-2, "q8_0": 2e-2}[outtype]
    assert relative_difference(reference_logits(out, IDS), plugin_logits(model, IDS)) < tolerance


def test_the_byte_level_tokenizer_becomes_gguf_vocabulary(tmp_path):
    """`relational-hf train`'s byte-level tokenizer: 259 tokens in id order, the 3 specials as control tokens, one
    merge that never applies (GGUF holds no empty array, llama.cpp needs the key), special ids, no BOS added; the
    pre-tokenizer smollm (any split gives one token a byte, and its detokenizer keeps the spaces Transformers keeps)."""
    tokenizer = byte_level_tokenizer()
    out = tmp_path / "bytes.gguf"
    export_gguf(_case("pivot-gqa-tied"), out, outtype="f32", tokenizer=tokenizer)
    meta = fields(gguf.GGUFReader(str(out)))
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert meta["tokenizer.ggml.tokens"] == [vocab[i] for i in range(VOCAB)]
    assert meta["tokenizer.ggml.token_type"] == [CONTROL] * 3 + [NORMAL] * 256
    assert meta["tokenizer.ggml.merges"] == [NEVER_MERGE]
    ids = {k: meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding")}
    assert ids == {"bos": 1, "eos": 2, "padding": 0}
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["tokenizer.ggml.add_eos_token"] is False


def test_smollm2s_bpe_tokenizer_becomes_gguf_vocabulary(smollm2_dir, tmp_path):
    """SmolLM2's GPT-2-style BPE tokenizer: every token string in id order, its 48,900 merges in rank order, its
    special tokens as control tokens, special ids, the chat template, and llama.cpp's pre-tokenizer for its split."""
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = RelationalForCausalLM(RelationalConfig(**{**CASE_BASE, "vocab_size": len(tokenizer), "hidden_size": 8,
                                                      "num_attention_heads": 2, "num_key_value_heads": 1,
                                                      "num_hidden_layers": 1, "head_dim": 4}))  # fmt: skip
    out = tmp_path / "smollm2-vocab.gguf"
    export_gguf(model, out, outtype="f32", tokenizer=tokenizer)
    meta = fields(gguf.GGUFReader(str(out)))
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    assert meta["tokenizer.ggml.tokens"] == [vocab[i] for i in range(len(tokenizer))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    assert meta["tokenizer.ggml.merges"] == merges and len(merges) > 40_000
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    types = meta["tokenizer.ggml.token_type"]
    assert {i for i, t in enumerate(types) if t == CONTROL} == special and USER_DEFINED not in types
    assert meta["tokenizer.ggml.pre"] == "gpt-2"  # this checkpoint's ByteLevel split (the GPT-2 expression)
    assert meta["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert meta["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert meta["tokenizer.chat_template"] == tokenizer.chat_template


def _assert_no_file(folder):
    assert [p.name for p in folder.iterdir() if p.name != "src"] == []


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(value_parallel_removal=True), "value_parallel_removal"),
        (dict(position_encoding="none"), "position_encoding"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}), "rope_type"),
        (dict(qk_norm=True, qk_rank=4), "qk_rank"),  # qwen3 (tests/test_gguf_families.py): QK-norm over the head
        (dict(rope_layers=[True, False]), "rope_layers"),  # smollm3: without rotary in every 4th layer only
    ],
)
def test_what_gguf_cannot_hold_is_refused_in_one_line_naming_the_field(overrides, field, tmp_path, capsys):
    model = RelationalForCausalLM(RelationalConfig(**(CASE_BASE | overrides))).eval()
    with pytest.raises(GGUFExportError, match=field):
        export_gguf(model, tmp_path / "out.gguf")
    _assert_no_file(tmp_path)
    _save(model, tmp_path / "src")
    capsys.readouterr()  # the save's progress bars
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out.gguf"), "--to", "gguf"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
    _assert_no_file(tmp_path)


def test_every_option_of_the_architecture_is_mapped_or_refused(monkeypatch):
    """A field the relational config gains later is never exported as if it were absent: set away from its default,
    any field outside the layout's mapped set is refused by name (a stand-in field added to the class here)."""
    import dataclasses

    from relational_hf.convert.gguf_layout import MAPPED_FIELDS, gguf_refusal

    own = set(RelationalConfig.__annotations__)
    assert MAPPED_FIELDS <= own, MAPPED_FIELDS - own
    config = RelationalConfig(**CASE_BASE)
    assert gguf_refusal(config) is None
    fields = dataclasses.fields(RelationalConfig)
    extra = dataclasses.field(default=False)
    extra.name, extra.type, extra._field_type = "future_option", bool, dataclasses._FIELD
    monkeypatch.setattr(
        RelationalConfig, "__dataclass_fields__", {**{f.name: f for f in fields}, "future_option": extra}
    )
    monkeypatch.setitem(RelationalConfig.__annotations__, "future_option", bool)
    object.__setattr__(config, "future_option", True)
    assert "future_option=True" in gguf_refusal(config)
    object.__setattr__(config, "future_option", False)
    assert gguf_refusal(config) is None


def test_a_non_relational_source_is_told_to_convert_first(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "src")  # fmt: skip
    capsys.readouterr()  # the save's progress bars
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out.gguf"), "--to", "gguf"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "relational-hf convert" in err[0] and "llama" in err[0], err
    _assert_no_file(tmp_path)


def test_a_tokenizer_llama_cpp_would_read_differently_is_refused_before_writing(tmp_path):
    from tokenizers import normalizers

    tokenizer = byte_level_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(GGUFExportError, match="normalizer"):
        export_gguf(_case("pivot-gqa-tied"), tmp_path / "out.gguf", tokenizer=tokenizer)
    _assert_no_file(tmp_path)


def test_the_command_streams_a_folder_and_replaces_out_atomically(tmp_path, capsys, monkeypatch):
    """The command reads a checkpoint folder a layer at a time (the whole model is never loaded), prints its report;
    an export that fails half-way leaves the previous OUT as it was and no temporary file."""
    model = _case("free-untied")
    src = _save(model, tmp_path / "src")
    out = tmp_path / "model.gguf"
    out.write_bytes(b"previous")

    def no_whole_model(*args, **kwargs):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(RelationalForCausalLM, "from_pretrained", no_whole_model)
    assert main(["export", str(src), str(out), "--to", "gguf", "--outtype", "f32"]) == 0
    printed = capsys.readouterr().out
    assert "Export to GGUF (`llama`, f32)" in printed and "untied" in printed
    assert relative_difference(reference_logits(out, IDS), plugin_logits(model, IDS)) < 1e-4

    written = out.read_bytes()

    def fail_half_way(name):
        if name.startswith("blk.1."):
            raise OSError("simulated failure")

    with pytest.raises(OSError, match="simulated"):
        export_gguf(src, out, outtype="f16", tokenizer=byte_level_tokenizer(), on_tensor=fail_half_way)
    assert out.read_bytes() == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "src"]


def test_without_llama_cpp_the_export_works_and_quantize_is_refused_before_writing(tmp_path, capsys, monkeypatch):
    """Where llama.cpp is not installed, `--to gguf` still writes the file and says how to install llama.cpp to run
    it; `--quantize` (llama.cpp's quantiser) is refused in one line naming the extra, before anything is written."""
    from relational_hf.convert import gguf_runtime

    monkeypatch.setattr(gguf_runtime, "available", lambda: False)
    src = _save(_case("pivot-gqa-tied"), tmp_path / "src")
    capsys.readouterr()
    out = tmp_path / "m.gguf"
    assert main(["export", str(src), str(out), "--to", "gguf", "--quantize", "Q4_K_M"]) == 2
    err = capsys.readouterr().err
    assert "relational-hf[gguf]" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    assert main(["export", str(src), str(out), "--to", "gguf"]) == 0
    assert "relational-hf[gguf]" in capsys.readouterr().out and out.stat().st_size > 0
    assert main(["export", str(src), str(tmp_path / "plain"), "--quantize", "Q8_0"]) == 2
    assert "--to gguf" in capsys.readouterr().err


def test_pad_mlp_changes_nothing_where_deci_holds_the_widths_and_is_refused_off_gguf(tmp_path, capsys):
    """`--pad-mlp` only permits padding where llama.cpp needs it: a per-layer-width model still goes to `deci` at its
    own widths (the same bytes as without the flag, no zero units noted), and the flag off `--to gguf` is refused in
    one line before anything is written."""
    src = _save(_case("pivot-per-layer-widths"), tmp_path / "src")
    plain, padded = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"  # one name: the file's general.name
    assert main(["export", str(src), str(plain), "--to", "gguf", "--outtype", "f32"]) == 0
    assert main(["export", str(src), str(padded), "--to", "gguf", "--outtype", "f32", "--pad-mlp"]) == 0
    assert "zero SwiGLU units" not in capsys.readouterr().out
    assert plain.read_bytes() == padded.read_bytes()
    assert main(["export", str(src), str(tmp_path / "llama"), "--to", "llama", "--pad-mlp"]) == 2
    err = capsys.readouterr().err
    assert "--pad-mlp applies to --to gguf only" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "llama").exists()
