"""Streaming conversion and analysis of sharded safetensors checkpoints: the same checkpoint as the in-memory path,
the source dtype kept, a save_pretrained-style index, atomic output, and the same redundancy numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import stored_tensors
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import relational_hf  # noqa: F401  (registers the architecture)
from relational_hf.commands.main import main
from relational_hf.convert import ConversionError, streaming, to_relational
from relational_hf.convert.streaming import layerwise_logits, stream_to_relational
from relational_hf.symmetry.report import (
    redundancy_report,
    redundancy_report_from_checkpoint,
    redundancy_report_from_config,
)

VOCAB = 96


def _source(family: str, tie: bool) -> torch.nn.Module:
    """A tiny Llama / Qwen2 (GQA; Qwen2 with q/k/v biases) with random norm gains and biases of order one."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    model = (
        LlamaForCausalLM(LlamaConfig(**common))
        if family == "llama"
        else Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    return model.eval()


def _save(model: torch.nn.Module, path: Path, dtype: torch.dtype) -> Path:
    model.to(dtype).save_pretrained(path, max_shard_size="20KB")
    model.float()
    assert (path / "model.safetensors.index.json").is_file()  # really sharded
    return path


@pytest.mark.parametrize(("family", "tie", "dtype"), [("llama", False, "bf16"), ("qwen2", True, "fp32")])
def test_streaming_writes_the_in_memory_checkpoint_in_the_source_dtype(tmp_path, family, tie, dtype):
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    src = _save(_source(family, tie), tmp_path / "src", torch_dtype)
    report = stream_to_relational(src, tmp_path / "out", max_shard_size="30KB", progress=False)
    streamed = stored_tensors(tmp_path / "out")
    # the in-memory path on the same (rounded) source weights, cast like save_pretrained of a model in that dtype
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    reference = to_relational(source).to(torch_dtype)
    expected = {k: v for k, v in reference.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(streamed) == set(expected)
    for key, tensor in expected.items():
        assert streamed[key].dtype == tensor.dtype, key
        assert torch.equal(streamed[key], tensor), key
    assert report.relational_parameters == sum(p.numel() for p in reference.parameters())
    assert report.relative_logit_difference <= 1e-5
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch_dtype
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    diff = (loaded.float()(ids).logits - source(ids).logits).abs().max().item()
    assert diff < (1e-4 if dtype == "fp32" else 0.1)  # bf16: rounding of the new factors only


def test_shards_and_index_are_laid_out_like_save_pretrained(tmp_path):
    src = _save(_source("llama", False), tmp_path / "src", torch.bfloat16)
    stream_to_relational(src, tmp_path / "out", max_shard_size="30KB", progress=False)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    stored_bytes = 0
    for file in files:
        with safe_open(str(out / file), framework="pt") as st:
            keys = set(st.keys())
            assert {k for k, f in index["weight_map"].items() if f == file} == keys
            shard_bytes = sum(st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in keys)
        assert shard_bytes <= 30_000 or len(keys) == 1  # a tensor larger than a shard gets its own
        stored_bytes += shard_bytes
    assert index["metadata"]["total_size"] == stored_bytes
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in loaded.parameters())
    for name in ("config.json", "generation_config.json", "conversion_report.json", "modeling_relational.py"):
        assert (out / name).is_file(), name


