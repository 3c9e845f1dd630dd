"""FSDP2 through the Trainer and the commands, on 2 CPU processes (gloo) started by torchrun.

Accelerate enables its FSDP plugin only on accelerators: on CPU processes `fsdp=True` trains with DDP (the trainer
warns). The worker therefore switches Accelerate's state to FSDP right after the Trainer created it
(`emulate_fsdp_on_cpu`), which is what Accelerate itself does on GPUs: the model then goes through Accelerate's own
FSDP2 preparation (`fully_shard` of every decoder layer and of the root, the optimizer's parameters replaced by
DTensor shards), gradients are reduce-scattered, and `save_model` gathers the whole state dict.

Properties:
- the same model trained 3 AdamW steps with FSDP (2 processes x 4 sequences) and in one process (8 sequences) ends
  with the same weights, with update projection and parallel suppression on; the projection really acted (without
  it the weights differ by far more than the tolerance), and the logged orbit drift matches step by step;
- the vertical part of an update computed on the sharded model equals the one computed on the gathered weights;
- `ProjectedOptimizer` built directly on `fully_shard` DTensor parameters takes the one-process steps;
- the checkpoints written under FSDP (by `save_model`, `relational-hf finetune --fsdp` and `train --fsdp`) hold the
  model's own code files, load with `AutoModelForCausalLM` and with `trust_remote_code` without the plugin, with the
  same logits; `finetune --fsdp --resume` continues from an FSDP trainer checkpoint.

This file is also the worker torchrun starts (`python -m torch.distributed.run ... tests/test_fsdp.py OUT_DIR`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import run_on_two_processes

STEPS = 3
CONFIG = dict(vocab_size=49, hidden_size=32, intermediate_size=51, num_hidden_layers=2, num_attention_heads=4)


def emulate_fsdp_on_cpu(trainer) -> None:
    """Switch the trainer's Accelerate state to FSDP on CPU processes, as Accelerate does with accelerators. Test
    only: Accelerate has no public switch for FSDP on CPU, so its shared state is set directly."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not trainer.args.fsdp or trainer.is_fsdp_enabled:
        return
    PartialState().distributed_type = DistributedType.FSDP  # AcceleratorState copies it from here when re-created
    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


#: the optimizers the patched trainers created, newest last (the worker reads the command's)
CREATED_OPTIMIZERS: list = []


def _install_emulation() -> None:
    """Patch `RelationalTrainer` in this process: FSDP emulated on CPU, and every optimizer it creates recorded."""
    from relational_hf.training import RelationalTrainer

    create_accelerator, create_optimizer = (
        RelationalTrainer.create_accelerator_and_postprocess,
        RelationalTrainer.create_optimizer,
    )

    def create_accelerator_and_postprocess(self):
        create_accelerator(self)
        emulate_fsdp_on_cpu(self)

    def recorded_create_optimizer(self, model=None):
        CREATED_OPTIMIZERS.append(create_optimizer(self, model))
        return CREATED_OPTIMIZERS[-1]

    RelationalTrainer.create_accelerator_and_postprocess = create_accelerator_and_postprocess
    RelationalTrainer.create_optimizer = recorded_create_optimizer


def _model(gauge: str = "free", seed: int = 0, **config):
    from relational_hf import RelationalConfig, RelationalForCausalLM

    torch.manual_seed(seed)
    return RelationalForCausalLM(RelationalConfig(**CONFIG | config, gauge=gauge))


def _train(output_dir, per_device_batch: int, *, fsdp: bool, gauge="free", projection="update", steps=STEPS):
    from test_distributed import _dataset

    from relational_hf.training import RelationalTrainer, RelationalTrainingArguments

    model = _model(gauge)
    args = RelationalTrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=per_device_batch,
        max_steps=steps,
        learning_rate=1e-2,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_drop_last=True,
        symmetry_projection=projection,
        parallel_suppression_coef=2.0,
        parallel_suppression_site="residual",
        train_sampling_strategy="sequential",  # each process takes its slice of the same 8 sequences
        **({"fsdp": True, "fsdp_config": {"version": 2}} if fsdp else {}),
    )
    trainer = RelationalTrainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    return trainer


