"""Quality benchmark, runner: the learning-rate schedule, one training run (`train_one`, the benchmark training loop),
and `Runner`, which runs jobs in this process or a pool of workers."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context

import torch
from quality_setup import OPTIMIZER, PROJECTED, build_model, formula_parameters, model_signature

logger = logging.getLogger("quality")


def make_optimizer(
    model: torch.nn.Module, lr: float, projected: bool
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(what steps, the inner AdamW): OPTIMIZER's AdamW (weight decay on matrices and the embedding only), wrapped in
    `relational_hf.symmetry.ProjectedOptimizer` when `projected`."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    inner = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIMIZER["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=OPTIMIZER["betas"],
        eps=OPTIMIZER["eps"],
    )
    if not projected:
        return inner, inner
    from relational_hf.symmetry import ProjectedOptimizer

    return ProjectedOptimizer(inner, model), inner


def lr_schedule(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Transformers' `get_cosine_with_min_lr_schedule_with_warmup` (the Trainer's "cosine_with_min_lr"): linear
    warmup over warmup_fraction x steps from 0 to the optimiser's lr, then cosine decay to min_lr_fraction x lr."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    warmup = max(1, round(OPTIMIZER["warmup_fraction"] * steps))
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, warmup, steps, min_lr_rate=OPTIMIZER["min_lr_fraction"]
    )


def lr_at(step: int, steps: int, peak: float) -> float:
    """The peak-`peak` schedule's learning rate at `step` (0-based), from `lr_schedule`'s own function."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    return peak * lr_schedule(probe, steps).lr_lambdas[0](step)


def train_steps(
    model: torch.nn.Module,
    stepper: torch.optim.Optimizer,
    inner: torch.optim.Optimizer,
    windows,
    *,
    steps: int,
    batch: int,
    device: str = "cpu",
    before_step: Callable[[int], None] | None = None,
    after_step: Callable[[int, float], None] | None = None,
) -> dict:
    """The benchmarks' training loop: for step s = 0 .. steps-1, the batch of `windows` items s*batch .. (s+1)*batch,
    forward, backward, gradient clipping, `before_step(s)`, the optimiser step, the schedule (`lr_schedule` on
    `inner`), `after_step(s, loss)`. Stops at a non-finite loss. Returns train_losses, diverged and step_seconds
    (the loop's own time per step, the callbacks' excluded)."""
    schedule = lr_schedule(inner, steps)
    losses: list[float] = []
    seconds: list[float] = []
    diverged = False
    for step in range(steps):
        t0 = time.perf_counter()
        ids = torch.stack([windows[i]["input_ids"] for i in range(step * batch, (step + 1) * batch)]).to(device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        if not torch.isfinite(loss):
            diverged = True
            break
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER["grad_clip_norm"])
        t1 = time.perf_counter()
        if before_step is not None:
            before_step(step)
        t2 = time.perf_counter()
        stepper.step()
        schedule.step()
        stepper.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append((t1 - t0) + (time.perf_counter() - t2))
        if after_step is not None:
            after_step(step, losses[-1])
    return {"train_losses": losses, "diverged": diverged, "step_seconds": seconds}


_DATA: dict = {}


def _set_data(train_ids: torch.Tensor, val_blocks: torch.Tensor, threads: int) -> None:
    """Worker initializer: the token streams each run reads, and the torch thread count."""
    _DATA["train_ids"], _DATA["val_blocks"] = train_ids, val_blocks
    torch.set_num_threads(threads)


def train_one(job: dict) -> dict:
    """Train one contender at one size and seed for job["steps"] steps; return its validation loss (nats/token)."""
    from relational_hf.lm.data import RandomBlockDataset
    from relational_hf.lm.metrics import token_nll

    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    torch.manual_seed(job["seed"])
    model = build_model(job["contender"], job["dims"], job["vocab_size"]).to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    stepper, inner = make_optimizer(model, job["lr"], job["contender"] in PROJECTED)
    steps, batch = job["steps"], job["batch_size"]
    windows = RandomBlockDataset(_DATA["train_ids"], job["context"], steps * batch, seed=job["seed"])
    trained = train_steps(model, stepper, inner, windows, steps=steps, batch=batch, device=device)
    train_losses, diverged = trained["train_losses"], trained["diverged"]
    if diverged:
        val_loss = float("nan")
    else:
        total, count = token_nll(model, _DATA["val_blocks"], batch_size=64)
        val_loss = total / count
    tail = train_losses[-max(1, steps // 20) :]
    return {
        "contender": job["contender"],
        "size": job["size"],
        "seed": job["seed"],
        "lr": job["lr"],
        "parameters": params,
        "formula_parameters": formula_parameters(job["contender"], model.config),
        "model_signature": model_signature(job["contender"], job["dims"], job["vocab_size"]),
        "val_loss": val_loss,
        "train_loss_last_5pct": statistics.fmean(tail) if tail else float("nan"),
        "diverged": diverged,
        "steps": steps,
        "tokens": steps * batch * job["context"],
        "seconds": time.perf_counter() - start,
    }


class Runner:
    """Runs training jobs in this process (workers=1) or in a pool of worker processes that each hold the corpus
    (started once per corpus, used by the LR sweep and the grid)."""

    def __init__(self, workers: int, threads: int, train_ids: torch.Tensor, val_blocks: torch.Tensor) -> None:
        self.workers, self.threads, self.data = workers, threads, (train_ids, val_blocks)
        self.pool, self.threads_before = None, None

    def __enter__(self) -> Runner:
        if self.workers > 1:
            self.pool = ProcessPoolExecutor(
                self.workers,
                mp_context=get_context("spawn"),
                initializer=_set_data,
                initargs=(*self.data, self.threads),
            )
        else:
            self.threads_before = torch.get_num_threads()
            _set_data(*self.data, self.threads)
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        else:
            torch.set_num_threads(self.threads_before)
        _DATA.clear()

    def run(
        self, jobs: list[dict], on_done: Callable[[list[dict]], None] | None = None, deadline: float | None = None
    ) -> list[dict]:
        """Results of `jobs` (started in the given order, at most `workers` at a time) in completion order;
        `on_done(results so far)` after each one. No job starts after `deadline` (time.monotonic()); the ones left
        are simply not run."""
        results: list[dict] = []
        queue = list(jobs)

        def more() -> bool:
            return bool(queue) and (deadline is None or time.monotonic() < deadline)

        if self.pool is None:
            while more():
                self._finish(train_one(queue.pop(0)), results, len(jobs), on_done)
            return results
        running = set()
        while running or more():
            while more() and len(running) < self.workers:
                running.add(self.pool.submit(train_one, queue.pop(0)))
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                self._finish(future.result(), results, len(jobs), on_done)
        return results

    @staticmethod
    def _finish(result: dict, results: list[dict], total: int, on_done) -> None:
        results.append(result)
        logger.info(
            "[%d/%d] %-26s %-3s seed %d lr %.0e: %9d params, val loss %.4f (%.0f s)",
            len(results),
            total,
            result["contender"],
            result["size"],
            result["seed"],
            result["lr"],
            result["parameters"],
            result["val_loss"],
            result["seconds"],
        )
        if on_done is not None:
            on_done(results)
