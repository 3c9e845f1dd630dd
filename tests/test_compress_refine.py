"""Refinement of the compressed SwiGLU blocks (`compress.refine`): it never returns a block that fits its held-back
windows worse than the closed form, it recovers a block that can be recovered, it is deterministic, the compression
keeps its widths with it, and bad settings are refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relational_hf.commands.main import main
from relational_hf.compress.refine import RefineOptions, refine_mlp, swiglu, weighted_error
from relational_hf.jobs import compress_model

D, FF, WINDOWS, T = 12, 10, 8, 64


def _block(seed: int, width: int = FF) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(width, D, generator=g) / D**0.5,
        "up": torch.randn(width, D, generator=g) / D**0.5,
        "down": torch.randn(D, width, generator=g) / width**0.5,
    }


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(WINDOWS * T, D, generator=g)
    w = torch.rand(WINDOWS * T, generator=g) + 0.5
    return x, w


def _held(n_held: int):
    return slice((WINDOWS - n_held) * T, None)


def test_refinement_recovers_a_perturbed_block_and_reports_its_held_out_error():
    """Targets made by a teacher block of the same width: a perturbed copy of it, refined, fits the held-back rows
    far better than before, and the record's errors are the held-back errors of the given and returned weights."""
    x, w = _data()
    teacher = _block(1)
    y = swiglu(teacher, F.silu, x)
    start = {k: v + 0.3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) for k, v in teacher.items()}
    opts = RefineOptions(epochs=30, lr=1e-2, held_out=2, batch_tokens=64)
    refined, record = refine_mlp(start, F.silu, x, y, w, WINDOWS, opts)
    held = _held(2)
    before = weighted_error(start, F.silu, x[held], y[held], w[held])
    after = weighted_error(refined, F.silu, x[held], y[held], w[held])
    assert record["refine_held_out_error_before"] == pytest.approx(before, rel=1e-6)
    assert record["refine_held_out_error_after"] == pytest.approx(after, rel=1e-6)
    assert after < 0.2 * before and record["refine_epoch"] >= 1
    assert {k: v.shape for k, v in refined.items()} == {k: v.shape for k, v in start.items()}


def test_refinement_never_returns_a_block_worse_on_the_held_back_windows():
    """With a learning rate that only makes things worse, the given weights come back unchanged (epoch 0); with any
    rate, the held-back error returned is at most the given one."""
    x, w = _data(3)
    y = swiglu(_block(4, 16), F.silu, x) + 0.1 * torch.randn(x.shape[0], D, generator=torch.Generator().manual_seed(5))
    start = _block(6)
    for lr in (1e-3, 1e-1, 10.0):
        refined, record = refine_mlp(start, F.silu, x, y, w, WINDOWS, RefineOptions(epochs=3, lr=lr, held_out=3))
        assert record["refine_held_out_error_after"] <= record["refine_held_out_error_before"]
        if record["refine_epoch"] == 0:
            assert all(torch.equal(refined[k], start[k]) for k in start)
    _, record = refine_mlp(start, F.silu, x, y, w, WINDOWS, RefineOptions(epochs=3, lr=10.0, held_out=3))
    assert record["refine_epoch"] == 0


def test_refinement_is_deterministic_for_a_seed():
    x, w = _data(7)
    y = swiglu(_block(8), F.silu, x)
    start = _block(9)
    a, _ = refine_mlp(start, F.silu, x, y, w, WINDOWS, RefineOptions(epochs=2, lr=1e-2, held_out=2, batch_tokens=32))
    b, _ = refine_mlp(start, F.silu, x, y, w, WINDOWS, RefineOptions(epochs=2, lr=1e-2, held_out=2, batch_tokens=32))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        (RefineOptions(epochs=-1), "refine_epochs"),
        (RefineOptions(lr=0.0), "refine_lr"),
        (RefineOptions(lr=float("nan")), "refine_lr"),
        (RefineOptions(held_out=0), "refine_holdout"),
        (RefineOptions(held_out=WINDOWS), "leave calibration windows"),
        (RefineOptions(batch_tokens=0), "refine_batch_tokens"),
        (RefineOptions(batch_tokens=2.5), "refine_batch_tokens"),
    ],
)
def test_refinement_refuses_settings_that_cannot_run(opts, needle):
    x, w = _data()
    with pytest.raises(ValueError, match=needle):
        refine_mlp(_block(0), F.silu, x, x, w, WINDOWS, opts)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def test_compression_with_refinement_keeps_the_widths_and_improves_every_layer_on_its_held_back_windows():
    """The same plan with and without refinement: identical widths and stored size; each layer's record says the
    refined block fits its held-back windows at least as well as the closed form."""
    torch.manual_seed(0)
    model = _llama()
    ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(1))
    options = dict(mlp_step=16, plan_windows=4, batch_size=2)
    _, plain = compress_model(model, remove=0.3, calibration=ids, progress=False, **options)
    refined, report = compress_model(
        model, remove=0.3, calibration=ids, progress=False, refine_epochs=4, refine_lr=1e-3, **options
    )
    assert report["widths"] == plain["widths"] and report["parameters_after"] == plain["parameters_after"]
    assert len(report["refits"]) == 2 and report["options"]["refine_epochs"] == 4
    for record in report["refits"]:
        assert record["refine_held_out_error_after"] <= record["refine_held_out_error_before"]
    assert any(r["refine_epoch"] > 0 for r in report["refits"])


