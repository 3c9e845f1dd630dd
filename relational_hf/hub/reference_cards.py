"""Reference checkpoints: their specifications and measured model cards.

`PRESETS` names the project's reference relational models (corpus of `../shared/data`, tokenizer, split,
dimensions, training budget). `reference_card(result, spec, ...)` builds the card of a trained reference model from
what `relational_hf.training.reference_models.build_reference` measured (validation perplexity, the unigram baseline,
parameter counts against the free gauge and a Llama of the same dimensions, the redundant dimensions left);
`card_for_checkpoint` measures an existing checkpoint on a text and builds its card (used by
`training_scripts/push_to_hub.py`). Training itself lives in `relational_hf.training.reference_models`: this module
imports no Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard

from ..lm.data import encode, lm_blocks
from ..lm.metrics import perplexity
from .card import build_model_card


@dataclass
class ReferenceSpec:
    """One reference model: corpus, tokenizer, split, dimensions and training budget."""

    name: str
    text_file: str  # relative to the project root
    dataset_id: str  # Hub dataset id for the card metadata
    dataset_name: str
    dataset_config: str  # the Hub dataset's configuration the text file is
    dataset_split: str  # the Hub dataset's split(s) the held-out part comes from
    tokenizer: str = "byte"  # "byte" (256 bytes: characters of ASCII text) or "bpe" (trained on the train split)
    split: str = "lines"  # "lines": last 10% of the text; "documents": last 10% of the `= Title =` documents
    bpe_vocab_size: int = 4096
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 384
    gauge: str = "pivot"
    block_size: int = 128
    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    max_steps: int = 3000
    max_minutes: float = 10.0
    eval_blocks: int = 128
    seed: int = 0


PRESETS: dict[str, ReferenceSpec] = {
    "tinyshakespeare-char": ReferenceSpec(
        name="relational-tinyshakespeare-char",
        text_file="../shared/data/tinyshakespeare/input.txt",
        dataset_id="karpathy/tiny_shakespeare",
        dataset_name="Tiny Shakespeare (characters; last 10% of the text)",
        dataset_config="default",
        # the Hub dataset's three splits make up the text in order; its train split is the first 90%
        dataset_split="validation+test",
    ),
    "wikitext2": ReferenceSpec(
        name="relational-wikitext2-bpe",
        text_file="../shared/data/wikitext-2/valid.txt",
        dataset_id="Salesforce/wikitext",
        dataset_name="WikiText-2 validation split, last 10% of its documents",
        dataset_config="wikitext-2-v1",
        dataset_split="validation",
        tokenizer="bpe",
        split="documents",
        # the training text is 0.4M tokens: 400 steps (1.7 epochs) reached validation perplexity 121.1, while the
        # 10-minute budget (2,830 steps, 12 epochs) overfit to 294.0
        max_steps=400,
    ),
}


@dataclass
class ReferenceResult:
    """What `relational_hf.training.reference_models.build_reference` measured."""

    name: str
    output_dir: str
    steps: int
    seconds: float
    train_tokens: int
    val_tokens: int
    val_loss: float
    val_perplexity: float
    unigram_perplexity: float
    parameters: int
    free_gauge_parameters: int
    llama_parameters: int
    redundant_dimensions: int | None
    redundant_by_group: dict[str, int]
    settings: dict[str, Any]


def parameter_table(result: ReferenceResult) -> str:
    """Markdown: this checkpoint's stored parameters next to the same dimensions in the free gauge and as a Llama."""
    rows = [
        ("this checkpoint (relational, pivot gauge)", result.parameters),
        ("same dimensions, relational free gauge", result.free_gauge_parameters),
        ("same dimensions, Transformers Llama (with RMSNorm gains)", result.llama_parameters),
    ]
    lines = ["| model | parameters | vs Llama |", "|---|---:|---:|"]
    for label, count in rows:
        change = 100.0 * (count - result.llama_parameters) / result.llama_parameters
        lines.append(
            f"| {label} | {count:,} | {'baseline' if count == result.llama_parameters else f'{change:+.2f}%'} |"
        )
    if result.redundant_dimensions is not None:
        groups = ", ".join(f"{name} {dim:,}" for name, dim in sorted(result.redundant_by_group.items()))
        lines += [
            "",
            f"Symmetry (gauge) dimensions still stored in this checkpoint: {result.redundant_dimensions:,}"
            + (f" ({groups})." if groups else "."),
        ]
    return "\n".join(lines)


