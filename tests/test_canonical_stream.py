"""Streaming canonicalisation of sharded safetensors checkpoints: the same canonical checkpoint as the in-memory
`canonicalize` (float rounding), the same function as the source, one canonical point per orbit, the stored dtype
kept, clear errors on bad input, and no complete-looking output after a failure."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from test_symmetry_zoo import build, perturb, token_ids
from tiny_models import stored_tensors
from transformers import AutoModelForCausalLM

import relational_hf  # noqa: F401  (registers the architecture)
from relational_hf.architectures import UnsupportedModelError
from relational_hf.commands import main as cli
from relational_hf.outputs import MARKER
from relational_hf.symmetry import apply_random_symmetry, canonical_stream, canonicalize
from relational_hf.symmetry.canonical_stream import REPORT_NAME, stream_canonicalize

FAMILIES = ["llama", "llama_tied_bias", "qwen2_final_gain", "qwen3", "gpt2", "gpt2_final_gain", "relational_pivot"]


def _model(name: str) -> torch.nn.Module:
    """A tiny model of the zoo with random biases and norm gains; `*_final_gain`: a tied head behind a final gain
    with 4 distinct values, so the residual rotation splits into clusters (blocks of equal gain)."""
    family, _, variant = name.partition("_final")
    model = perturb(build(family))
    if variant:
        gain = model.transformer.ln_f.weight if family == "gpt2" else model.model.norm.weight
        with torch.no_grad():
            values = 1.0 + 0.3 * torch.randn(4, generator=torch.Generator().manual_seed(2))
            gain.copy_(values[torch.arange(gain.numel()) % 4])
    return model


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _sharded(model: torch.nn.Module, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    model.to(dtype).save_pretrained(path, max_shard_size="20KB")
    model.float()
    assert (path / "model.safetensors.index.json").is_file()  # really sharded
    return path


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_canonical_form_equals_in_memory_keeps_function_and_is_orbit_invariant(tmp_path, monkeypatch, name):
    monkeypatch.setattr(canonical_stream, "ROW_BLOCK_BYTES", 700)  # embedding and head in several row blocks
    model = _model(name)
    src = _sharded(model, tmp_path / "src")
    moved = apply_random_symmetry(copy.deepcopy(model), torch.Generator().manual_seed(5), scale=0.5)
    moved_src = _sharded(moved, tmp_path / "moved")
    assert _max_difference(stored_tensors(src), stored_tensors(moved_src)) > 1e-2  # another point of the orbit
    report = stream_canonicalize(src, tmp_path / "out", max_shard_size="30KB", progress=False)
    stream_canonicalize(moved_src, tmp_path / "out_moved", max_shard_size="30KB", progress=False)
    streamed = stored_tensors(tmp_path / "out")
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    canonicalize(source).save_pretrained(tmp_path / "ref")
    # same checkpoint as the in-memory path (same tensor names: tied heads left out like save_pretrained)
    assert _max_difference(streamed, stored_tensors(tmp_path / "ref")) < 1e-6
    # same function as the source
    canonical = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = token_ids()
    assert (canonical(ids).logits - source(ids).logits).abs().max().item() < 1e-5
    assert _max_difference(streamed, stored_tensors(src)) > 1e-3  # really moved
    # one point per orbit
    assert _max_difference(streamed, stored_tensors(tmp_path / "out_moved")) < 1e-5
    assert report.groups and "residual_rotation" in report.groups
    written = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert written["groups"] == report.groups
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # sharded like save_pretrained


def test_stored_dtype_is_kept_unless_asked(tmp_path):
    src = _sharded(perturb(build("llama")), tmp_path / "src", torch.bfloat16)
    stream_canonicalize(src, tmp_path / "bf16", progress=False)
    stream_canonicalize(src, tmp_path / "fp32", dtype="float32", progress=False)
    bf16, fp32 = stored_tensors(tmp_path / "bf16"), stored_tensors(tmp_path / "fp32")
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    assert {t.dtype for t in fp32.values()} == {torch.float32}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # the bf16 copy is the fp32 computation rounded once
    assert max((bf16[k].float() - fp32[k].to(torch.bfloat16).float()).abs().max().item() for k in bf16) == 0


def test_cli_streams_by_default_and_matches_the_in_memory_path(tmp_path, capsys):
    src = _sharded(perturb(build("qwen3")), tmp_path / "src")
    assert cli.main(["canonicalize", str(src), str(tmp_path / "streamed")]) == 0
    assert cli.main(["canonicalize", str(src), str(tmp_path / "memory"), "--no-stream"]) == 0
    assert "saved" in capsys.readouterr().out
    assert _max_difference(stored_tensors(tmp_path / "streamed"), stored_tensors(tmp_path / "memory")) < 1e-6
    assert (tmp_path / "streamed" / MARKER).is_file()


def test_overwrite_replaces_the_checkpoint_and_keeps_other_files(tmp_path, capsys):
    src = _sharded(perturb(build("llama")), tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model.safetensors").write_bytes(b"old")
    assert cli.main(["canonicalize", str(src), str(out)]) == 2  # refused without --overwrite: nothing changed
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == b"old"
    assert cli.main(["canonicalize", str(src), str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def _error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    src = _sharded(perturb(build("llama")), tmp_path / "src")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((src / "config.json").read_text())
    line = _error(capsys, ["canonicalize", str(src), str(tmp_path / "taken")])
    assert "not empty" in line and "--overwrite" in line
    line = _error(capsys, ["canonicalize", str(tmp_path / "missing"), str(tmp_path / "o1")])
    assert "canonicalize: error:" in line and "missing" in line
    line = _error(capsys, ["canonicalize", str(no_weights), str(tmp_path / "o2"), "--stream"])
    assert "--stream needs" in line
    line = _error(capsys, ["canonicalize", str(src), str(tmp_path / "o3"), "--max-shard-size", "huge"])
    assert "--max-shard-size" in line
    line = _error(capsys, ["canonicalize", str(src), str(tmp_path / "o4"), "--dtype", "int8"])
    assert "--dtype" in line
    assert not any(p.name.startswith(("o1", "o2", "o3", "o4")) for p in tmp_path.iterdir())
    with pytest.raises(FileNotFoundError, match="not a local checkpoint folder"):
        stream_canonicalize(no_weights, tmp_path / "o5", progress=False)


def test_incomplete_or_unsupported_checkpoints_are_refused(tmp_path, capsys):
    from safetensors.torch import save_file
    from transformers import OPTConfig, OPTForCausalLM  # a family no adapter knows (GPT-NeoX has one now)

    model = perturb(build("llama"))
    model.save_pretrained(tmp_path / "cut")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "layers.1.mlp.down_proj" not in k}
    save_file(state, str(tmp_path / "cut" / "model.safetensors"), metadata={"format": "pt"})
    line = _error(capsys, ["canonicalize", str(tmp_path / "cut"), str(tmp_path / "o1")])
    assert "layers.1.mlp.down_proj.weight" in line and "missing" in line
    config = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64,
                       word_embed_proj_dim=32, max_position_embeddings=64)  # fmt: skip
    OPTForCausalLM(config).save_pretrained(tmp_path / "family")
    line = _error(capsys, ["canonicalize", str(tmp_path / "family"), str(tmp_path / "o2")])
    assert "unsupported" in line and "OPT" in line
    assert not any(p.name.startswith("o") or ".partial" in p.name for p in tmp_path.iterdir())


def test_group_coupling_two_parts_is_refused(tmp_path, monkeypatch):
    src = _sharded(perturb(build("llama")), tmp_path / "src")
    parts = canonical_stream._parts

    def merged(model):  # pretend layer 0's norm gain lives in another part than its readers
        out = parts(model)
        gain = next(n for n in out[1].names if n.endswith("input_layernorm.weight"))
        out[1].names.remove(gain)
        out[-1].names.append(gain)
        return out

    monkeypatch.setattr(canonical_stream, "_parts", merged)
    with pytest.raises(UnsupportedModelError, match="one layer at a time"):
        stream_canonicalize(src, tmp_path / "out", progress=False)
    assert not any(p.name != "src" for p in tmp_path.iterdir())  # refused before writing anything


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failed_run_leaves_no_complete_looking_output(tmp_path, monkeypatch, overwrite):
    src = _sharded(perturb(build("llama")), tmp_path / "src")
    out = tmp_path / "out"
    if overwrite:
        out.mkdir()
        (out / "config.json").write_text("{}")
    calls = []
    original = canonical_stream.canonicalize_groups

    def failing(groups, report, principal=None):
        calls.append(1)
        if len(calls) == 3:  # inside the second decoder layer, after shards were written
            raise RuntimeError("disk on fire")
        return original(groups, report, principal)

    monkeypatch.setattr(canonical_stream, "canonicalize_groups", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        stream_canonicalize(src, out, max_shard_size="30KB", overwrite=overwrite, progress=False)
    if overwrite:
        assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # the old content, untouched
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src", *(["out"] if overwrite else [])])


@pytest.mark.parametrize(("name", "expected"), [("llama", {0, 3}), ("llama_tied_bias", {0}), ("gpt2", set())])
def test_embedding_and_head_move_in_row_blocks_where_every_group_acts_row_by_row(name, expected):
    """Untied Llama: the embedding (rotation only) and the head (final gain fold + rotation) go in row blocks; GPT-2's
    embedding part holds two matrices and a centring translation, so it is moved whole."""
    from relational_hf.shards import meta_model

    model = meta_model(build(name).config)
    parts = canonical_stream._parts(model)
    homes = canonical_stream._assign_groups(model, parts)
    assert canonical_stream._row_parts(model, parts, homes) == expected
