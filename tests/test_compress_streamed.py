"""Layer-streamed compression (`relational_hf.compress.streamed`, `relational_hf.jobs.compress_checkpoint`): the same
model as the in-memory path to float tolerance, from Llama-family and relational checkpoints, tied or untied heads,
every sensitivity; the layer-by-layer Fisher directions equal the whole-model ones; clear errors on bad input."""

from __future__ import annotations

import json
import resource

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from relational_hf.compress.lowrank import LowRankOptions, _positions
from relational_hf.compress.sensitivity import fisher_directions, head_label_gradients, layer_fisher_step
from relational_hf.compress.streamed import RelationalCheckpointLayers, streamed_perplexity
from relational_hf.convert import to_free_gauge, to_relational
from relational_hf.convert.streaming import LlamaCheckpointLayers
from relational_hf.jobs import compress_checkpoint, compress_model
from relational_hf.lm.metrics import perplexity
from relational_hf.params import stored_parameters


def _llama(tied: bool = True, layers: int = 3, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial gains, so the folding of the layer-by-layer conversion is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _ids(n: int = 6, t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (n, t), generator=torch.Generator().manual_seed(seed))


OPTIONS = dict(mlp_step=16, plan_windows=4, batch_size=2, refine_epochs=0)


@pytest.mark.parametrize(
    ("tied", "sensitivity", "correction", "mlp_order", "refit", "gauge"),
    [
        (True, "fisher", "local", "score", {}, "free"),
        (False, "fisher", "dense", "score", {}, "free"),
        (True, "fisher", "dense", "score", {}, "pivot"),
        (True, "token", "local", "score", {}, "free"),
        (False, "relative", "none", "score", {}, "pivot"),
        (True, "fisher", "local", "greedy", {}, "free"),
        (True, "fisher", "dense", "score", {"refit_holdout": 2}, "free"),
        (False, "fisher", "dense", "score", {"refit_blend": 0.5}, "pivot"),
        (True, "fisher", "dense", "score", {"refine_epochs": 4, "refine_lr": 1e-3}, "free"),
        (True, "fisher", "dense", "auto", {"refine_epochs": None}, "free"),  # the automatic choices: greedy, refined
    ],
)
def test_streamed_equals_in_memory(tmp_path, tied, sensitivity, correction, mlp_order, refit, gauge):
    """From a Llama checkpoint on disk, the layer-streamed compression chooses the same widths as the in-memory
    `compress_model` and its saved model computes the same logits (float tolerance) in the gauge asked for; the stored
    count and the calibration perplexities of its report agree too, and so do the refits chosen on held-back windows
    and the epochs the refinement kept."""
    model = _llama(tied)
    src = tmp_path / "src"
    model.save_pretrained(src)
    ids = _ids()
    options = dict(OPTIONS, sensitivity=sensitivity, correction=correction, mlp_order=mlp_order, gauge=gauge, **refit)
    ref, ref_report = compress_model(model, remove=0.25, calibration=ids, progress=False, eval_windows=4, **options)
    out = tmp_path / "out"
    report = compress_checkpoint(src, out, remove=0.25, calibration=ids, progress=False, eval_windows=4, **options)
    assert report["widths"] == ref_report["widths"]
    chosen = ("ridge", "blend", "refine_epoch")
    assert [[r.get(k) for k in chosen] for r in report.get("refits", [])] == [
        [r.get(k) for k in chosen] for r in ref_report.get("refits", [])
    ] and len(report.get("refits", [])) == (3 if refit else 0) - (refit.get("refit_blend") is not None) * 3
    assert report["parameters_after"] == ref_report["parameters_after"] <= report["parameters_budget"]
    assert report["parameters_before"] == ref_report["parameters_before"]
    for key in ("calibration_perplexity_before", "calibration_perplexity_after"):
        assert report[key] == pytest.approx(ref_report[key], rel=1e-4)
    assert json.loads((out / "compression_report.json").read_text())["widths"] == report["widths"]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.gauge == ref.config.gauge == gauge
    assert stored_parameters(loaded)["total"] == report["parameters_after"]
    probe = _ids(3, 20, seed=7)
    with torch.no_grad():
        expected, got = ref(probe).logits, loaded(probe).logits
    assert (got - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max())
    assert len(report["layer_seconds"]) == 3 and all("compress" in s for s in report["layer_seconds"])


def test_relational_checkpoint_source_and_streamed_perplexity(tmp_path):
    """A relational checkpoint on disk is a layer source too (`remove` is then a share of ITS stored parameters, fewer
    than the Llama source's: the gauge is fixed): same widths and function as the in-memory path from the relational
    model; `streamed_perplexity` of either source equals the model's perplexity."""
    model = _llama(tied=True)
    src, rel_dir = tmp_path / "src", tmp_path / "rel"
    model.save_pretrained(src)
    rel = to_relational(model)
    rel.save_pretrained(rel_dir)
    ids = _ids()
    a = compress_checkpoint(src, tmp_path / "a", remove=0.2, calibration=ids, progress=False, **OPTIONS)
    b = compress_checkpoint(rel_dir, tmp_path / "b", remove=0.2, calibration=ids, progress=False, **OPTIONS)
    ref, ref_report = compress_model(rel, remove=0.2, calibration=ids, progress=False, **OPTIONS)
    assert b["parameters_before"] == ref_report["parameters_before"] < a["parameters_before"]
    assert b["widths"] == ref_report["widths"]
    la = AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    lb = AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    probe = _ids(2, 16, seed=3)
    with torch.no_grad():
        assert torch.allclose(lb(probe).logits, ref(probe).logits, atol=1e-4)
    dense = perplexity(model, probe)
    assert streamed_perplexity(LlamaCheckpointLayers(src), probe) == pytest.approx(dense, rel=1e-5)
    assert streamed_perplexity(RelationalCheckpointLayers(rel_dir), probe) == pytest.approx(dense, rel=1e-5)
    assert streamed_perplexity(RelationalCheckpointLayers(tmp_path / "a"), probe) == pytest.approx(
        perplexity(la, probe), rel=1e-5
    )


def test_layer_by_layer_fisher_directions_equal_the_whole_model_ones():
    """Gradients at the head with the same sampled labels, carried down one layer at a time, give the Fisher
    directions of `fisher_directions` (which back-propagates through the whole model) at every layer."""
    rel = to_relational(_llama(tied=False)).eval()
    ids = _ids(4, 16)
    whole = fisher_directions(rel, ids, samples=2, batch_size=2, dtype=torch.float32)
    positions = _positions(rel.config, ids.shape[1])
    cos, sin, mask, pos = positions

    def run(layer, x):
        return layer(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos)

    with torch.no_grad():
        hs = [rel.model.embed_tokens(ids)]
        for layer in rel.model.layers:
            hs.append(run(layer, hs[-1]))
    grads = head_label_gradients(lambda x: rel.lm_head(rel.model.norm(x)), hs[-1], samples=2, batch_size=2)
    for li in reversed(range(len(rel.model.layers))):
        grads, dirs = layer_fisher_step(rel.model.layers[li], run, hs[li], grads, batch_size=2, dtype=torch.float32)
        for site in ("attn", "mlp"):
            scale = whole[li][site].abs().max()
            assert (dirs[site] - whole[li][site]).abs().max() <= 1e-4 * scale, (li, site)
    assert all(not p.requires_grad or p.grad is None for p in rel.parameters())


def test_streamed_writes_the_source_dtype_and_shards(tmp_path):
    """The result is stored in the source's dtype on disk (bf16 here) unless asked otherwise, in shards of at most
    max_shard_size with an index, and loads."""
    model = _llama(tied=False).to(torch.bfloat16)
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "out"
    compress_checkpoint(src, out, remove=0.2, calibration=_ids(), progress=False, max_shard_size="40KB", **OPTIONS)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    with safe_open(str(shards[0]), framework="pt") as st:
        assert {st.get_tensor(k).dtype for k in st.keys() if st.get_tensor(k).is_floating_point()} == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.isfinite(loaded(_ids(1, 8)).logits).all()


def test_streamed_refuses_bad_input(tmp_path):
    """Bad arguments fail in one line before anything is written: fisher_metric (not available per layer), an
    unknown option, a bad share, a folder that is not a relational checkpoint, an OUT that is not empty."""
    model = _llama()
    src = tmp_path / "src"
    model.save_pretrained(src)
    ids = _ids()
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="fisher_metric"):
        compress_checkpoint(src, out, remove=0.2, calibration=ids, progress=False, fisher_metric=True)
    with pytest.raises(ValueError, match="unknown option"):
        compress_checkpoint(src, out, remove=0.2, calibration=ids, progress=False, mlp_stp=3)
    with pytest.raises(ValueError, match="remove"):
        compress_checkpoint(src, out, remove=1.5, calibration=ids, progress=False)
    with pytest.raises(ValueError, match="not a relational checkpoint"):
        RelationalCheckpointLayers(src)
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("data")
    with pytest.raises(Exception, match="OUT"):
        compress_checkpoint(src, out, remove=0.2, calibration=ids, progress=False)
    assert (out / "keep.txt").read_text() == "data" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_peak_memory_is_reported(tmp_path):
    """The report's peak resident memory is the process's (ru_maxrss), and per-layer seconds cover both passes."""
    model = _llama()
    src = tmp_path / "src"
    model.save_pretrained(src)
    report = compress_checkpoint(src, tmp_path / "out", remove=0.2, calibration=_ids(), progress=False, **OPTIONS)
    assert 0 < report["peak_rss_mib"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 + 1
    assert all({"fisher", "measure", "compress"} <= set(s) for s in report["layer_seconds"])
    assert LowRankOptions().sensitivity == report["options"]["sensitivity"] == "fisher"


def _cli_source(tmp_path):
    from relational_hf.lm.data import byte_level_tokenizer

    src = tmp_path / "src"
    config = LlamaConfig(
        vocab_size=259, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(src)
    byte_level_tokenizer().save_pretrained(src)
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return src, text


@pytest.mark.parametrize("mlp_order", ["score", "greedy"])
def test_cli_streams_a_safetensors_folder_like_the_in_memory_path(tmp_path, capsys, mlp_order):
    """`relational-hf compress` streams a local safetensors folder by default; --no-stream loads it whole: same
    widths, same stored count, same evaluation perplexity (float tolerance), with either --mlp-order, which both
    paths apply; both reports say how they ran."""
    from relational_hf.commands.main import main

    src, text = _cli_source(tmp_path)
    common = ["--remove", "0.2", "--calibration", str(text), "--eval", str(text), "--window", "32",
              "--calibration-windows", "4", "--eval-windows", "2", "--mlp-order", mlp_order]  # fmt: skip
    assert main(["compress", str(src), str(tmp_path / "s"), *common]) == 0, capsys.readouterr().err
    assert "one layer at a time" in capsys.readouterr().out
    assert main(["compress", str(src), str(tmp_path / "m"), *common, "--no-stream"]) == 0, capsys.readouterr().err
    streamed = json.loads((tmp_path / "s" / "compression_report.json").read_text())
    whole = json.loads((tmp_path / "m" / "compression_report.json").read_text())
    assert streamed["streamed"] is True and "streamed" not in whole
    assert streamed["options"]["mlp_order"] == whole["options"]["mlp_order"] == mlp_order
    assert streamed["widths"] == whole["widths"]
    assert streamed["parameters_after"] == whole["parameters_after"]
    assert streamed["eval_perplexity_before"] == pytest.approx(whole["eval_perplexity_before"], rel=1e-4)
    assert streamed["eval_perplexity_after"] == pytest.approx(whole["eval_perplexity_after"], rel=1e-4)
    assert (tmp_path / "s" / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_cli_gauge_is_the_gauge_written_and_counted(tmp_path, capsys, mode):
    """The command writes the free gauge by default and the gauge-fixed form with --gauge pivot, on both paths; each
    meets --remove counted in the gauge it wrote (as stored on disk), and both compute what their report's widths
    and their own weights say (the free-gauge checkpoint equals the pivot one exported to the free gauge when their
    widths agree, and is never larger than the budget)."""
    from relational_hf.commands.main import main
    from relational_hf.modeling.modeling_gauge import GaugeFixedLinear

    src, text = _cli_source(tmp_path)
    common = ["--remove", "0.2", "--calibration", str(text), "--window", "32", "--calibration-windows", "4", mode]
    reports, models = {}, {}
    for gauge, extra in (("free", []), ("pivot", ["--gauge", "pivot"])):
        out = tmp_path / gauge
        assert main(["compress", str(src), str(out), *common, *extra]) == 0, capsys.readouterr().err
        assert f"fewer, {gauge} gauge)" in capsys.readouterr().out
        reports[gauge] = json.loads((out / "compression_report.json").read_text())
        models[gauge] = AutoModelForCausalLM.from_pretrained(out).eval()
        assert models[gauge].config.gauge == gauge == reports[gauge]["options"]["gauge"]
        assert any(isinstance(m, GaugeFixedLinear) for m in models[gauge].modules()) == (gauge == "pivot")
        stored = stored_parameters(models[gauge])["total"]
        assert stored == reports[gauge]["parameters_after"] <= reports[gauge]["parameters_budget"]
        assert reports[gauge]["parameters_budget"] == int(0.8 * reports[gauge]["parameters_before"])
    assert reports["free"]["widths"] == reports["pivot"]["widths"]  # this budget: the same widths in both gauges
    probe = _ids(2, 16, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(models["free"](probe).logits, models["pivot"](probe).logits, atol=1e-4, rtol=1e-4)
    # the free gauge holds the pivot gauge's representative (well-scaled factors), not the truncation's raw factors
    exported = to_free_gauge(models["pivot"]).state_dict()
    for key, t in models["free"].state_dict().items():
        torch.testing.assert_close(t, exported[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "slice", "--gauge", "free"], "--gauge applies to --method relational"),
        (["--stream", "--heal-steps", "2"], "--heal-steps needs the whole model"),
        (["--stream", "--method", "slice"], "--method slice needs the whole model"),
        (["--no-stream", "--dtype", "bfloat16"], "--dtype and --max-shard-size apply"),
        (["--stream", "--no-stream"], "either --stream or --no-stream"),
    ],
)
def test_cli_refuses_what_streaming_cannot_do(tmp_path, capsys, extra, message):
    """Options that need the whole model (healing, the slice method) or only apply when streaming are refused in one
    line before anything is loaded or written."""
    from relational_hf.commands.main import main

    src, text = _cli_source(tmp_path)
    out = tmp_path / "out"
    assert main(["compress", str(src), str(out), "--remove", "0.2", "--calibration", str(text), *extra]) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_cli_refuses_a_share_the_planner_cannot_reach_before_the_work(tmp_path, capsys, mode):
    """A --remove that even the narrowest widths cannot meet (the embedding is not truncated) fails in one line
    naming the budget, before any layer is measured, and writes nothing."""
    from relational_hf.commands.main import main

    src, text = _cli_source(tmp_path)
    out = tmp_path / "out"
    code = main(["compress", str(src), str(out), "--remove", "0.9", "--calibration", str(text), "--window", "32",
                 "--calibration-windows", "2", mode])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "narrowest widths" in err and "Traceback" not in err and not out.exists()


def test_interrupted_streamed_compression_leaves_nothing(tmp_path, monkeypatch):
    """A failure in the middle of writing the compressed layers (here: reading layer 2 of the source raises) leaves
    no OUT folder and no staging folder beside it, and the source untouched; a second run then succeeds."""
    model = _llama()
    src = tmp_path / "src"
    model.save_pretrained(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    calls = {"n": 0}
    original = LlamaCheckpointLayers.layer

    def failing(self, index, device=None):
        calls["n"] += 1
        if calls["n"] > 3 + 2:  # pass 1 reads every layer twice (Fisher); fail inside pass 2
            raise KeyboardInterrupt
        return original(self, index, device)

    monkeypatch.setattr(LlamaCheckpointLayers, "layer", failing)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        compress_checkpoint(src, out, remove=0.2, calibration=_ids(), progress=False, **OPTIONS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    monkeypatch.setattr(LlamaCheckpointLayers, "layer", original)
    compress_checkpoint(src, out, remove=0.2, calibration=_ids(), progress=False, **OPTIONS)
    assert (out / "compression_report.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
