"""Shared checks of the per-family test modules (tests/test_family_*.py): tiny checkpoints of a family's own
Transformers classes with random norm gains and biases, run through every command as a user would (`main`), and the
properties each command must keep (exact logits, honest stored counts, one-line refusals)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from relational_hf.commands.main import main
from relational_hf.symmetry import apply_random_symmetry, redundancy_report, symmetry_groups

#: byte-level tokenizer vocabulary (`relational_hf.lm.data.byte_level_tokenizer`): 256 bytes + pad, bos, eos
VOCAB = 259
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: d = 32, 3 layers, 4 query heads of width 8, 2 key/value heads, SwiGLU 48
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    **TOKENS,
)
D, F, L, HKV, DH = 32, 48, 3, 2, 8
O_D = D * (D - 1) // 2


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 1, scale: float = 0.3, weights: float = 3.0) -> torch.nn.Module:
    """Random norm gains (1 + scale N(0, 1)) and biases (scale N(0, 1)), weight matrices x `weights` (logits of
    order one): gains and biases at 1 and 0 would hide folding mistakes. Eval mode, fp32."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = scale * torch.randn(p.shape, generator=generator)
        if p.ndim == 1:
            p.copy_(1 + noise if name.endswith("norm.weight") else noise)
        else:
            p.mul_(weights)
    return model.float().eval()