def reference_card(result: ReferenceResult, spec: ReferenceSpec, checkpoint_dir: str | Path, repo_id: str) -> ModelCard:
    """The model card of a reference checkpoint, every number taken from `result`."""
    settings = {
        "corpus": f"{spec.text_file} ({'document' if spec.split == 'documents' else 'line'} split, 90% / 10%)",
        "tokenizer": "byte-level (characters of the ASCII text)"
        if spec.tokenizer == "byte"
        else f"byte-level BPE, vocabulary {spec.bpe_vocab_size}, trained on the train split",
        "train tokens": f"{result.train_tokens:,}",
        "context length": spec.block_size,
        "batch size": spec.batch_size,
        "optimizer": f"AdamW (beta2 0.99), peak LR {spec.learning_rate:g}, cosine, {spec.warmup_steps} warm-up steps",
        "steps trained": f"{result.steps:,} (budget {spec.max_steps:,} steps or {spec.max_minutes:g} minutes)",
        "wall-clock": f"{result.seconds / 60:.1f} minutes on {_device()}",
        "command": f"python model_cards/build_reference.py {_preset_name(spec)} --max-steps {spec.max_steps} "
        f"--max-minutes {spec.max_minutes:g}" + (f" --seed {spec.seed}" if spec.seed else ""),
    }
    return build_model_card(
        checkpoint_dir,
        repo_id,
        datasets=[spec.dataset_id],
        training_settings=settings,
        eval_results=reference_eval_results(spec, result.val_perplexity, result.val_loss, result.val_tokens),
        parameter_table=parameter_table(result),
        figures=reference_figures(spec, result.unigram_perplexity),
    )


def reference_eval_results(spec: ReferenceSpec, perplexity: float, loss: float, tokens: int) -> list[dict[str, Any]]:
    """The model-index results of a reference card (`huggingface_hub.EvalResult` fields): validation perplexity and
    loss on the held-out part of the spec's Hub dataset (id, configuration, split), with the window length, the number
    of windows and the tokens they hold as the metric's `args`."""
    window = spec.block_size
    dataset = dict(
        task_type="text-generation",
        dataset_type=spec.dataset_id,
        dataset_name=spec.dataset_name,
        dataset_config=spec.dataset_config,
        dataset_split=spec.dataset_split,
        dataset_args={"held_out": "documents, last 10%" if spec.split == "documents" else "text, last 10%"},
    )
    args = {"window": window, "windows": tokens // window, "tokens": tokens}
    return [
        dict(**dataset, metric_type="perplexity", metric_name="validation perplexity (per token)",
             metric_value=round(perplexity, 4), metric_args=args),
        dict(**dataset, metric_type="loss", metric_name="validation loss (nats per token)",
             metric_value=round(loss, 4), metric_args=args),
    ]  # fmt: skip


def reference_figures(spec: ReferenceSpec, unigram_perplexity: float) -> str:
    """The card body's figures that are not the model's results: the unigram baseline of the same held-out text."""
    return (
        f"Unigram baseline on the same held-out text (the train part's token frequencies, no model): perplexity "
        f"{unigram_perplexity:.4f}. A model that learned nothing beyond token frequencies scores this."
    )


def _preset_name(spec: ReferenceSpec) -> str:
    return next((key for key, preset in PRESETS.items() if preset.name == spec.name), spec.name)


def _device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    threads = torch.get_num_threads()
    return f"CPU ({threads} thread{'' if threads == 1 else 's'})"


def card_for_checkpoint(
    checkpoint_dir: str | Path,
    repo_id: str,
    *,
    eval_text: str | Path | None = None,
    dataset_id: str | None = None,
    dataset_name: str | None = None,
    block_size: int = 256,
    max_blocks: int = 64,
    base_model: str | None = None,
    license: str = "apache-2.0",
) -> tuple[ModelCard, dict[str, float]]:
    """Build the card of an existing checkpoint; with `eval_text`, measure its perplexity on that text (model and
    tokenizer loaded from the checkpoint) and put it in the card's model-index. Returns (card, measured numbers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    measured: dict[str, float] = {}
    eval_results = []
    figures = None
    if eval_text is not None:
        model = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        ids = encode(tokenizer, Path(eval_text).read_text(encoding="utf-8"))
        blocks = lm_blocks(ids, block_size)[:max_blocks]
        if blocks.shape[0] == 0:
            raise ValueError(f"{eval_text} holds fewer than {block_size} tokens: nothing to evaluate")
        measured["perplexity"] = perplexity(model, blocks, progress=True)
        measured["parameters"] = float(sum(p.numel() for p in model.parameters()))
        name = dataset_name or Path(eval_text).name
        windows = int(blocks.shape[0])
        args = {"window": block_size, "windows": windows, "tokens": windows * block_size}
        if dataset_id:  # a Hub dataset: a model-index result
            eval_results.append(
                dict(
                    task_type="text-generation",
                    dataset_type=dataset_id,
                    dataset_name=name,
                    metric_type="perplexity",
                    metric_value=round(measured["perplexity"], 4),
                    metric_args=args,
                )
            )
        else:  # a text file of the user's: described in the card's body, not posed as a dataset
            figures = (
                f"Perplexity on the text file `{name}` ({windows} windows of {block_size} tokens): "
                f"{measured['perplexity']:.4f}."
            )
    card = build_model_card(
        checkpoint_dir,
        repo_id,
        base_model=base_model,
        datasets=[dataset_id] if dataset_id else None,
        license=license,
        eval_results=eval_results,
        figures=figures,
    )
    return card, measured


__all__ = [
    "PRESETS",
    "ReferenceResult",
    "ReferenceSpec",
    "card_for_checkpoint",
    "parameter_table",
    "reference_card",
]
