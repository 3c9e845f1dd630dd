"""`relational-hf evaluate`: the perplexity of a model loaded with most layers offloaded to disk equals the
in-memory one; the report (stdout and --json) carries the device map and the peak RSS; bad inputs give one-line
errors before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relational_hf.commands import main as cli
from relational_hf.lm.data import byte_level_tokenizer, generate_corpus
from relational_hf.lm.metrics import perplexity
from relational_hf.outputs import save_tokenizer

WINDOW = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path, torch.nn.Module]:
    """A tiny Llama (4 layers, byte-level vocabulary) saved with its tokenizer, and a text file."""
    root = tmp_path_factory.mktemp("offload_cli")
    torch.manual_seed(0)
    tokenizer = byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "model")
    save_tokenizer(tokenizer, root / "model")
    text = root / "text.txt"
    text.write_text(generate_corpus(60, seed=4), encoding="utf-8")
    return root / "model", text, model


def _windows(text: Path, windows: int) -> torch.Tensor:
    ids = torch.tensor(byte_level_tokenizer()(text.read_text(encoding="utf-8"))["input_ids"])
    return ids[: windows * WINDOW].reshape(windows, WINDOW)


def test_offloaded_perplexity_equals_in_memory(checkpoint, tmp_path, capsys):
    path, text, model = checkpoint
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    budget = embed_bytes + layer_bytes + layer_bytes // 2  # room for the embedding and one layer: the rest on disk
    report = tmp_path / "reports" / "eval.json"
    argv = ["evaluate", str(path), "--text", str(text), "--window", str(WINDOW), "--windows", "5"]
    assert cli.main([*argv, "--max-memory", str(budget), "--json", str(report), "--batch-size", "2"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(report.read_text())
    expected = perplexity(model, _windows(text, 5), batch_size=5)
    assert result["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert result["device_map"].get("disk", 0) >= 2 and result["offloaded"]  # most layers really were offloaded
    assert result["windows"] == 5 and result["predicted_tokens"] == 5 * (WINDOW - 1)
    assert result["peak_rss_mib"] > 0
    assert f"perplexity {result['perplexity']:.4f}" in printed and "disk:" in printed and "peak RSS" in printed
    assert [p.name for p in report.parent.iterdir()] == ["eval.json"]  # no temporary file left beside
    # the plain (whole-model) load gives the same number
    assert cli.main([*argv, "--json", str(tmp_path / "plain.json")]) == 0
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert plain["perplexity"] == pytest.approx(expected, rel=1e-5) and not plain["offloaded"]
    # token ids given as a .pt tensor: the same windows, the same number
    torch.save(_windows(text, 5).reshape(-1), tmp_path / "ids.pt")
    ids_argv = ["evaluate", str(path), "--text", str(tmp_path / "ids.pt"), "--window", str(WINDOW)]
    assert cli.main([*ids_argv, "--json", str(tmp_path / "ids.json")]) == 0
    assert json.loads((tmp_path / "ids.json").read_text())["perplexity"] == pytest.approx(expected, rel=1e-5)


def test_offloaded_loading_reads_every_shard_without_mapping_it(checkpoint, tmp_path, monkeypatch):
    """Transformers maps each shard for the whole load, which made a big checkpoint resident in full; loaded with
    disk offload, every shard is opened with `pread` instead (nothing of the file stays mapped), the model computes
    what the in-memory one does, and the loader's own `safe_open` is back afterwards (other loads are unchanged)."""
    from transformers import modeling_utils

    from relational_hf.lm.offload import _has_pread_backend, load_offloaded

    if not _has_pread_backend():
        pytest.skip("this safetensors reads files only through a memory map")
    path, text, model = checkpoint
    sharded = tmp_path / "sharded"
    model.to(torch.bfloat16).save_pretrained(sharded, max_shard_size="40KB")  # several shards, cast while loading
    model.float()
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 3
    original = modeling_utils.safe_open
    opened: list[tuple[str, str]] = []

    def recording(filename, framework="pt", device="cpu", backend="mmap", **kwargs):
        opened.append((Path(filename).name, backend))
        return original(filename, framework=framework, device=device, backend=backend, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_open", recording)
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    budget = model.model.embed_tokens.weight.numel() * 4 + layer_bytes * 3 // 2
    offloaded = load_offloaded(sharded, max_memory={"cpu": budget}, dtype="float32")
    loaded = {name for name, backend in opened}
    assert loaded == set(shards) and {backend for name, backend in opened} == {"pread"}
    assert modeling_utils.safe_open is recording  # restored
    assert "disk" in {str(v) for v in offloaded.hf_device_map.values()}
    ids = _windows(text, 2)
    reference = LlamaForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    assert modeling_utils.safe_open is recording and {b for _, b in opened[len(loaded) :]} <= {"mmap", None}
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def _error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_bad_inputs_give_one_line_errors(checkpoint, tmp_path, capsys):
    path, text, _ = checkpoint
    base = ["evaluate", str(path)]
    assert "--text" in _error(capsys, base)  # required
    line = _error(capsys, [*base, "--text", str(tmp_path / "absent.txt")])
    assert "--text" in line and "absent.txt" in line
    line = _error(capsys, [*base, "--text", str(text), "--window", "1"])
    assert "--window" in line and ">= 2" in line
    line = _error(capsys, [*base, "--text", str(text), "--max-memory", "lots"])
    assert "--max-memory" in line and "4GiB" in line
    line = _error(capsys, [*base, "--text", str(text), "--max-memory", "-3GB"])
    assert "--max-memory" in line
    short = tmp_path / "short.txt"
    short.write_text("tiny", encoding="utf-8")
    line = _error(capsys, [*base, "--text", str(short), "--window", "64"])
    assert "fewer than one --window" in line
    line = _error(capsys, ["evaluate", str(tmp_path / "no_model"), "--text", str(text)])
    assert "evaluate: error:" in line and "no_model" in line
    line = _error(capsys, [*base, "--text", str(text), "--json", str(tmp_path)])
    assert "--json" in line and "directory" in line
    torch.save(torch.full((200,), 10_000), tmp_path / "big_ids.pt")  # ids beyond the vocabulary
    line = _error(capsys, [*base, "--text", str(tmp_path / "big_ids.pt"), "--window", "8"])
    assert "token ids must lie in [0, 259)" in line
    torch.save(torch.rand(200), tmp_path / "float_ids.pt")
    assert "integer tensor" in _error(capsys, [*base, "--text", str(tmp_path / "float_ids.pt"), "--window", "8"])


def _numbers(value, path=""):
    """The numbers of a JSON report, keyed by where they sit (timings, memory and placement left out)."""
    skip = {"timings_s", "peak_rss_mib", "device_map", "offloaded", "figures"}
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() if key not in skip for k, v in _numbers(item, f"{path}/{key}").items()
        }
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _numbers(item, f"{path}/{i}").items()}
    return {path: value} if isinstance(value, (int, float)) and not isinstance(value, bool) else {}