def token_ids(batch: int = 2, length: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def save(model: torch.nn.Module, folder: Path) -> Path:
    """`model` and the byte-level tokenizer saved to `folder` (a checkpoint the commands read)."""
    from relational_hf.lm.data import byte_level_tokenizer

    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return folder


def text_file(folder: Path) -> Path:
    path = folder / "text.txt"
    if not path.exists():
        words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jovial bank clerk. "
        path.write_text(words * 40)
    return path


def run(argv: list, capsys, code: int = 0) -> tuple[str, str]:
    """`relational-hf ARGV` through the command line's entry; its exit status must be `code`. (stdout, stderr)"""
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert status == code, err[-3000:]
    assert "Traceback" not in err
    return out, err


def error_line(err: str) -> str:
    """The one error line of a refused command (progress bars aside)."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if "error" in line.lower()]
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("relational-hf "), lines[0]
    return lines[0]


def load(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def relative_logit_difference(reference: torch.nn.Module, other: torch.nn.Module, ids: torch.Tensor) -> float:
    """max |logit difference| / max(1, max |reference logit|)."""
    a, b = reference(ids).logits, other(ids).logits
    return float((a - b).abs().max()) / max(1.0, float(a.abs().max()))


def stored(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def assert_random_symmetry_keeps_logits(model: torch.nn.Module, seed: int = 7) -> None:
    """A random element of every counted group moves the stored parameters and leaves the logits unchanged."""
    ids = token_ids()
    moved = apply_random_symmetry(copy.deepcopy(model), torch.Generator().manual_seed(seed), scale=0.5)
    raw = max((a - b).abs().max().item() for a, b in zip(model.parameters(), moved.parameters(), strict=True))
    assert raw > 1e-2, "the group element must move the stored parameters"
    assert relative_logit_difference(model, moved, ids) < 1e-5


def orbit_rank(model: torch.nn.Module) -> tuple[int, int]:
    """(numerical rank of the vertical map xi of all groups together, the sum of the counted dimensions), float64:
    random algebra elements (adjoints of random probes) oversample each group by 4 columns."""
    model = copy.deepcopy(model).double()
    groups, _ = symmetry_groups(model)
    params = {id(s.param): s.param for g in groups for s in g.slots()}
    generator = torch.Generator().manual_seed(0)
    columns = []
    for g in groups:
        own = {id(s.param): s.param for s in g.slots()}
        for _ in range(g.dimension() + 4):
            probe = {k: torch.randn(p.shape, generator=generator, dtype=torch.float64) for k, p in own.items()}
            out = {k: torch.zeros(p.shape, dtype=torch.float64) for k, p in params.items()}
            g.vertical(g.adjoint(probe), out)
            columns.append(torch.cat([t.reshape(-1) for t in out.values()]))
    sv = torch.linalg.svdvals(torch.stack(columns, 1))
    return int((sv > 1e-9 * sv[0]).sum()), sum(g.dimension() for g in groups)


def redundancy_json(folder: Path, tmp: Path, capsys, *extra) -> dict:
    path = tmp / f"redundancy{len(list(tmp.glob('redundancy*.json')))}.json"
    run(["redundancy", folder, "--json", path, "--no-descriptors", *extra], capsys)
    return json.loads(path.read_text())


def assert_redundancy_commands(model, folder: Path, tmp: Path, capsys, expected: dict) -> None:
    """The in-memory report, `redundancy` streamed from the checkpoint and `redundancy --no-stream` all count
    `expected` by group."""
    assert redundancy_report(model, descriptors=False).by_group == expected
    assert redundancy_json(folder, tmp, capsys)["by_group"] == expected
    assert redundancy_json(folder, tmp, capsys, "--no-stream")["by_group"] == expected


def assert_analyze(folder: Path, tmp: Path, capsys, layers: int = L) -> None:
    """`analyze` measures every site on every layer of the model as it is."""
    out = tmp / "analysis"
    argv = ["analyze", folder, "--text", text_file(tmp), "--out", out, "--seq-len", 32, "--max-tokens", 96]
    run([*argv, "--no-per-layer"], capsys)
    found = json.loads(next(out.glob("*.json")).read_text())
    text = json.dumps(found)
    for site in ("residual_attention", "residual_mlp", "block", "value", "value_exclude_self"):
        assert site in text, site
    assert f'"layer": {layers - 1}' in text or f'"{layers - 1}"' in text


def convert_both_ways(source, folder: Path, tmp: Path, capsys) -> tuple[Path, dict]:
    """`convert` streamed (the default for a safetensors folder) and `convert --no-stream`: both checkpoints load with
    AutoModelForCausalLM, hold the same tensors, give the source's logits (< 1e-4 of the logit scale) and store exactly
    the count their report expects. Returns (the streamed checkpoint, its report)."""
    streamed, in_memory = tmp / "relational", tmp / "relational_in_memory"
    run(["convert", folder, streamed], capsys)
    run(["convert", folder, in_memory, "--no-stream"], capsys)
    ids = token_ids(batch=3, length=24, seed=9)
    reports = {}
    for path in (streamed, in_memory):
        model = load(path)
        assert type(model).__name__ == "RelationalForCausalLM"
        assert relative_logit_difference(source, model, ids) < 1e-4
        reports[path] = json.loads((path / "conversion_report.json").read_text())
        assert stored(model) == reports[path]["relational_parameters"] == reports[path]["expected_parameters"]
    a, b = load(streamed).state_dict(), load(in_memory).state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    return streamed, reports[streamed]


def assert_remote_code_load(folder: Path, tmp: Path, source, ids: torch.Tensor) -> None:
    """In a process that cannot import relational_hf, the converted checkpoint loads with trust_remote_code (its code
    files travel with it, the new options included) and gives the source's logits."""
    torch.save({"ids": ids, "logits": source(ids).logits.detach()}, tmp / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["relational_hf"] = None
        import torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert "relational_hf" not in type(m).__module__, type(m).__module__
        exp = torch.load({str(tmp / "expected.pt")!r})
        with torch.no_grad():
            got = m(exp["ids"]).logits
        rel = (got - exp["logits"]).abs().max().item() / max(1.0, exp["logits"].abs().max().item())
        assert rel < 1e-4, rel
        print("ok", rel)
    """)
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def assert_compress(src: Path, tmp: Path, capsys, name: str = "compressed", *extra) -> torch.nn.Module:
    """`compress --remove 0.1`: the saved model stores exactly what the report says and the closed form of its config
    (every layer's maps as `layer_kind_parameters` counts them), keeps a tied head tied, loads with
    AutoModelForCausalLM and generates."""
    from relational_hf.compress.budget import layer_kind_parameters
    from relational_hf.params import relational_parameter_count

    out = tmp / name
    argv = ["compress", src, out, "--remove", 0.1, "--calibration", text_file(tmp), "--window", 32]
    run([*argv, "--calibration-windows", 4, "--eval-windows", 2, *extra], capsys)
    report = json.loads((out / "compression_report.json").read_text())
    model = load(out)
    c = model.config
    assert report["parameters_after"] == stored(model) == relational_parameter_count(c)
    assert report["parameters_after"] < report["parameters_before"]
    for i, layer in enumerate(model.model.layers):
        widths = (("qk", c.layer_qk_rank(i)), ("vo", c.layer_value_rank(i)), ("mlp", c.layer_intermediate_size(i)))
        # not truncated, outside the three kinds: the output bias, (a plain MLP's) down bias, the sandwich norms' gains
        output_bias = c.hidden_size * (int(c.attention_output_bias) + int(c.mlp_bias) + 2 * int(c.sandwich_norms))
        counted = sum(layer_kind_parameters(c, k, w, i) for k, w in widths) + output_bias
        assert sum(p.numel() for p in layer.parameters()) == counted
    if c.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = token_ids(batch=1, length=5)
    out_ids = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out_ids.shape == (1, 8)
    model.compression_report = report
    return model


def assert_canonicalize(folder: Path, tmp: Path, capsys, reference, name: str, *extra) -> None:
    """`canonicalize` (with `extra` options) writes a checkpoint with the same function."""
    out = tmp / name
    run(["canonicalize", folder, out, *extra], capsys)
    assert relative_logit_difference(reference, load(out), token_ids()) < 1e-4


def perplexity_of(folder: Path, tmp: Path, capsys) -> float:
    path = tmp / f"evaluate{len(list(tmp.glob('evaluate*.json')))}.json"
    run(["evaluate", folder, "--text", text_file(tmp), "--window", 32, "--windows", 4, "--json", path], capsys)
    found = json.loads(path.read_text())
    values = [v for k, v in _flatten(found) if k.endswith("perplexity")]
    assert values, found
    return float(values[0])


def _flatten(value, prefix: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _flatten(v, f"{prefix}.{i}")
    else:
        yield prefix, value


def assert_finetune(folder: Path, tmp: Path, capsys, name: str, *extra) -> torch.nn.Module:
    """`finetune` runs two steps and saves a model that loads and differs from where it started."""
    out = tmp / name
    argv = ["finetune", folder, "--train-file", text_file(tmp), "--max-steps", 2, "--block-size", 32]
    run([*argv, "--eval-blocks", 1, "--output-dir", out, "--learning-rate", 1e-3, *extra], capsys)
    tuned, start = load(out / "merged" if "--merge" in extra else out), load(folder)
    ids = token_ids()
    assert relative_logit_difference(start, tuned, ids) > 1e-6
    return tuned


#: the groups whose balance projected updates conserve to second order in the step (the head-space gauges, the
#: gated-MLP scales, the QK-norm gain exchange and the norm gains)
PROJECTED_GROUPS = ("qk_gauge", "vo_gauge", "mlp_scale", "qk_norm_gain_exchange", "norm_gain")


def _balances(groups) -> dict[str, list[torch.Tensor]]:
    return {g.key: [b.detach().clone() for b in g.balance()] for g in groups if g.name in PROJECTED_GROUPS}


def assert_trainer_projection_and_suppression(model, tmp: Path) -> None:
    """The Trainer on the model as it is: with projected updates the balance of every head-space group, MLP scale,
    QK-norm exchange and norm gain drifts far less than with plain AdamW (each step horizontal), and value-site
    parallel suppression adds its logged term lambda * mean cos^2 in (0, lambda]."""
    from relational_hf import RelationalTrainer, RelationalTrainingArguments
    from relational_hf.symmetry import ProjectedOptimizer

    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(32):
        ids = (torch.arange(16) + torch.randint(0, 7, (1,), generator=g)) % 7 + 3
        data.append({"input_ids": ids, "labels": ids})
    start = copy.deepcopy(model.state_dict())
    groups, _ = symmetry_groups(model)  # the groups at the start (training may break some, e.g. equal QK-norm gains)
    reference = _balances(groups)
    assert reference, "the family has groups to project"
    drift, logs = {}, {}
    for projection in ("none", "update"):
        model.load_state_dict(start)
        args = RelationalTrainingArguments(
            output_dir=str(tmp / projection), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-3,
            logging_steps=4, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
            symmetry_projection=projection, parallel_suppression_coef=0.1, parallel_suppression_site="value",
        )  # fmt: skip
        trainer = RelationalTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        assert isinstance(trainer.optimizer.optimizer, ProjectedOptimizer) == (projection == "update")
        logs[projection] = trainer.state.log_history[0]
        after = _balances(groups)
        drift[projection] = sum(float((a - b).norm()) for k in reference for a, b in zip(after[k], reference[k]))
    model.load_state_dict(start)
    assert drift["update"] < 0.2 * drift["none"], drift
    assert 0 < logs["update"]["parallel_suppression"] <= 0.1


def assert_slice(source) -> None:
    """`to_relational(slice_fraction=0.25)` (what `convert --slice` runs): the residual width shrinks by a quarter
    and the sliced model stores exactly what its report and the closed form of its config say."""
    from relational_hf.convert import to_relational
    from relational_hf.params import relational_parameter_count

    calibration = token_ids(batch=8, length=32, seed=3)
    sliced, report = to_relational(source, slice_fraction=0.25, calibration_data=calibration, return_report=True)
    assert sliced.config.hidden_size == source.config.hidden_size * 3 // 4
    assert stored(sliced) == report.slicing.parameters_after == relational_parameter_count(sliced.config)
    assert torch.isfinite(sliced(token_ids()).logits).all()
