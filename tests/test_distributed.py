"""The Trainer path under `torchrun --nproc_per_node 2` on CPU (gloo), with projection and suppression on.

Properties: after N steps both replicas hold identical parameters (DDP plus a deterministic projection keeps them in
lock-step), and 2 processes x 4 sequences take the same SGD steps as 1 process x 8 sequences: the suppression term is
normalised over the global batch like the task loss, so DDP's gradient average is the gradient of the global batch.

This file is also the worker that torchrun starts (`python -m torch.distributed.run ... tests/test_distributed.py
OUT_DIR`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from tiny_models import run_on_two_processes

STEPS = 3



def _dataset():
    """8 sequences of unequal length (right padding, attention_mask 0, labels -100 there); the first four (rank 0's)
    hold 45 tokens, the last four 18, so a per-process mean is not the global mean."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for length in (12, 12, 11, 10, 3, 4, 5, 6):
        ids = torch.randint(0, 48, (12,), generator=g)
        mask = torch.zeros(12, dtype=torch.long)
        mask[:length] = 1
        labels = ids.masked_fill(mask == 0, -100)
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return rows


def _train(output_dir: str, per_device_batch: int) -> torch.nn.Module:
    import relational_hf  # noqa: F401
    from relational_hf import RelationalConfig, RelationalForCausalLM
    from relational_hf.training import RelationalTrainer, RelationalTrainingArguments

    torch.manual_seed(0)
    config = RelationalConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, gauge="free"
    )
    model = RelationalForCausalLM(config)
    args = RelationalTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=per_device_batch,
        max_steps=STEPS,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_drop_last=True,
        symmetry_projection="update",
        parallel_suppression_coef=2.0,
        parallel_suppression_site="residual",
        # no shuffling: each process takes its slice of the same 8 sequences, as one process takes all 8
        train_sampling_strategy="sequential",
    )
    trainer = RelationalTrainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    return model


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_two_gloo_processes_keep_replicas_equal_and_match_one_process(tmp_path):
    run_on_two_processes(__file__, tmp_path, master_port=29517, timeout=240)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(rank0, rank1), "replicas diverged"
    single = _flat(_train(str(tmp_path / "single"), per_device_batch=8))
    start = torch.load(tmp_path / "start.pt")
    assert not torch.allclose(single, start)  # the steps moved the weights
    torch.testing.assert_close(rank0, single, rtol=1e-4, atol=1e-6)


if __name__ == "__main__":  # the torchrun worker
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    model = _train(str(out / "ddp"), per_device_batch=4)
    rank = int(os.environ["RANK"])
    torch.save(_flat(model), out / f"rank{rank}.pt")
    if rank == 0:
        torch.manual_seed(0)
        from relational_hf import RelationalConfig, RelationalForCausalLM

        config = RelationalConfig(
            vocab_size=48,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            gauge="free",
        )
        torch.save(_flat(RelationalForCausalLM(config)), out / "start.pt")
    if torch.distributed.is_initialized():  # both ranks done writing, then an orderly gloo shutdown (no abort at exit)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
