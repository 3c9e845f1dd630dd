"""Checks shared by the per-family test modules (tests/test_family_*.py): random norm gains and biases, a random
element of every counted group, and the dimension of the symmetry orbit measured numerically (the null space of the
Jacobian of the logits with respect to every parameter, in float64)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, jacrev
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from relational_hf.symmetry import apply_random_symmetry, redundancy_report

#: an eager attention kernel with its softmax in the inputs' dtype (Transformers' eager kernels take the softmax in
#: float32, which would blur the float64 null space by 1e-8)
EXACT_ATTENTION = "relational_hf_tests_exact"


def _exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    weights = scores.softmax(-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


AttentionInterface.register(EXACT_ATTENTION, _exact_attention)
AttentionMaskInterface.register(EXACT_ATTENTION, eager_mask)  # additive float masks, as eager kernels take


@torch.no_grad()
def randomize_gains_and_biases(model: nn.Module, seed: int = 1, scale: float = 0.3) -> nn.Module:
    """Every one-dimensional parameter (norm gains, QK-norm gains, biases) moved by a random amount: gains and biases
    at their initial 1 / 0 would hide folding mistakes."""
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.ndim == 1:
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


@torch.no_grad()
def nonlinear_weights(model: nn.Module, seed: int = 2) -> nn.Module:
    """Every matrix redrawn at unit scale (std 1 / sqrt(fan-in)): at the usual 0.02 a tiny model runs in the nearly
    linear range of its activations and softmax, where many directions are almost null and the measured null space
    is blurred."""
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.ndim == 2:
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) / p.shape[1] ** 0.5)
    return model


def largest_logit_change_under_random_symmetry(model: nn.Module, ids: torch.Tensor, seed: int = 7) -> float:
    """max |logits(g . theta) - logits(theta)| for a random element g of every counted group (all at once); asserts
    that g really moves the parameters."""
    before = model(ids).logits
    moved = apply_random_symmetry(copy.deepcopy(model), torch.Generator().manual_seed(seed), scale=0.5)
    raw = max((a - b).abs().max().item() for a, b in zip(model.parameters(), moved.parameters(), strict=True))
    assert raw > 1e-2, "the group element must actually move the stored parameters"
    return (moved(ids).logits - before).abs().max().item()


def measured_orbit_dimension(model: nn.Module, vocab: int, length: int, rows: int = 32) -> tuple[int, float]:
    """(nullity of the Jacobian d logits / d theta, its gap in decades): float64, on `rows` random rows of `length`
    tokens that hold every token id, so no embedding row is trivially free (an embedding's `padding_idx` is cleared
    in the copy: torch's lookup gives that row no gradient, which would count it as free). The rank is where the singular values
    drop the most (a clean null space drops by many decades)."""
    model = copy.deepcopy(model).double().eval()
    model.set_attn_implementation(EXACT_ATTENTION)
    for module in model.modules():  # reverse mode gives a padding row no gradient from the lookup: not a symmetry
        if isinstance(module, nn.Embedding):
            module.padding_idx = None
    params = {n: p.detach() for n, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    ids.view(-1)[:vocab] = torch.arange(vocab)
    jac = jacrev(lambda p: functional_call(model, p, (ids,)).logits.reshape(-1))(params)
    matrix = torch.cat([j.reshape(j.shape[0], -1) for j in jac.values()], 1)
    s = torch.linalg.svdvals(matrix)
    logs = (s / s[0]).clamp_min(1e-300).log10()
    drops = logs[:-1] - logs[1:]
    rank = int(drops.argmax()) + 1
    return matrix.shape[1] - rank, float(drops.max())


def counted_dimension(model: nn.Module) -> int:
    return redundancy_report(model, descriptors=False).redundant_dimensions


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`relational-hf ARGV` in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    from relational_hf.commands import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_refused_in_one_line(command: str, argv: list[str], *features: str) -> None:
    """`relational-hf COMMAND ARGV` exits 2 with one error line naming every feature, and writes no output folder."""
    code, _, err = run_cli([command, *argv])
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"relational-hf {command}: error: unsupported: "), err
    for feature in features:
        assert feature in lines[0], lines[0]


def site_updates(model: nn.Module, ids: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
    """The update y every residual site reads, per (site, layer), in one forward pass."""
    from relational_hf.directional.sites import tap_sites

    seen: dict[tuple[str, int], torch.Tensor] = {}

    def record(site, layer, y, z):
        seen[(site, layer)] = y.detach().clone()

    with torch.no_grad(), tap_sites(model, ("residual_attention", "residual_mlp", "block"), record):
        model(ids)
    return seen


def assert_site_updates_add_up(model: nn.Module, vocab: int, layers: int) -> None:
    """What the residual sites read is what enters the stream: per layer, attention update + MLP update = the
    layer's update (`site_updates` on two random rows)."""
    seen = site_updates(model, torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(2)))
    for layer in range(layers):
        total = seen[("residual_attention", layer)] + seen[("residual_mlp", layer)]
        torch.testing.assert_close(total, seen[("block", layer)], atol=1e-5, rtol=1e-5)