def test_the_refinement_step_size_reaches_the_descent_and_the_report():
    """`refine_batch_tokens` is a compression option: the report records the step the refinement took (the default
    when not given), a bad one is refused before anything runs, and another step gives the same widths with other
    weights (the setting reached the descent)."""
    from relational_hf.compress.refine import DEFAULT_REFINE_BATCH_TOKENS

    model = _llama()
    ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(1))
    options = dict(mlp_step=16, plan_windows=4, batch_size=2, refine_epochs=4, refine_lr=1e-3)
    default, report = compress_model(model, remove=0.3, calibration=ids, progress=False, **options)
    assert report["options"]["refine_batch_tokens"] == DEFAULT_REFINE_BATCH_TOKENS
    small, report_small = compress_model(
        model, remove=0.3, calibration=ids, progress=False, refine_batch_tokens=64, **options
    )
    assert report_small["options"]["refine_batch_tokens"] == 64 and report_small["widths"] == report["widths"]
    assert any(r["refine_epoch"] > 0 for r in report_small["refits"])
    assert any(not torch.equal(a, b) for a, b in zip(default.state_dict().values(), small.state_dict().values()))
    with pytest.raises(ValueError, match="refine_batch_tokens"):
        compress_model(model, remove=0.3, calibration=ids, progress=False, refine_batch_tokens=0, **options)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--refine-epochs", "-1"], "--refine-epochs"),
        (["--refine-epochs", "0", "--refine-lr", "1e-3"], "--refine-lr sets"),
        (["--refine-lr", "1e-3", "--method", "slice"], "--refine-lr sets"),
        (["--refine-epochs", "2", "--refine-lr", "0"], "--refine-lr"),
        (["--refine-epochs", "2", "--calibration-windows", "1"], "--calibration-windows >= 2"),
        (["--refine-epochs", "2", "--method", "slice", "--slice-fraction", "0.1"], "--method relational"),
    ],
)
def test_cli_refuses_bad_refinement_settings_in_one_line(tmp_path, capsys, extra, needle):
    src = tmp_path / "src"
    _llama().save_pretrained(src)
    text = tmp_path / "t.txt"
    text.write_text("words " * 400)
    code = main(["compress", str(src), str(tmp_path / "out"), "--remove", "0.2", "--calibration", str(text), *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_cli_refine_epochs_reach_the_compression_on_either_path(tmp_path, capsys, byte_llama_checkpoint, stream):
    """`compress --refine-epochs N --refine-lr LR` reaches the compression's options on the streamed and in-memory
    paths: the report records them and one refinement record per layer, none worse on its held-back windows."""
    import json

    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    args = ["compress", str(byte_llama_checkpoint), str(out), "--remove", "0.1", "--calibration", str(text), "--window",
            "32", "--calibration-windows", "4", "--refine-epochs", "2", "--refine-lr", "1e-3", stream]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads((out / "compression_report.json").read_text())
    assert report["options"]["refine_epochs"] == 2 and report["options"]["refine_lr"] == 1e-3
    layers = len(report["widths"]["mlp"])
    assert len(report["refits"]) == layers >= 1
    assert all(r["refine_held_out_error_after"] <= r["refine_held_out_error_before"] for r in report["refits"])


def test_compress_help_quotes_the_refinement_default_the_run_uses():
    """The command's help states the learning rate a refinement without --refine-lr runs at (the help is built
    without importing the compression package, so it repeats the figure; this keeps the two equal)."""
    from relational_hf.commands.compress import CompressOptions
    from relational_hf.compress.options import LowRankOptions
    from relational_hf.compress.refine import DEFAULT_REFINE_LR

    assert LowRankOptions().refine_lr == DEFAULT_REFINE_LR
    import re

    quoted = re.search(r"\(default: ([0-9.e+-]+)\)", CompressOptions.__dataclass_fields__["refine_lr"].metadata["help"])
    assert quoted and float(quoted.group(1)) == DEFAULT_REFINE_LR


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_cli_plan_error_reaches_the_plan_on_either_path(tmp_path, capsys, byte_llama_checkpoint, stream):
    """`compress --plan-error token` plans in the token currency on the streamed and in-memory paths: the report
    records it, and the stored size still meets the budget; without the option the report keeps the Fisher plan."""
    import json

    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    reports = {}
    for error in ("token", None):
        out = tmp_path / f"out-{error}"
        args = ["compress", str(byte_llama_checkpoint), str(out), "--remove", "0.2", "--calibration", str(text),
                "--window", "32", "--calibration-windows", "4", "--refine-epochs", "0", stream]  # fmt: skip
        assert main(args + (["--plan-error", error] if error else [])) == 0, capsys.readouterr().err
        reports[error] = json.loads((out / "compression_report.json").read_text())
    assert reports["token"]["options"]["sensitivity"] == "token"
    assert reports[None]["options"]["sensitivity"] == "fisher"
    for report in reports.values():
        assert report["parameters_after"] <= 0.8 * report["parameters_before"] + 1


def test_cli_refuses_plan_error_for_the_slice_method_in_one_line(tmp_path, capsys):
    src = tmp_path / "src"
    _llama().save_pretrained(src)
    text = tmp_path / "t.txt"
    text.write_text("words " * 400)
    args = ["compress", str(src), str(tmp_path / "out"), "--remove", "0.2", "--calibration", str(text),
            "--method", "slice", "--plan-error", "token"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--plan-error sets" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert main([*args[:-2], "--plan-error", "kl"]) == 2
    assert "--plan-error" in capsys.readouterr().err


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_the_plan_reads_the_first_plan_windows_alone_on_either_path(tmp_path, capsys, byte_llama_checkpoint, stream):
    """`compress --plan-windows N` plans on the first N calibration windows: the report records N, and two
    calibrations that share their first N windows but not the others get the same widths (and other weights, which
    every window fits); N is refused below 1 and with the slice method, in one line."""
    import json

    first = "the quick brown fox jumps over the lazy dog. " * 12
    reports = []
    for i, rest in enumerate(("numbers 0123456789 and symbols %$#@! " * 12, "a completely different tail text. " * 12)):
        text = tmp_path / f"cal{i}.txt"
        text.write_text(first + rest)
        out = tmp_path / f"out{i}"
        args = ["compress", str(byte_llama_checkpoint), str(out), "--remove", "0.3", "--calibration", str(text),
                "--window", "64", "--calibration-windows", "12", "--refine-epochs", "0", "--plan-windows", "4", "--self-calibration",
                "0", stream]  # fmt: skip
        assert main(args) == 0, capsys.readouterr().err
        reports.append(json.loads((out / "compression_report.json").read_text()))
    assert reports[0]["options"]["plan_windows"] == 4
    assert reports[0]["widths"] == reports[1]["widths"]
    weights = [(tmp_path / f"out{i}" / "model.safetensors").read_bytes() for i in (0, 1)]
    assert weights[0] != weights[1]  # the fits read every window: the two calibrations differ past the plan's
    base = ["compress", str(byte_llama_checkpoint), str(tmp_path / "bad"), "--remove", "0.3", "--calibration",
            str(tmp_path / "cal0.txt")]  # fmt: skip
    for extra in (["--plan-windows", "0"], ["--plan-windows", "2", "--method", "slice"]):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert "--plan-windows" in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()
    from tiny_models import tiny_relational

    from relational_hf.compress.lowrank import LowRankOptions, compress_relational

    with pytest.raises(ValueError, match="plan_windows"):
        compress_relational(tiny_relational(), torch.zeros(2, 8, dtype=torch.long), 10**6, LowRankOptions(plan_windows=0))
