"""`benchmarks/gguf_sizes.py`: a GGUF file's parts (header, tensors by group, padding) add up to its size, each group
holds the tensors it names, and the ratios to the baseline are the files' own."""

from __future__ import annotations

import pytest
from conftest import benchmark_modules
from gguf_helpers import BASE, CASES, export_f32

from relational_hf.modeling import RelationalConfig, RelationalForCausalLM

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_sizes():
    with benchmark_modules("gguf_sizes") as (module,):
        yield module


def _export(tmp_path, name: str, **overrides):
    model = RelationalForCausalLM(RelationalConfig(**(BASE | overrides))).eval()
    path = tmp_path / f"{name}.gguf"
    export_f32(model, path)
    return path, model


def test_the_parts_add_up_to_the_file_and_each_group_holds_its_tensors(tmp_path, gguf_sizes):
    path, model = _export(tmp_path, "uniform", gauge="free", tie_word_embeddings=False)
    parts = gguf_sizes.breakdown(path)
    assert parts["header"] + parts["tensors"] + parts["padding"] == parts["file"] == path.stat().st_size
    assert sum(parts["groups"].values()) == sum(parts["groups_by_type"].values()) == parts["tensors"]
    assert 0 < parts["vocabulary"] < parts["header"]
    cfg = model.config
    d, ff, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    assert parts["groups"]["embedding"] == parts["groups"]["output head"] == 4 * cfg.vocab_size * d  # f32
    assert parts["groups"]["MLP down"] == 4 * layers * d * ff
    assert parts["groups"]["MLP gate and up"] == 2 * parts["groups"]["MLP down"]
    assert parts["groups_by_type"]["MLP down (F32)"] == parts["groups"]["MLP down"]


def test_ratios_separate_what_both_files_hold_alike(tmp_path, gguf_sizes):
    """A model with narrower SwiGLU widths: its tensors shrink by the MLP bytes it lost; the file by the same bytes,
    so the file's ratio, with the header both hold, lies between the tensors' ratio and 1."""
    wide, _ = _export(tmp_path, "wide", gauge="pivot")
    narrow, _ = _export(tmp_path, "narrow", **CASES["pivot-per-layer-widths"])
    parts = {p.name: gguf_sizes.breakdown(p) for p in (wide, narrow)}
    r = gguf_sizes.ratios(parts, wide.name)[narrow.name]
    lost = parts[wide.name]["groups"]["MLP down"] - parts[narrow.name]["groups"]["MLP down"]
    assert lost == 4 * BASE["hidden_size"] * (40 - 24)  # one layer of two narrowed from 40 to 24 units
    assert r["tensors"] < r["file"] < 1.0
    assert r["tensors"] == parts[narrow.name]["tensors"] / parts[wide.name]["tensors"]


def test_missing_or_clashing_files_are_refused_in_one_line(tmp_path, gguf_sizes):
    path, _ = _export(tmp_path, "m", gauge="free")
    with pytest.raises(SystemExit, match="no such GGUF file: .*absent.gguf"):
        gguf_sizes.main(["--files", str(path), str(tmp_path / "absent.gguf")])
    (tmp_path / "other").mkdir()
    twin = tmp_path / "other" / "m.gguf"
    twin.write_bytes(path.read_bytes())
    with pytest.raises(SystemExit, match="share a name"):
        gguf_sizes.main(["--files", str(path), str(twin)])