def _named_full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from relational_hf.symmetry.sharding import full_tensor

    return {name: full_tensor(p).clone() for name, p in model.named_parameters()}


def _flat(named: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([named[k].reshape(-1) for k in sorted(named)])


def _drift(logs: list[dict]) -> list[float]:
    return [entry["orbit_drift"] for entry in logs if "orbit_drift" in entry]


def _random_update(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {name: torch.randn(p.shape, generator=generator) for name, p in sorted(params.items())}


def _fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 10), generator=generator)
    return ids, ids.clone()


def _direct_steps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, steps: int = 2):
    """`steps` AdamW steps wrapped in `ProjectedOptimizer` on one batch, the loss a mean over its sequences."""
    from relational_hf.symmetry import ProjectedOptimizer

    optimizer = ProjectedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


# ---------------------------------------------------------------------------------------------------------------
# the tests (the parent process)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """One torchrun launch of the worker below; returns its output folder."""
    from relational_hf.lm.data import byte_level_tokenizer, generate_corpus

    out = tmp_path_factory.mktemp("fsdp")
    tokenizer = byte_level_tokenizer()
    special = {name: getattr(tokenizer, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    _model("free", seed=2, vocab_size=len(tokenizer), **special).save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")
    (out / "train.txt").write_text(generate_corpus(300, seed=5), encoding="utf-8")
    run_on_two_processes(__file__, out, master_port=29523, timeout=420)
    return out


def test_fsdp_trainer_matches_one_process_with_projection_and_suppression(fsdp_run, tmp_path):
    run = torch.load(fsdp_run / "trainer.pt")
    assert run["sharded"], "the worker did not train with FSDP2 (DTensor parameters)"
    assert run["projected_steps"] == STEPS and run["vertical_share"] > 1e-3  # AdamW steps have a vertical part
    single = _train(tmp_path / "single", per_device_batch=8, fsdp=False)
    single_weights = _flat(_named_full(single.model))
    torch.testing.assert_close(_flat(run["weights"]), single_weights, rtol=1e-4, atol=1e-5)
    # the projection acted: the same run without it ends far from both
    unprojected = _flat(_named_full(_train(tmp_path / "none", per_device_batch=8, fsdp=False, projection="none").model))
    assert (unprojected - single_weights).abs().max() > 100 * 1e-6
    drift_fsdp, drift_single = _drift(run["logs"]), _drift(single.state.log_history)
    assert len(drift_fsdp) == STEPS and all(d > 0 for d in drift_fsdp)
    torch.testing.assert_close(torch.tensor(drift_fsdp), torch.tensor(drift_single), rtol=1e-3, atol=1e-7)
    for key in ("task_loss", "parallel_suppression"):
        fsdp_values = [entry[key] for entry in run["logs"] if key in entry]
        single_values = [entry[key] for entry in single.state.log_history if key in entry]
        torch.testing.assert_close(torch.tensor(fsdp_values), torch.tensor(single_values), rtol=1e-4, atol=1e-6)


def test_vertical_part_on_sharded_weights_equals_the_gathered_computation(fsdp_run):
    from relational_hf.symmetry import UpdateProjector

    run = torch.load(fsdp_run / "trainer.pt")
    gathered = _model("free")
    missing, unexpected = gathered.load_state_dict(run["weights"], strict=False)  # the sharded model's weights
    assert not unexpected and not set(missing) & set(dict(gathered.named_parameters()))
    projector = UpdateProjector(gathered)
    vertical, horizontal = projector.split(run["update"])
    assert projector.last_stats.vertical_share > 0.01
    assert set(run["vertical"]) == set(vertical)
    for name, value in vertical.items():
        torch.testing.assert_close(run["vertical"][name], value, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(run["horizontal"][name], horizontal[name], rtol=1e-5, atol=1e-7)


def test_projected_optimizer_on_fully_shard_parameters_takes_the_one_process_steps(fsdp_run):
    run = torch.load(fsdp_run / "direct.pt")
    assert run["sharded"]
    model = _model("free", seed=1)
    ids, labels = _fixed_batch()
    optimizer = _direct_steps(model, ids, labels)
    assert optimizer.projected_steps == run["projected_steps"] == 2
    torch.testing.assert_close(_flat(run["weights"]), _flat(_named_full(model)), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def without_plugin(fsdp_run) -> dict[str, torch.Tensor]:
    """Logits of the checkpoints written under FSDP, each loaded with `trust_remote_code` in one process that cannot
    import the plugin (one subprocess for all of them)."""
    from checkpoint_helpers import run_without_plugin

    ids = torch.arange(12).reshape(1, 12)
    torch.save(ids, fsdp_run / "ids.pt")
    code = (
        "from transformers import AutoModelForCausalLM\n"
        f"ids, logits = torch.load({str(fsdp_run / 'ids.pt')!r}), {{}}\n"
        f"for name in {list(CHECKPOINTS)!r}:\n"
        f"    m = AutoModelForCausalLM.from_pretrained({str(fsdp_run)!r} + '/' + name, trust_remote_code=True).eval()\n"
        "    assert 'relational_hf' not in type(m).__module__, type(m).__module__\n"
        "    with torch.no_grad():\n"
        "        logits[name] = m(input_ids=ids % m.config.vocab_size).logits\n"
        f"torch.save(logits, {str(fsdp_run / 'remote_logits.pt')!r})\n"
    )
    done = run_without_plugin(code, fsdp_run, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(fsdp_run / "remote_logits.pt")


#: the checkpoints the worker writes under FSDP: save_model of the free and of the (default) pivot gauge, finetune and
#: train
CHECKPOINTS = ("fsdp_model", "pivot_model", "ft", "tr")


def _check_loads_both_ways(folder: Path, remote_logits: torch.Tensor) -> None:
    from transformers import AutoModelForCausalLM

    files = sorted(p.name for p in folder.iterdir())
    assert "modeling_relational.py" in files and not any(name.startswith("_fsdp") for name in files), files
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_relational.RelationalForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.arange(12).reshape(1, 12) % model.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(remote_logits, model(input_ids=ids).logits)


def test_save_model_under_fsdp_writes_a_checkpoint_that_loads_with_and_without_the_plugin(fsdp_run, without_plugin):
    from transformers import AutoModelForCausalLM

    run = torch.load(fsdp_run / "trainer.pt")
    loaded = AutoModelForCausalLM.from_pretrained(fsdp_run / "fsdp_model")
    torch.testing.assert_close(_flat(_named_full(loaded)), _flat(run["weights"]))
    _check_loads_both_ways(fsdp_run / "fsdp_model", without_plugin["fsdp_model"])
    # the default gauge: gauge-fixed maps with pivot buffers
    _check_loads_both_ways(fsdp_run / "pivot_model", without_plugin["pivot_model"])


def test_finetune_command_with_fsdp_saves_a_loadable_model_and_resumes(fsdp_run, without_plugin):
    from transformers import AutoModelForCausalLM

    out = fsdp_run / "ft"
    printed = (fsdp_run / "cli.txt").read_text()
    assert "validation perplexity" in printed and "; 4 of 4 steps" in printed, printed
    # the resumed run continued from the FSDP trainer checkpoint of step 2: a restart would project 4 steps; the resumed
    # run projects steps 3 and 4 (and the zero-learning-rate step torch's distributed optimizer loading may take to
    # create the optimizer state, which moves nothing)
    assert int((fsdp_run / "cli_projected_steps.txt").read_text()) < 4
    state = json.loads((out / "trainer_state" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    _check_loads_both_ways(out, without_plugin["ft"])
    base = AutoModelForCausalLM.from_pretrained(fsdp_run / "base")
    tuned = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(_flat(_named_full(base)), _flat(_named_full(tuned)))


def test_train_command_with_fsdp_saves_a_loadable_model(fsdp_run, without_plugin):
    _check_loads_both_ways(fsdp_run / "tr", without_plugin["tr"])


# ---------------------------------------------------------------------------------------------------------------
# the worker (one per process, started by torchrun)
# ---------------------------------------------------------------------------------------------------------------


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import relational_hf  # noqa: F401
    from relational_hf.commands import finetune, train
    from relational_hf.symmetry import UpdateProjector
    from relational_hf.symmetry.sharding import is_sharded

    rank = int(os.environ["RANK"])
    _install_emulation()

    # 1. the Trainer with FSDP2, projection and suppression; save_model
    trainer = _train(out / "fsdp", per_device_batch=4, fsdp=True)
    weights = _named_full(trainer.model)  # a collective: every rank
    projector = UpdateProjector(trainer.model)  # on the sharded model: blocks are gathered whole as they are solved
    update = _random_update(weights)
    vertical, horizontal = projector.split(update)
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around the ProjectedOptimizer
    record = {
        "sharded": all(is_sharded(p) for p in trainer.model.parameters()),
        "weights": weights,
        "logs": trainer.state.log_history,
        "projected_steps": optimizer.projected_steps,
        "vertical_share": optimizer.last_stats.vertical_share,
        "update": update,
        "vertical": vertical,
        "horizontal": horizontal,
    }
    trainer.save_model(str(out / "fsdp_model"))
    if rank == 0:
        torch.save(record, out / "trainer.pt")

    # 2. the default pivot gauge under FSDP (suppression only), saved by save_model
    pivot = _train(out / "pivot", per_device_batch=4, fsdp=True, gauge="pivot", projection="none", steps=2)
    pivot.save_model(str(out / "pivot_model"))

    # 3. ProjectedOptimizer built on fully_shard DTensor parameters, no Trainer: each rank takes half of the batch
    model = _model("free", seed=1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids, labels = _fixed_batch()
    half = slice(2 * rank, 2 * rank + 2)
    optimizer = _direct_steps(model, ids[half], labels[half])  # FSDP averages the two halves' gradients
    direct = {"sharded": all(is_sharded(p) for p in model.parameters()), "weights": _named_full(model)}
    direct["projected_steps"] = optimizer.projected_steps
    if rank == 0:
        torch.save(direct, out / "direct.pt")

    # 4. the finetune command with --fsdp, a trainer checkpoint at step 2, then resumed to step 4
    flags = [str(out / "base"), "--train-file", str(out / "train.txt"), "--method", "full", "--projection", "update"]
    flags += ["--parallel-suppression", "0.05", "--fsdp", "--block-size", "16", "--batch-size", "2"]
    flags += ["--eval-blocks", "2", "--save-steps", "2", "--logging-steps", "1", "--output-dir", str(out / "ft")]
    assert finetune.main([*flags, "--max-steps", "2"]) == 0
    from contextlib import redirect_stdout
    from io import StringIO

    printed = StringIO()
    with redirect_stdout(printed):
        assert finetune.main([*flags, "--max-steps", "4", "--resume"]) == 0
    if rank == 0:  # the resumed run projected only the steps after the checkpoint
        (out / "cli.txt").write_text(printed.getvalue())
        (out / "cli_projected_steps.txt").write_text(str(CREATED_OPTIMIZERS[-1].projected_steps))

    # 5. the train command with --fsdp (default pivot gauge, a sample generated by every process under FSDP)
    flags = [
        "--train-file",
        str(out / "train.txt"),
        "--fsdp",
        "--hidden-size",
        "32",
        "--layers",
        "2",
        "--max-steps",
        "2",
    ]
    flags += ["--block-size", "16", "--batch-size", "2", "--eval-blocks", "2", "--sample-tokens", "4"]
    assert train.main([*flags, "--output-dir", str(out / "tr")]) == 0
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(Path(sys.argv[1]))
