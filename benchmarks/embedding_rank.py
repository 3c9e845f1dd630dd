"""What narrowing the tied embedding would cost: SmolLM2's 49,152 x 576 embedding (21% of the model, never narrowed by
`compress`) replaced by a rank-r factorisation, measured on the five held-out domains of `cli_domains.py`.

At 25% of all stored parameters removed, the decoder layers lose 31.7% of theirs because the embedding keeps all of
its own. A factorised tied embedding E ~ A B (A: vocab x r, B: r x d) stores vocab * r + r * d numbers instead of
vocab * d; what it costs the dense model, domain by domain, says whether moving part of the budget from the decoder
layers to the embedding can pay. Two choices of the rank-r factorisation, both E P with P a rank-r projection of the
hidden space (the input rows and the output head, tied, both become E P):

- "svd": P = V V^T, V the top-r right singular vectors of E (the least squares rank-r E; what the logits lose when
  the final hidden states are isotropic);
- "hidden": the least squares rank-r logits h E^T on the final (normed) hidden states h of calibration windows:
  with S = E Sigma^{1/2} (Sigma = E[h^T h]), P = Sigma^{1/2} V V^T Sigma^{-1/2}, V the top-r right singular vectors of
  S (an oblique projection: exact for the head's expected squared logit error, blind to what the input side loses).

Every figure is the dense model's with only the embedding changed (no compression, no healing): perplexity on 12
windows of 512 tokens per domain (the texts `gguf_llamacpp.py --prepare-only` writes) and its ratio to the unchanged
model's; "saved" is the share of all stored parameters the factorisation removes.

    python benchmarks/gguf_llamacpp.py --prepare-only     # the texts, once
    python benchmarks/embedding_rank.py                   # ranks 576 512 448 384 320 256, both choices

Writes results/embedding_rank.json and embedding_rank.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, save_figure, write_json
from domains import DESCRIPTIONS, DOMAINS, TARGET_DOMAINS, ratios

WORKDIR = RESULTS / "gguf_runs" / "full"
CHOICES = ("svd", "hidden")


def hidden_covariance(model, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """E[h^T h] (d, d) over every position of `windows` of the final normed hidden states, the vectors the tied head
    multiplies by E^T (float64)."""
    head = model.get_output_embeddings()
    total, count = torch.zeros(head.weight.shape[1], head.weight.shape[1], dtype=torch.float64), 0
    captured: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _module, args: captured.append(args[0].detach()))
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                model(input_ids=windows[start : start + batch_size])
                h = captured.pop().reshape(-1, head.weight.shape[1]).double()
                total += h.T @ h
                count += h.shape[0]
    finally:
        hook.remove()
    return total / count


def projection(embedding: torch.Tensor, rank: int, choice: str, covariance: torch.Tensor | None = None) -> torch.Tensor:
    """The rank-`rank` projection P (d, d) of the hidden space for which E P is `choice`'s factorised embedding
    (module docstring); float64."""
    d = embedding.shape[1]
    if not isinstance(rank, int) or not 1 <= rank <= d:
        raise ValueError(f"rank must be an integer in [1, {d}], got {rank!r}")
    if choice not in CHOICES:
        raise ValueError(f"unknown choice {choice!r}; known: {', '.join(CHOICES)}")
    e = embedding.double()
    if choice == "svd":
        v = torch.linalg.svd(e, full_matrices=False).Vh[:rank].T
        return v @ v.T
    if covariance is None:
        raise ValueError("the 'hidden' choice needs the final hidden states' covariance")
    values, vectors = torch.linalg.eigh(covariance.double())
    values = values.clamp_min(values.max() * 1e-10)
    root = vectors @ torch.diag(values.sqrt()) @ vectors.T
    inverse_root = vectors @ torch.diag(values.rsqrt()) @ vectors.T
    v = torch.linalg.svd(e @ root, full_matrices=False).Vh[:rank].T
    return root @ v @ v.T @ inverse_root


def factorised_parameters(vocab: int, d: int, rank: int) -> int:
    """Numbers a factorised embedding A (vocab x r) B (r x d) stores; never more than the dense vocab x d (at full
    rank the dense matrix is kept)."""
    return min(vocab * rank + rank * d, vocab * d)


def measure(
    model,
    texts: dict[str, torch.Tensor],
    ranks: list[int],
    calibration: torch.Tensor,
    source: dict | None = None,
    choices: tuple[str, ...] = CHOICES,
) -> dict:
    """Per choice and rank: the embedding's stored numbers, the share of the model saved, and each domain's
    perplexity with E replaced by E P (the model restored afterwards), its ratio to the unchanged model's.

    `source` ({"perplexity": {domain: ...}, "stored_parameters": n}) is the uncompressed model `model` was compressed
    from: each cell then also holds its ratios to the source's perplexities and the share of the source's stored
    parameters removed in all (the compression's and the factorisation's), and "saved_share" is a share of the
    source's."""
    from relational_hf.compress.eval import perplexity_on_windows, stored_parameters

    weight = model.get_input_embeddings().weight
    if model.get_output_embeddings() is None or model.get_output_embeddings().weight is not weight:
        raise SystemExit("embedding_rank.py measures a tied embedding; this model's head is untied")
    vocab, d = weight.shape
    total = stored_parameters(model)["total"]
    base = source["stored_parameters"] if source else total
    original = weight.detach().clone()
    dense = {name: perplexity_on_windows(model, ids) for name, ids in texts.items()}
    print("unchanged " + "  ".join(f"{k} {v:.2f}" for k, v in dense.items()), file=sys.stderr)
    covariance = hidden_covariance(model, calibration)
    cells: dict[str, dict] = {}
    for choice in choices:
        for rank in ranks:
            started = time.perf_counter()
            p = projection(original, rank, choice, covariance)
            with torch.no_grad():
                weight.copy_((original.double() @ p).to(weight.dtype))
            try:
                ppl = {name: perplexity_on_windows(model, ids) for name, ids in texts.items()}
            finally:
                with torch.no_grad():
                    weight.copy_(original)
            stored = factorised_parameters(vocab, d, rank)
            cell = {
                "choice": choice, "rank": rank, "embedding_stored": stored,
                "saved_share": (vocab * d - stored) / base, "perplexity": ppl, "ratio": ratios(ppl, dense),
                "seconds": round(time.perf_counter() - started, 1),
            }  # fmt: skip
            if source:
                cell["ratio_to_source"] = ratios(ppl, source["perplexity"])
                cell["removed_share_total"] = 1 - (total - (vocab * d - stored)) / base
            cells[f"{choice}@{rank}"] = cell
            worst = cell["ratio"].get("worst", max(cell["ratio"].values()))
            print(f"{choice}@{rank}: saved {cell['saved_share']:.3f}, worst x{worst:.3f}", file=sys.stderr)
    result = {"unchanged": dense, "stored_parameters": total, "embedding_shape": [vocab, d], "cells": cells}
    return result | ({"source": source} if source else {})


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [c for c in CHOICES if any(cell["choice"] == c for cell in payload["cells"].values())]
    compressed = any("ratio_to_source" in cell for cell in payload["cells"].values())
    key, share = ("ratio_to_source", "removed_share_total") if compressed else ("ratio", "saved_share")
    fig, axes = plt.subplots(1, len(present), figsize=(5.5 * len(present), 4.2), squeeze=False)
    axes = axes[0]
    for ax, choice in zip(axes, present, strict=True):
        cells = sorted((c for c in payload["cells"].values() if c["choice"] == choice), key=lambda c: c[share])
        x = [100 * c[share] for c in cells]
        ys = {domain: [c[key][domain] for c in cells] for domain in DOMAINS}
        if compressed:  # the compressed model as it is, the embedding whole: where each line starts
            x.insert(0, 100 * (1 - payload["stored_parameters"] / payload["source"]["stored_parameters"]))
            for domain in DOMAINS:
                ys[domain].insert(0, payload["unchanged"][domain] / payload["source"]["perplexity"][domain])
        for domain in DOMAINS:
            ax.plot(x, ys[domain], marker="o", label=domain)
        for c in cells:
            ax.annotate(f"r={c['rank']}", (100 * c[share], c[key]["worst"]), fontsize=7,
                        textcoords="offset points", xytext=(2, 4))  # fmt: skip
        model = payload["protocol"]["model"].split(",")[0].split(" (")[0]
        ax.set_title(f"{model}: tied embedding at rank r ({choice})", fontsize=10)
        ax.set_xlabel(
            "share of the source's stored parameters removed in all (%)" if compressed
            else "share of all stored parameters saved (%)"
        )  # fmt: skip
        ax.set_ylabel(("perplexity / source's" if compressed else "perplexity / unchanged model") + " (log)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("What a factorised tied embedding costs, per held-out domain", fontsize=11)
    save_figure(fig, path)


def source_figures(folder: Path) -> dict:
    """The source's perplexity on each domain and its stored parameters, from the compression report in `folder` (the
    command's `--eval texts/DOMAIN.pt` rows, measured on the same windows before compressing)."""
    import json

    report_path = folder / "compression_report.json"
    if not report_path.is_file():
        raise SystemExit(f"--model {folder}: no compression_report.json (give a folder `relational-hf compress` wrote)")
    report = json.loads(report_path.read_text(encoding="utf-8"))
    rows = {Path(name).stem: row for name, row in ((report.get("eval") or {}).get("texts") or {}).items()}
    missing = [d for d in DOMAINS if d not in rows]
    if missing or not report.get("parameters_before"):
        raise SystemExit(f"--model {folder}: its report has no --eval figures for {', '.join(missing) or 'the source'}")
    return {
        "perplexity": {d: rows[d]["perplexity_before"] for d in DOMAINS},
        "stored_parameters": report["parameters_before"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=WORKDIR, help="the texts of gguf_llamacpp.py --prepare-only")
    parser.add_argument("--ranks", type=int, nargs="+", default=[576, 512, 448, 384, 320, 256])
    parser.add_argument("--choices", nargs="+", choices=CHOICES, default=list(CHOICES))
    parser.add_argument("--calibration-windows", type=int, default=16,
                        help="WikiText-2 calibration windows for the 'hidden' choice's covariance (default 16)")  # fmt: skip
    parser.add_argument("--model", type=Path, default=None,
                        help="a compressed checkpoint of SmolLM2 to factorise instead of the source (ratios also to the "
                        "source, read from the checkpoint's compression report)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    texts_dir = args.workdir / "texts"
    missing = [d for d in ("calibration", *DOMAINS) if not (texts_dir / f"{d}.pt").is_file()]
    if missing:
        raise SystemExit(
            f"no {', '.join(missing)} in {texts_dir}: run `python benchmarks/gguf_llamacpp.py --prepare-only`"
        )
    if args.calibration_windows < 1:
        raise SystemExit("--calibration-windows must be >= 1")
    from transformers import AutoModelForCausalLM

    import relational_hf  # noqa: F401  (registers the relational architecture for --model)
    from relational_hf.pretrained import smollm2_checkpoint

    source = source_figures(args.model) if args.model else None
    path = args.model or smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    d = model.get_input_embeddings().weight.shape[1]
    bad = [r for r in args.ranks if not 1 <= r <= d]
    if bad:
        raise SystemExit(f"--ranks must lie in [1, {d}] (the hidden width); got {bad}")
    texts = {d_: torch.load(texts_dir / f"{d_}.pt") for d_ in DOMAINS}
    calibration = torch.load(texts_dir / "calibration.pt")[: args.calibration_windows]
    started = time.perf_counter()
    result = measure(model, texts, sorted(set(args.ranks), reverse=True), calibration, source, tuple(args.choices))
    payload = {
        "protocol": {
            "model": (
                f"{args.model.name}, compressed from SmolLM2-135M-Instruct by the command line (fp32)"
                if args.model
                else "SmolLM2-135M-Instruct (fp32), dense"
            )
            + "; only its tied embedding replaced by E P",  # fmt: skip
            "choices": {
                "svd": "P = V V^T, V the top-r right singular vectors of E",
                "hidden": "P = S^(1/2) V V^T S^(-1/2), V the top-r right singular vectors of E S^(1/2), S the final "
                "normed hidden states' second moment on the first calibration windows",
            },
            "calibration_windows": f"the first {args.calibration_windows} of texts/calibration.pt (WikiText-2)",
            "domains": {d_: DESCRIPTIONS[d_] for d_ in DOMAINS},
            "eval_windows": "12 x 512 tokens per domain (texts/DOMAIN.pt)",
            "worst": f"over {', '.join(TARGET_DOMAINS)}",
            "saved_share": "(vocab * d - (vocab * r + r * d)) / all stored parameters",
        },
        **result,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    path = write_json("embedding_rank" + (f"_{args.tag}" if args.tag else ""), payload)
    plot(payload, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
