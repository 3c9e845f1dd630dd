"""Conversion of Llama checkpoints to relational models: streaming cost, exactness, and slicing against pruning.

(a) Streaming conversion (`relational_hf.convert.stream_to_relational`, what `relational-hf convert` runs on a
safetensors folder). A random Llama of each size is generated on disk as sharded bf16 safetensors, one tensor at a
time (never the whole model in memory; weights N(0, 0.02), norm gains 1 + N(0, 0.1) so that folding is not
trivial). Then, each in its own child process so that its peak resident memory (`ru_maxrss` of that process: the
WHOLE process, Python, torch and Transformers included) belongs to that step alone:
- `floor`: the I/O floor of a conversion, measured in the same run: every tensor of SRC read (`CheckpointReader`) and
  written back unchanged as safetensors shards (`ShardWriter`) through the same staging folder, fsync and rename as
  `convert` (`relational_hf.outputs.write_new_output`); `convert_over_floor` states conversion time as a multiple
  of it (medians, and minima, over `--repeats`);
- `convert`: stream_to_relational SRC OUT (bf16 kept on disk), whose own check runs every layer against the source
  layer on random hidden states in fp32; wall time and peak RSS, and where the time went (`phases`: the
  converter's own `PhaseTimes`: read, preflight, fold, gauge, check, write, publish). With `--repeats N` the floor and
  the conversion run N times, alternately (`runs` holds each; `wall_s` is the median). `--baseline REV` also
  converts with the `relational_hf` of git revision REV (exported into the work folder, imported by the child
  through PYTHONPATH), alternating with the current code: a before/after measured on the same machine in the same
  session. `--profile` adds one conversion under cProfile (`profile`: the functions with the most own time);
- `redundancy`: redundancy_report_from_checkpoint SRC (counts and per-layer invariant descriptors); wall time, RSS;
- `check`: an independent exactness check, on a sample of layers (source layer vs converted layer read back from
  OUT, same random input, fp32 compute) and on full logits computed layer by layer (`layerwise_logits`, so it runs
  for any size) on random tokens. The converted weights are stored in bf16, so the difference is bf16 rounding of
  the new factors (not the conversion); sizes up to 1B are also converted with --dtype float32, where the logits
  must agree to float32 rounding.
Generated files are deleted after each size (only this benchmark's own temporary folder).

(b) Slicing: a small Llama (byte tokenizer of `relational_hf.lm.data`, d=128, 4 layers, context 64) is
trained here on Tiny Shakespeare (`../shared/data/tinyshakespeare`, first 90% of the text), converted with
`slice_fraction` 0.1-0.4 (principal gauge from calibration blocks of the training text) and evaluated on the
held-out last 10%; next to it, the same trained Llama with as many decoder weights set to zero by magnitude pruning
(`relational_hf.compress.ops.prune_weights`), both "same number removed" and "same number left".
Perplexity is `relational_hf.lm.metrics.perplexity`.

    python benchmarks/convert.py                          # 0.1B and 1B streamed, slicing with 1500 steps
    python benchmarks/convert.py --sizes 1B 7B --no-slicing   # writes convert_stream.json / .png (7B: ~27 GB disk)
    python benchmarks/convert.py --quick                  # a ~10M conversion, 100 training steps (about 2 min)
    python benchmarks/convert.py --sizes 1B --no-slicing --threads auto --repeats 2 --baseline REV --profile \
        --only floor convert check_bf16 --tag speed_1B         # conversion speed against the I/O floor, before/after

Writes benchmarks/results/convert.json and convert.png (`_quick` with --quick, `_stream` with --no-slicing).
The machine running it may be shared: wall times are then pessimistic.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common import RESULTS, corpus, peak_rss_mib, write_json
from transformers import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger("convert")

#: conversion sizes: name -> LlamaConfig fields (32k vocabulary); 1B as the earlier in-memory measurement (tied),
#: 7B the Llama-2-7B shape (untied head)
CONVERT_SIZES = {
    "10M": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=688,
        vocab_size=32000,
        tie_word_embeddings=True,
    ),
    "0.1B": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=2048,
        vocab_size=32000,
        tie_word_embeddings=True,
    ),
    "1B": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        intermediate_size=5632,
        vocab_size=32000,
        tie_word_embeddings=True,
    ),
    "7B": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
}
FP32_CHECK_UP_TO = ("10M", "0.1B", "1B")
FRACTIONS = (0.1, 0.2, 0.3, 0.4)
SMALL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384)
SMALL_QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=192)


# ---- (a) streaming conversion ----------------------------------------------------------------------------------------
def generate_checkpoint(size: str, directory: Path, seed: int, shard: str = "2GB", layers: int | None = None) -> dict:
    """Write a random bf16 Llama of `size` as sharded safetensors, one tensor at a time (`layers`: that many decoder
    layers of the shape instead of its own depth)."""
    from relational_hf.shards import ShardWriter, meta_model, parse_size

    shape = CONVERT_SIZES[size] | ({"num_hidden_layers": layers} if layers else {})
    config = LlamaConfig(**shape, max_position_embeddings=4096, dtype="bfloat16")
    model = meta_model(config)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    names = [(n, tuple(t.shape)) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]
    directory.mkdir(parents=True)
    writer = ShardWriter(directory, parse_size(shard), 4096 + 200 * len(names))
    start = time.perf_counter()
    for i, (name, shape) in enumerate(names):
        g = torch.Generator().manual_seed(seed * 100003 + i)
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        writer.add(name, t.to(torch.bfloat16))
        del t
    writer.finish(sum(p.numel() for p in model.parameters()))
    config.save_pretrained(directory)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes": sum(f.stat().st_size for f in directory.glob("*.safetensors")),
        "shards": len(list(directory.glob("*.safetensors"))),
        "generate_s": time.perf_counter() - start,
    }


def _set_threads(threads: str) -> None:
    """torch's intra-op threads: a number, or "auto" for the count `relational-hf` itself uses (the idle cores,
    `relational_hf.commands.main.cpu_threads`)."""
    if threads == "auto":
        from relational_hf.commands.main import cpu_threads

        torch.set_num_threads(cpu_threads()[0])
    else:
        torch.set_num_threads(int(threads))


def _child(kind: str, paths: list[str], threads: str) -> dict:
    """One measured step in this (fresh) process, with `threads` as `_set_threads` reads it."""
    import relational_hf  # noqa: F401  (registers the architecture)

    _set_threads(threads)
    logging.getLogger("relational_hf").setLevel(logging.WARNING)
    base_rss = peak_rss_mib()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    base_cpu = usage.ru_utime + usage.ru_stime
    base_sys = usage.ru_stime
    start = time.perf_counter()
    if kind == "floor":
        out = io_floor(paths[0], paths[1])
    elif kind in ("convert", "convert_profile"):
        from relational_hf.convert.streaming import stream_to_relational

        dtype = paths[2] if len(paths) > 2 else None
        try:  # the phase timers (absent from the code of an earlier revision, see --baseline)
            from relational_hf.convert.relational import PhaseTimes

            times, extra = PhaseTimes(), {}
            extra["times"] = times
        except ImportError:
            times, extra = None, {}
        profiler = None
        if kind == "convert_profile":
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        report = stream_to_relational(paths[0], paths[1], dtype=dtype, progress=False, **extra)
        out = {
            "source_parameters": report.source_parameters,
            "relational_parameters": report.relational_parameters,
            "converter_check_max_abs": report.max_logit_difference,
            "converter_check_relative": report.relative_logit_difference,
            "output_bytes": sum(f.stat().st_size for f in Path(paths[1]).glob("*.safetensors")),
        }
        if times is not None:
            out["phases"] = {k: round(v, 3) for k, v in times.items()}
        if profiler is not None:
            profiler.disable()
            out["profile"] = _profile_rows(profiler)
    elif kind in ("redundancy", "redundancy_counts"):
        from relational_hf.symmetry.report import redundancy_report_from_checkpoint

        report = redundancy_report_from_checkpoint(paths[0], descriptors=kind == "redundancy")
        out = {
            "redundant_dimensions": report.redundant_dimensions,
            "redundant_percent": report.redundant_percent,
            "layers_with_descriptors": len(report.descriptors or []),
        }
    elif kind == "check":
        out = exactness(paths[0], paths[1])
    else:
        raise ValueError(kind)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.update(
        wall_s=time.perf_counter() - start,
        cpu_s=usage.ru_utime + usage.ru_stime - base_cpu,  # load-independent: CPU time of this step
        system_cpu_s=usage.ru_stime - base_sys,  # of which in the kernel (page faults, file I/O)
        torch_threads=torch.get_num_threads(),
        peak_rss_mib=peak_rss_mib(),
        startup_rss_mib=base_rss,
    )
    return out


def _profile_rows(profiler, top: int = 25) -> list[dict]:
    """The `top` functions by own time (tottime) of a cProfile run, with their cumulative time and call counts
    (file paths shortened to the package: no path of the machine)."""
    import pstats

    stats = pstats.Stats(profiler).stats
    rows = []
    for (file, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.items():
        for marker in ("relational_hf/", "site-packages/"):
            if marker in file:
                file = file[file.index(marker) + (0 if marker == "relational_hf/" else len(marker)) :]
        where = f"{file}:{line}({name})" if line else name
        rows.append({"function": where, "calls": calls, "tottime_s": round(tottime, 3), "cumtime_s": round(cumtime, 3)})
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:top]


def io_floor(src: str, out: str, max_shard_size: str = "5GB") -> dict:
    """Read every tensor of the checkpoint SRC and write the same bytes into OUT as safetensors shards, through the
    project's shard writer and the staging folder, fsync and rename that `convert` writes through: what any
    streaming conversion must at least do. OUT is removed afterwards (not timed: the caller's clock stops first)."""
    from relational_hf.outputs import write_new_output
    from relational_hf.shards import CheckpointReader, ShardWriter, parse_size

    reader = CheckpointReader(src)
    names = reader.keys()
    counts = {"tensors": 0, "bytes": 0}

    def write(stage: Path) -> None:
        writer = ShardWriter(stage, parse_size(max_shard_size), 4096 + 2 * sum(len(k) + 160 for k in names))
        for name in names:
            tensor = reader.get([name])[name]
            writer.add(name, tensor)
            counts["tensors"] += 1
            counts["bytes"] += tensor.numel() * tensor.element_size()
            del tensor
        writer.finish(sum(math.prod(reader.shape(k)) for k in names))

    write_new_output(out, write, command="convert", kind="io-floor")
    return counts


@torch.no_grad()
def exactness(src: str, out: str, tokens: int = 32, layers: int = 3) -> dict:
    """Sampled layers (source vs converted layer read back from OUT) and full logits (layer by layer), fp32."""
    from transformers import AutoConfig

    from relational_hf.convert.relational import relative_difference
    from relational_hf.convert.streaming import _layer_outputs, _rotary, layerwise_logits
    from relational_hf.shards import CheckpointReader, materialize, meta_model, release

    results = {}
    src_model = meta_model(AutoConfig.from_pretrained(src))
    dst_model = meta_model(AutoConfig.from_pretrained(out))
    src_reader, dst_reader = CheckpointReader(src), CheckpointReader(out)
    n = src_model.config.num_hidden_layers
    sample = sorted({0, n // 2, n - 1})[:layers]
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in sample:
        a = materialize(src_model, src_reader, f"model.layers.{i}", dtype=torch.float32)
        b = materialize(dst_model, dst_reader, f"model.layers.{i}", dtype=torch.float32)
        hidden = torch.randn(1, tokens, src_model.config.hidden_size, generator=g)
        diff, scale, rel = relative_difference(
            _layer_outputs(a, hidden, _rotary(src_model)), _layer_outputs(b, hidden, _rotary(dst_model))
        )
        rows.append({"layer": i, "max_abs": diff, "scale": scale, "relative": rel})
        release(a)
        release(b)
    results["layers"] = rows
    ids = torch.randint(0, src_model.config.vocab_size, (2, tokens), generator=g)
    la = layerwise_logits(src, ids)
    lb = layerwise_logits(out, ids)
    diff, scale, rel = relative_difference(la, lb)
    results["logits"] = {
        "max_abs": diff,
        "scale": scale,
        "relative": rel,
        "argmax_agreement": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
        "tokens": int(ids.numel()),
    }
    return results


def _run_child(kind: str, paths: list[str], threads: str, timeout_s: float, code: Path | None = None) -> dict:
    """Run one step in a fresh process; `code`: a folder holding another `relational_hf` to import instead."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--threads", str(threads), *paths]
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [env.get("PYTHONPATH")])])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f} s (time box)"}
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["subprocess_wall_s"] = time.perf_counter() - start
    return result


def export_code(revision: str, into: Path) -> dict:
    """`relational_hf` as of git revision `revision` of this repository, written into the folder `into` (for a
    child to import through PYTHONPATH); returns the revision's commit and subject."""
    root = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True, exist_ok=True)
    git = ["git", "-C", str(root)]
    commit = subprocess.run([*git, "rev-parse", "--verify", f"{revision}^{{commit}}"], capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--baseline: {revision!r} is not a revision of this repository")
    archive = subprocess.run([*git, "archive", "--format=tar", commit.stdout.strip(), "relational_hf"],
                             capture_output=True, check=True)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    subject = subprocess.run([*git, "log", "-1", "--format=%s", commit.stdout.strip()], capture_output=True, text=True)
    return {"revision": revision, "commit": commit.stdout.strip(), "subject": subject.stdout.strip()}


def _repeated(runs: list[dict]) -> dict:
    """One step measured several times: the last run's fields, with `wall_s` / `cpu_s` the medians, their minima,
    and every run's times and load average under `runs`."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    out = dict(ok[-1])
    walls, cpus = [r["wall_s"] for r in ok], [r["cpu_s"] for r in ok]
    keys = ("wall_s", "cpu_s", "system_cpu_s", "torch_threads", "load_average_before", "load_average_after", "phases")
    out.update(
        wall_s=statistics.median(walls),
        wall_s_min=min(walls),
        cpu_s=statistics.median(cpus),
        cpu_s_min=min(cpus),
        runs=[{k: r[k] for k in keys if k in r} for r in runs],
    )
    return out


def floor_ratio(row: dict) -> dict:
    """convert time over the I/O floor measured in the same run: medians and minima (empty until both ran)."""
    floor, convert = row.get("floor", {}), row.get("convert", {})
    if "wall_s" not in floor or "wall_s" not in convert:
        return {}
    out = {
        "io_floor_s": floor["wall_s"],
        "convert_over_floor": convert["wall_s"] / floor["wall_s"],
        "convert_over_floor_min": convert.get("wall_s_min", convert["wall_s"])
        / floor.get("wall_s_min", floor["wall_s"]),
    }
    base = row.get("convert_baseline", {})
    if "wall_s" in base:
        out["baseline_over_floor"] = base["wall_s"] / floor["wall_s"]
        out["speedup_over_baseline"] = base["wall_s"] / convert["wall_s"]
    return out


STEPS = ("floor", "convert", "redundancy_counts", "redundancy", "check_bf16", "convert_fp32", "check_fp32")


def run_conversions(
    sizes: list[str],
    seed: int,
    threads: str,
    timeout_s: float,
    workdir: Path | None,
    save=None,
    only: list[str] | None = None,
    previous: dict | None = None,
    repeats: int = 1,
    baseline: str | None = None,
    profile: bool = False,
) -> dict:
    """Generate, convert, analyse and check each size; `save(out)` runs after every step, so partial results
    survive an interrupted run. `only`: run just these steps and keep the other measured steps of `previous` (the
    rows of an earlier run of the same sizes); each step records the 1-minute load average before it ran.
    `repeats`: the floor and the conversion run this many times, alternately (with the `baseline` revision's
    conversion after each of ours when given); `profile`: one more conversion under cProfile."""
    out = {}
    save = save or (lambda _: None)
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    for size in sizes:
        base = Path(tempfile.mkdtemp(prefix=f"convert-bench-{size}-", dir=workdir))
        try:
            src, dst, dst32 = base / "src", base / "relational", base / "relational_fp32"
            row = out[size] = {"size": size, "config": CONVERT_SIZES[size], "threads": threads}
            if only is not None:
                row.update({k: v for k, v in (previous or {}).get(size, {}).items() if k not in row})
                for key in (
                    "floor",
                    "convert",
                    "convert_baseline",
                    "profile",
                    "io_floor_s",
                    "convert_over_floor",
                    "convert_over_floor_min",
                    "baseline_over_floor",
                    "speedup_over_baseline",
                    "baseline",
                ):
                    row.pop(key, None)  # fmt: skip  (measured again, or not at all: never mixed with an old run)
            code = None
            if baseline is not None:
                row["baseline"] = export_code(baseline, base / "baseline_code")
                code = base / "baseline_code"
            row["generate"] = generate_checkpoint(size, src, seed)
            logger.info(
                "%s: generated %.2f GB in %.0f s", size, row["generate"]["bytes"] / 1e9, row["generate"]["generate_s"]
            )
            save(out)

            def step(key: str, kind: str, paths: list[str], code: Path | None = None, size: str = size) -> dict:
                load = os.getloadavg()[0]
                result = _run_child(kind, paths, threads, timeout_s, code)
                result["load_average_before"] = round(load, 2)
                result["load_average_after"] = round(os.getloadavg()[0], 2)
                logger.info("%s: %s %s", size, key, {k: v for k, v in result.items() if k != "profile"})
                return result

            timed = [("floor", "floor"), ("convert", "convert")] + ([("convert_baseline", "convert")] if code else [])
            runs: dict[str, list[dict]] = {key: [] for key, _ in timed}
            for _ in range(repeats if only is None or {"floor", "convert"} & set(only) else 0):
                for key, kind in timed:
                    if only is not None and key.replace("_baseline", "") not in only:
                        continue
                    target = base / ("floor_out" if key == "floor" else f"{key}_out")
                    shutil.rmtree(target, ignore_errors=True)
                    runs[key].append(
                        step(key, kind, [str(src), str(target)], code if key == "convert_baseline" else None)
                    )
                    if key != "convert":
                        shutil.rmtree(target, ignore_errors=True)
                    else:
                        shutil.rmtree(dst, ignore_errors=True)
                        if (target).exists():
                            target.rename(dst)  # the last conversion is the one checked
                    row.update({k: _repeated(v) for k, v in runs.items() if v})
                    row.update(floor_ratio(row))
                    save(out)
            if profile:
                target = base / "profile_out"
                row["profile"] = step("profile", "convert_profile", [str(src), str(target)])
                shutil.rmtree(target, ignore_errors=True)
                save(out)
            steps = [
                ("redundancy_counts", "redundancy_counts", [str(src)]),
                ("redundancy", "redundancy", [str(src)]),
                ("check_bf16", "check", [str(src), str(dst)]),
            ]
            if size in FP32_CHECK_UP_TO:
                steps += [
                    ("convert_fp32", "convert", [str(src), str(dst32), "float32"]),
                    ("check_fp32", "check", [str(src), str(dst32)]),
                ]
            for key, kind, paths in steps:
                if only is not None and key not in only:
                    continue
                if kind == "check" and "error" in row.get(key.replace("check", "convert").replace("_bf16", ""), {}):
                    continue
                row[key] = step(key, kind, paths)
                save(out)
                if key == "check_bf16":
                    shutil.rmtree(dst, ignore_errors=True)  # disk: one converted copy at a time
        finally:
            shutil.rmtree(base, ignore_errors=True)  # this benchmark's own generated files only
    return out


# ---- (b) slicing vs magnitude pruning on a small trained model -----------------------------------------------------
def shakespeare_ids() -> tuple[torch.Tensor, torch.Tensor]:
    from relational_hf.lm.data import byte_level_tokenizer, encode, split_text

    path = corpus("tinyshakespeare")
    train, val = split_text(path.read_text(encoding="utf-8"), 0.1)
    tok = byte_level_tokenizer()
    return encode(tok, train), encode(tok, val)


def train_small(dims: dict, train_ids: torch.Tensor, steps: int, batch: int, context: int, seed: int, lr: float):
    from relational_hf.lm.data import RandomBlockDataset

    torch.manual_seed(seed)
    # untied head: slicing folds a varying final gain into the head anyway (a tied head would be untied, +V d)
    config = LlamaConfig(**dims, vocab_size=259, max_position_embeddings=context, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    windows = RandomBlockDataset(train_ids, context, steps * batch, seed=seed)
    warmup = max(1, steps // 20)
    model.train()
    losses = []
    for step in range(steps):
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        ids = torch.stack([windows[i]["input_ids"] for i in range(step * batch, (step + 1) * batch)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 5) == 0:
            logger.info("train step %d/%d: loss %.3f", step + 1, steps, sum(losses[-50:]) / len(losses[-50:]))
    return model.eval(), losses


def decoder_weight_count(model) -> int:
    from relational_hf.compress.ops import weight_matrices

    return sum(m.rows.numel() for m in weight_matrices(model))


def nonzero(model) -> int:
    return sum(int((p != 0).sum()) for p in model.parameters())


def slicing_vs_pruning(quick: bool, steps: int, seed: int) -> dict:
    from relational_hf.compress.ops import prune_weights
    from relational_hf.convert import to_relational
    from relational_hf.lm.data import lm_blocks
    from relational_hf.lm.metrics import perplexity

    context, batch = 64, 12
    dims = SMALL_QUICK if quick else SMALL
    train_ids, val_ids = shakespeare_ids()
    start = time.perf_counter()
    model, losses = train_small(dims, train_ids, steps, batch, context, seed, lr=2e-3)
    train_s = time.perf_counter() - start
    val = lm_blocks(val_ids, context, max_tokens=(32 if quick else 256) * context)
    gen = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, train_ids.numel() - context, (16 if quick else 128,), generator=gen)
    calibration = torch.stack([train_ids[s : s + context] for s in starts.tolist()])
    llama_params = sum(p.numel() for p in model.parameters())
    ppl_llama = perplexity(model, val, batch_size=64)
    decoder_weights = decoder_weight_count(model)
    rows = []
    exact = None
    for fraction in FRACTIONS:
        sliced, report = to_relational(model, fraction, calibration, eval_data=val, return_report=True)
        s = report.slicing
        exact = {"relational_parameters": report.relational_parameters, "perplexity": s.perplexity_before}
        removed = s.parameters_before - s.parameters_after
        row = {
            "fraction": fraction,
            "hidden_size_after": s.hidden_size_after,
            "relational_parameters_before": s.parameters_before,
            "sliced_parameters": s.parameters_after,
            "parameters_removed": removed,
            "parameter_reduction": s.parameter_reduction,
            "variance_kept": s.variance_kept,
            "perplexity_sliced": s.perplexity_after,
            "perplexity_change_sliced": s.perplexity_after / ppl_llama - 1,
        }
        # magnitude pruning of the trained Llama's decoder weights (embeddings/head untouched, like prune_weights)
        for label, count in (("same_removed", removed), ("same_left", llama_params - s.parameters_after)):
            sparsity = max(0, count) / decoder_weights
            if sparsity >= 1:
                row[f"magnitude_{label}"] = {"sparsity": sparsity, "error": "more than all decoder weights"}
                continue
            pruned = prune_weights(model, "magnitude", "unstructured", sparsity)
            ppl = perplexity(pruned, val, batch_size=64)
            row[f"magnitude_{label}"] = {
                "zeroed": count,
                "decoder_sparsity": sparsity,
                "nonzero_parameters": nonzero(pruned),
                "perplexity": ppl,
                "perplexity_change": ppl / ppl_llama - 1,
            }
        rows.append(row)
        logger.info(
            "slice %.1f: -%.1f%% params, ppl %.3f -> %.3f; magnitude (same removed) %.3f, (same left) %.3f",
            fraction,
            100 * s.parameter_reduction,
            ppl_llama,
            s.perplexity_after,
            row["magnitude_same_removed"].get("perplexity", float("nan")),
            row["magnitude_same_left"].get("perplexity", float("nan")),
        )
    return {
        "model": dict(dims, vocab_size=259, context=context, tokenizer="byte_level_tokenizer"),
        "training": {
            "steps": steps,
            "batch": batch,
            "context": context,
            "lr": 2e-3,
            "tokens": steps * batch * context,
            "wall_s": train_s,
            "final_train_loss_mean_last_50": sum(losses[-50:]) / len(losses[-50:]),
        },
        "corpus": "tinyshakespeare input.txt, split_text 90/10 (train / held-out)",
        "heldout_tokens": int(val.numel()),
        "calibration_blocks": int(calibration.shape[0]),
        "llama_parameters": llama_params,
        "llama_decoder_weights": decoder_weights,
        "perplexity_llama": ppl_llama,
        "exact_conversion": exact,
        "rows": rows,
    }


def plot(conversions: dict, slicing: dict | None, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if slicing else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    ok = [c for c in conversions.values() if "error" not in c.get("convert", {"error": 1})]
    labels = [f"{c['size']}\n({c['generate']['parameters'] / 1e9:.2f}B, bf16)" for c in ok]
    x = list(range(len(ok)))
    ax = axes[0]
    steps = [
        ("floor", "I/O floor (read + write)"),
        ("convert_baseline", "convert, before"),
        ("convert", "convert"),
        ("redundancy_counts", "redundancy (counts)"),
        ("redundancy", "redundancy + ranks"),
    ]
    steps = [(key, label) for key, label in steps if any(key in c for c in ok)]
    width = 0.8 / len(steps)
    for j, (key, label) in enumerate(steps):
        offs = [i - 0.4 + width * (j + 0.5) for i in x]
        walls = [c.get(key, {}).get("wall_s", 0) for c in ok]
        cpus = [c.get(key, {}).get("cpu_s", 0) for c in ok]
        ax.bar(offs, walls, width, label=f"{label}: wall", alpha=0.45, color=f"C{j}")
        ax.bar(offs, cpus, width * 0.5, label=f"{label}: CPU", color=f"C{j}")
    ax.axhline(60, color="gray", ls=":", lw=0.8, label="60 s")
    for i, c in enumerate(ok):
        if "convert_over_floor" in c:
            text = f"convert = {c['convert_over_floor']:.1f} x floor"
            if "baseline_over_floor" in c:
                text += f"\n(before: {c['baseline_over_floor']:.1f} x)"
            ax.annotate(text, (i, c["convert"]["wall_s"]), fontsize=7, ha="center", va="bottom")
    ax.set_xticks(x, labels, fontsize=8)
    threads = ok[0]["threads"] if ok else "?"
    ax.set_ylabel(f"seconds ({threads} thread(s); wall on a shared, loaded machine)")
    ax.set_title("time: wall (light) and CPU (dark)")
    ax.legend(fontsize=6)
    ax = axes[1]
    ax.bar([i - 0.2 for i in x], [c["convert"]["peak_rss_mib"] for c in ok], 0.4, label="convert")
    ax.bar([i + 0.2 for i in x], [c.get("redundancy", {}).get("peak_rss_mib", 0) for c in ok], 0.4, label="redundancy")
    for target in (2048, 4096):
        ax.axhline(target, color="gray", ls=":", lw=0.8)
    for i, c in enumerate(ok):
        ax.annotate(f"{c['generate']['bytes'] / 2**20:,.0f} MiB on disk", (i, c["convert"]["peak_rss_mib"]), fontsize=7)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("peak RSS of the whole process (MiB)")
    ax.set_title("memory (targets 2 GiB at 1B, 4 GiB at 7B)")
    ax.legend(fontsize=7)
    if slicing:
        ax1 = axes[2]
        rows = slicing["rows"]
        removed = [100 * r["parameter_reduction"] for r in rows]
        ax1.plot(removed, [r["perplexity_sliced"] for r in rows], "o-", label="relational + slicing")
        for label, style in (("same_removed", "s--"), ("same_left", "^:")):
            pts = [(100 * r["parameter_reduction"], r[f"magnitude_{label}"].get("perplexity")) for r in rows]
            pts = [p for p in pts if p[1] is not None]
            ax1.plot(*zip(*pts), style, label=f"Llama + magnitude pruning ({label.replace('_', ' ')})")
        ax1.axhline(slicing["perplexity_llama"], color="k", lw=0.8, label="trained Llama (unpruned)")
        for r, xx in zip(rows, removed):
            ax1.annotate(f"slice {r['fraction']:.1f}", (xx, r["perplexity_sliced"]), fontsize=7)
        ax1.set_xlabel("stored parameters removed by slicing (%)")
        ax1.set_ylabel("held-out perplexity (Tiny Shakespeare, bytes)")
        ax1.set_title("slicing vs magnitude pruning")
        ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _summary(conversions: dict) -> None:
    print(
        "size  params  disk GB  convert s  RSS MiB  redund. s  RSS MiB  check rel (fp32)  layers rel  logits rel (bf16)"
    )
    for c in conversions.values():
        conv, red = c.get("convert", {}), c.get("redundancy", {})
        if "error" in conv:
            print(f"{c['size']:5s} convert failed: {conv['error']}")
            continue
        bf = c.get("check_bf16", {})
        layers = max((r["relative"] for r in bf.get("layers", [])), default=float("nan"))
        print(
            f"{c['size']:5s} {c['generate']['parameters'] / 1e9:6.2f}B {c['generate']['bytes'] / 1e9:7.2f} "
            f"{conv['wall_s']:10.1f} {conv['peak_rss_mib']:8.0f} {red.get('wall_s', float('nan')):10.1f} "
            f"{red.get('peak_rss_mib', float('nan')):8.0f} {conv['converter_check_relative']:17.2e} {layers:11.2e} "
            f"{bf.get('logits', {}).get('relative', float('nan')):17.2e}"
        )
        if "convert_over_floor" in c:
            print(
                f"      I/O floor {c['io_floor_s']:.1f} s: convert = {c['convert_over_floor']:.2f} x floor (medians), "
                f"{c['convert_over_floor_min']:.2f} x (minima)"
                + (f"; before: {c['baseline_over_floor']:.2f} x" if "baseline_over_floor" in c else "")
            )
        if "check_fp32" in c:
            lg = c["check_fp32"]["logits"]
            print(f"      fp32 output: logits max |diff| {lg['max_abs']:.2e} (relative {lg['relative']:.2e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~10M conversion and a short training (about 2 min)")
    parser.add_argument("--sizes", nargs="+", choices=list(CONVERT_SIZES), help="conversion sizes (default 0.1B 1B)")
    parser.add_argument("--no-slicing", action="store_true", help="streaming conversions only (-> convert_stream)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of the small model (1500; quick 100)")
    parser.add_argument("--convert-timeout", type=float, default=3600.0, help="seconds allowed per child step")
    parser.add_argument("--workdir", type=Path, default=None, help="where the generated checkpoints go (temp dir)")
    parser.add_argument("--threads", default="2", help="torch threads of each step: a number, or auto (idle cores)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the floor and of the conversion, alternately")
    parser.add_argument("--baseline", default=None, help="git revision whose relational_hf also converts (before)")
    parser.add_argument("--profile", action="store_true", help="one more conversion under cProfile (own time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the existing JSON")
    parser.add_argument("--tag", default="", help="suffix of the result files (e.g. 7B -> convert_stream_7B.json)")
    parser.add_argument(
        "--only", nargs="+", choices=STEPS, default=None,
        help="run just these steps (the checkpoint is generated again), keeping the others from the existing JSON if any",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads != "auto" and not (args.threads.isdigit() and int(args.threads) > 0):
        parser.error(f"--threads: a positive number or auto, got {args.threads!r}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.only and any(s.startswith("check") for s in args.only) and not {"convert", "convert_fp32"} & set(args.only):
        parser.error("--only: a check step needs its convert step (convert / convert_fp32) in the same run")
    name = "convert_quick" if args.quick else ("convert_stream" if args.no_slicing else "convert")
    name = f"{name}_{args.tag}" if args.tag else name
    if args.plot_only:
        saved = json.loads((RESULTS / f"{name}.json").read_text())
        plot(saved["conversion"], saved.get("slicing"), RESULTS / f"{name}.png")
        return
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.child:  # the parent's own work (generating checkpoints, the slicing part)
        _set_threads(args.threads)
    if args.child:
        print(json.dumps(_child(args.child, args.paths, args.threads)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("relational_hf").setLevel(logging.WARNING)
    sizes = args.sizes or (["10M"] if args.quick else ["0.1B", "1B"])
    steps = args.steps or (100 if args.quick else 1500)
    start = time.perf_counter()

    def save(partial: dict) -> None:
        write_json(name, {"seed": args.seed, "threads": args.threads, "partial": True, "conversion": partial})

    previous = None
    if args.only:
        path = RESULTS / f"{name}.json"
        previous = json.loads(path.read_text())["conversion"] if path.is_file() else {}
    conversions = run_conversions(
        sizes, args.seed, args.threads, args.convert_timeout, args.workdir, save, args.only, previous,
        repeats=args.repeats, baseline=args.baseline, profile=args.profile,
    )  # fmt: skip
    slicing = None if args.no_slicing else slicing_vs_pruning(args.quick, steps, args.seed)
    result = {
        "seed": args.seed,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "wall_s": time.perf_counter() - start,
        "note": "wall times on a machine shared with other jobs: pessimistic",
        "conversion": conversions,
    }
    if slicing is not None:
        result["slicing"] = slicing
    write_json(name, result)
    plot(conversions, slicing, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.json')} in {time.perf_counter() - start:.0f} s")
    _summary(conversions)
    if slicing is None:
        return
    print(
        f"trained Llama: {slicing['llama_parameters']:,} params, held-out perplexity {slicing['perplexity_llama']:.3f}"
    )
    print("fraction  removed  ppl sliced  ppl magnitude(same removed)  ppl magnitude(same left)")
    for r in slicing["rows"]:
        m1 = r["magnitude_same_removed"].get("perplexity", float("nan"))
        m2 = r["magnitude_same_left"].get("perplexity", float("nan"))
        print(
            f"{r['fraction']:8.1f} {r['parameter_reduction']:8.1%} {r['perplexity_sliced']:11.3f} {m1:28.3f} {m2:25.3f}"
        )


if __name__ == "__main__":
    main()