def test_offloaded_analysis_equals_in_memory(checkpoint, tmp_path, capsys):
    """`analyze --max-memory`: the layers beyond the budget stay on disk, and every figure of the report (the update
    statistics, the all-layer and per-layer edits, the compression settings' errors and perplexities: quantisation,
    Wanda calibrated through the offloaded layers, N:M pruning) is the in-memory one."""
    path, text, model = checkpoint
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    budget = embed_bytes + layer_bytes + layer_bytes // 2
    argv = ["analyze", str(path), "--text", str(text), "--seq-len", str(WINDOW), "--max-tokens", "256"]
    argv += ["--batch-size", "3", "--per-layer-tokens", "64", "--group-size", "16"]
    argv += ["--compression", "int4", "wanda", "magnitude-2:4"]  # quantisation, calibrated and N:M pruning
    assert cli.main([*argv, "--out", str(tmp_path / "memory")]) == 0
    assert cli.main([*argv, "--out", str(tmp_path / "offloaded"), "--max-memory", str(budget)]) == 0
    printed = capsys.readouterr().out
    plain = json.loads((tmp_path / "memory" / "report.json").read_text())
    offloaded = json.loads((tmp_path / "offloaded" / "report.json").read_text())
    assert offloaded["offloaded"] and offloaded["device_map"].get("disk", 0) >= 2  # most layers stayed on disk
    assert not plain["offloaded"] and list(plain["device_map"]) == ["cpu"]
    assert offloaded["complete"] and len(offloaded["compression"]["settings"]) == 3 and offloaded["per_layer"]
    expected, got = _numbers(plain), _numbers(offloaded)
    assert got.keys() == expected.keys() and len(got) > 400
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert "device map:" in printed and "disk:" in printed and "peak RSS" in printed


def test_a_file_that_is_not_gguf_is_refused_in_one_line(checkpoint, tmp_path, capsys):
    """A .gguf file that the GGUF parser cannot read gives one line naming it, loaded whole or offloaded, from every
    command that loads a model; a bad --max-memory is named too."""
    path, text, _ = checkpoint
    for content in (b"GGUF", b"not a gguf file at all, " * 8):
        bad = tmp_path / "model.gguf"
        bad.write_bytes(content)
        for extra in ([], ["--max-memory", "1GiB"]):
            line = _error(capsys, ["evaluate", str(bad), "--text", str(text), *extra])
            assert "not a readable GGUF file" in line and "model.gguf" in line
            line = _error(capsys, ["analyze", str(bad), "--text", str(text), "--out", str(tmp_path / "o"), *extra])
            assert "not a readable GGUF file" in line
    line = _error(capsys, ["analyze", str(path), "--text", str(text), "--max-memory", "lots"])
    assert "--max-memory" in line and "4GiB" in line


def test_analyze_failing_to_load_leaves_no_claimed_folder(checkpoint, tmp_path, capsys):
    """A model that fails to load after --out was claimed (here: its weights file cut short) gives one line naming
    the file and leaves no empty claimed folder behind when --out did not exist before; a folder that existed before
    is left where it was."""
    import shutil

    path, text, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    argv = ["analyze", str(broken), "--text", str(text), "--seq-len", "16", "--max-tokens", "64", "--out"]
    out = tmp_path / "report"
    assert "model.safetensors: not a readable safetensors file" in _error(capsys, [*argv, str(out)])
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert "not a readable safetensors file" in _error(capsys, [*argv, str(kept)])
    assert kept.is_dir()