def analyze_report(model: nn.Module, tmp_path, vocab: int) -> dict:
    """`relational-hf analyze` of `model` saved to tmp_path/src, on 96 random token ids (every site, no sweep, no
    per-layer plots, no compression): its report.json, after asserting the command succeeded."""
    import json

    model.save_pretrained(tmp_path / "src")
    torch.save(torch.randint(0, vocab, (96,), generator=torch.Generator().manual_seed(0)), tmp_path / "ids.pt")
    code, _, err = run_cli([
        "analyze", str(tmp_path / "src"), "--text", str(tmp_path / "ids.pt"), "--out", str(tmp_path / "out"),
        "--seq-len", "16", "--sweep-values", "0", "--no-per-layer", "--compression", "none",
    ])  # fmt: skip
    assert code == 0, err
    return json.loads((tmp_path / "out" / "report.json").read_text())


def train_projected_and_suppressed(model: nn.Module, tmp_path, vocab: int, site: str = "value") -> dict:
    """Four steps of RelationalTrainer with projected updates and parallel suppression at `site`; the last log."""
    from relational_hf.training import RelationalTrainer, RelationalTrainingArguments

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (16, 12), generator=generator)]
    args = RelationalTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4, learning_rate=1e-2, logging_steps=4,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, symmetry_projection="update",
        parallel_suppression_coef=0.3, parallel_suppression_site=site,
    )  # fmt: skip
    trainer = RelationalTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.optimizer.optimizer.projected_steps == 4
    return [entry for entry in trainer.state.log_history if "loss" in entry][-1]


def projected_update_is_horizontal(model: nn.Module, seed: int = 5) -> float:
    """The largest |xi^T(h)| / |xi^T(delta)| over the groups for a random update delta and its horizontal part h
    (`UpdateProjector.split` solved tightly, the groups the Trainer projects: all but the residual rotation): h has no
    component along their orbits."""
    from relational_hf.symmetry import symmetry_groups
    from relational_hf.symmetry.projection import UpdateProjector

    model = model.double()
    generator = torch.Generator().manual_seed(seed)
    update = {n: torch.randn(p.shape, generator=generator, dtype=torch.float64) for n, p in model.named_parameters()}
    _, horizontal = UpdateProjector(model, tol=1e-12, max_iter=300).split(update)
    by_id = {id(p): n for n, p in model.named_parameters()}
    groups, _ = symmetry_groups(model)
    worst = 0.0
    for g in groups:
        if g.name == "residual_rotation":
            continue
        own = {id(s.param) for s in g.slots()}
        before = torch.cat([t.reshape(-1) for t in g.adjoint({k: update[by_id[k]] for k in own})]).norm()
        after = torch.cat([t.reshape(-1) for t in g.adjoint({k: horizontal[by_id[k]] for k in own})]).norm()
        worst = max(worst, float(after / before))
    return worst