def test_a_failed_conversion_leaves_no_output(tmp_path, monkeypatch):
    src = _save(_source("llama", False), tmp_path / "src", torch.float32)
    real = streaming.convert_layer
    calls = []

    def failing(target, tensors, *times, **options):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk full (simulated)")
        real(target, tensors, *times, **options)

    monkeypatch.setattr(streaming, "convert_layer", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        stream_to_relational(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no OUT, no staging folder left

    def wrong(target, tensors, *times, **options):  # a conversion that changes the function: refused, not written
        real(target, tensors, *times, **options)
        with torch.no_grad():
            target.mlp.down_proj.weight.mul_(1.01)

    monkeypatch.setattr(streaming, "convert_layer", wrong)
    with pytest.raises(ConversionError, match="layer 0"):
        stream_to_relational(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_an_existing_output_folder_is_refused_and_left_untouched(tmp_path):
    src = _save(_source("llama", True), tmp_path / "src", torch.float32)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="not empty"):
        stream_to_relational(src, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="dtype"):
        stream_to_relational(src, tmp_path / "other", dtype="int8", progress=False)
    with pytest.raises(ValueError, match="max_shard_size"):
        stream_to_relational(src, tmp_path / "other", max_shard_size="lots", progress=False)
    assert not (tmp_path / "other").exists()


def test_convert_command_streams_safetensors_and_keeps_bf16(tmp_path, capsys):
    src = _save(_source("qwen2", False), tmp_path / "src", torch.bfloat16)
    assert main(["convert", str(src), str(tmp_path / "streamed")]) == 0
    assert "layer by layer" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert main(["convert", str(src), str(tmp_path / "memory"), "--no-stream"]) == 0
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    memory = AutoModelForCausalLM.from_pretrained(tmp_path / "memory")
    assert streamed.dtype == torch.bfloat16 and fp32.dtype == torch.float32 == memory.dtype
    for key, tensor in memory.state_dict().items():  # streamed fp32 == in-memory fp32 checkpoint
        assert torch.allclose(fp32.state_dict()[key], tensor, rtol=1e-6, atol=1e-7), key
    assert main(["convert", str(src), str(tmp_path / "x"), "--stream", "--slice", "0.2"]) == 2
    assert "--calibration" in capsys.readouterr().err


def test_layerwise_logits_equal_the_full_forward(tmp_path):
    source = _source("qwen2", True)
    src = _save(source, tmp_path / "src", torch.float32)
    stream_to_relational(src, tmp_path / "out", progress=False)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = source(ids).logits
        converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(ids).logits
    assert torch.allclose(layerwise_logits(src, ids), expected, atol=1e-5)
    assert torch.allclose(layerwise_logits(tmp_path / "out", ids), converted, atol=1e-5)


@pytest.mark.parametrize("which", ["src", "out"])
def test_streaming_redundancy_equals_the_in_memory_report(tmp_path, which):
    src = _save(_source("llama", True), tmp_path / "src", torch.float32)
    stream_to_relational(src, tmp_path / "out", progress=False)
    path = tmp_path / which
    full = redundancy_report(AutoModelForCausalLM.from_pretrained(path))
    streamed = redundancy_report_from_checkpoint(path)
    assert streamed.total_parameters == full.total_parameters
    assert [g.__dict__ for g in streamed.groups] == [g.__dict__ for g in full.groups]
    assert streamed.notes == full.notes
    assert len(streamed.descriptors) == len(full.descriptors) == 3
    for a, b in zip(streamed.descriptors, full.descriptors, strict=True):
        assert a.qk_rank == b.qk_rank and a.vo_rank == b.vo_rank
        assert torch.allclose(a.qk_similarity, b.qk_similarity, atol=1e-6)
        assert torch.allclose(a.vo_singular_values, b.vo_singular_values, rtol=1e-5)


def test_meta_report_sets_apart_what_a_tied_final_gain_decides():
    tied = _source("llama", True).config
    untied = _source("llama", False).config
    report = redundancy_report_from_config(tied)
    d = tied.hidden_size
    assert report.value_dependent_dimensions == d * (d - 1) // 2
    assert "residual_rotation" not in report.by_group
    assert any("final norm gain" in n and "--meta" in n for n in report.notes)
    assert "at most" in report.to_markdown()
    # with the weights the count is known: here the gain varies, so the rotation is (almost) entirely broken
    full = redundancy_report(_source("llama", True))
    assert full.by_group.get("residual_rotation", 0) < d * (d - 1) // 2
    # an untied head absorbs any final gain: O(d) is counted from the config alone
    assert redundancy_report_from_config(untied).by_group["residual_rotation"] == d * (d - 1) // 2


def test_big_model_evaluation_offloads_layers_and_keeps_the_perplexity(tmp_path):
    from relational_hf.lm.metrics import perplexity
    from relational_hf.lm.offload import offloaded_perplexity

    source = _source("llama", False)
    source.save_pretrained(tmp_path / "src")
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(3))
    layer_bytes = sum(p.numel() * 4 for p in source.model.layers[0].parameters())
    embed_bytes = source.model.embed_tokens.weight.numel() * 4
    budget = embed_bytes + layer_bytes + layer_bytes // 2  # the embedding and one layer fit in "memory"
    ppl, device_map = offloaded_perplexity(tmp_path / "src", ids, max_memory={"cpu": budget})
    assert "disk" in device_map.values() and "cpu" in device_map.values()
    assert ppl == pytest.approx(perplexity(source, ids), rel=1e-5)
