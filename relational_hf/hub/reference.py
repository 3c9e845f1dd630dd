"""Reference checkpoints and measured model cards.

`build_reference(PRESETS[name], ...)` trains one of the project's reference relational models on a corpus of
`../shared/data`, measures it (validation perplexity, the unigram baseline, parameter counts against the free gauge
and a Llama of the same dimensions, the redundant dimensions left) and writes the checkpoint with a model card whose
numbers come from that run. `card_for_checkpoint` measures an existing checkpoint on a text and builds its card
(used by `training_scripts/push_to_hub.py`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard
from transformers import set_seed

from ..hub import build_model_card
from ..modeling import RelationalConfig, RelationalForCausalLM
from ..params import llama_parameter_count, relational_parameter_count
from .arguments import RelationalTrainingArguments
from .data import (
    RandomBlockDataset,
    byte_level_tokenizer,
    encode,
    lm_blocks,
    split_text,
    train_bpe_tokenizer,
    unigram_perplexity,
)
from .metrics import perplexity, token_nll
from .pretrain import TimeLimitCallback, save_atomically
from .trainer import RelationalTrainer

logger = logging.getLogger(__name__)


@dataclass
class ReferenceSpec:
    """One reference model: corpus, tokenizer, split, dimensions and training budget."""

    name: str
    text_file: str  # relative to the project root
    dataset_id: str  # Hub dataset id for the card metadata
    dataset_name: str
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
    ),
    "wikitext2": ReferenceSpec(
        name="relational-wikitext2-bpe",
        text_file="../shared/data/wikitext-2/valid.txt",
        dataset_id="Salesforce/wikitext",
        dataset_name="WikiText-2 validation split, last 10% of its documents",
        tokenizer="bpe",
        split="documents",
        # the training text is 0.4M tokens: 400 steps (1.7 epochs) reached validation perplexity 121.1, while the
        # 10-minute budget (2,830 steps, 12 epochs) overfit to 294.0
        max_steps=400,
    ),
}


def document_split(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """Split WikiText at the top-level `= Title =` heading closest to the (1 - val_fraction) mark: whole documents
    train, whole documents validate."""
    starts = [m.start() for m in re.finditer(r"^ = [^=\n].* = \s*$", text, flags=re.MULTILINE)]
    if len(starts) < 2:
        return split_text(text, val_fraction)
    mark = (1.0 - val_fraction) * len(text)
    cut = min(starts[1:], key=lambda s: abs(s - mark))
    return text[:cut], text[cut:]


@dataclass
class ReferenceResult:
    """What `build_reference` measured."""

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


def build_reference(
    spec: ReferenceSpec,
    project_root: str | Path = ".",
    output_dir: str | Path | None = None,
    card_path: str | Path | None = None,
    repo_id: str | None = None,
) -> ReferenceResult:
    """Train the reference model `spec` describes, measure it, save checkpoint + tokenizer + README.md (the card) to
    `output_dir` (default checkpoints/<name>), also write the card to `card_path` and the numbers next to it as
    JSON. The text is read from `project_root / spec.text_file`."""
    path = Path(project_root) / spec.text_file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: reference corpus not found (see ../shared/data/README.md)")
    set_seed(spec.seed)
    started = time.monotonic()
    text = path.read_text(encoding="utf-8")
    train_text, val_text = document_split(text) if spec.split == "documents" else split_text(text)
    tokenizer = (
        byte_level_tokenizer()
        if spec.tokenizer == "byte"
        else train_bpe_tokenizer(train_text.splitlines(), spec.bpe_vocab_size)
    )
    train_ids, val_ids = encode(tokenizer, train_text), encode(tokenizer, val_text)
    config = RelationalConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        max_position_embeddings=max(spec.block_size, 256),
        gauge=spec.gauge,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = RelationalForCausalLM(config)
    output_dir = Path(output_dir or Path("checkpoints") / spec.name)
    args = RelationalTrainingArguments(
        output_dir=str(output_dir / "trainer_state"),
        per_device_train_batch_size=spec.batch_size,
        max_steps=spec.max_steps,
        learning_rate=spec.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=spec.warmup_steps,
        adam_beta2=0.99,
        logging_steps=100,
        save_strategy="no",
        report_to=[],
        seed=spec.seed,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = RelationalTrainer(
        model=model,
        args=args,
        train_dataset=RandomBlockDataset(train_ids, spec.block_size, spec.max_steps * spec.batch_size, spec.seed),
        callbacks=[TimeLimitCallback(spec.max_minutes * 60.0 - (time.monotonic() - started))],
    )
    trainer.train()
    val_blocks = lm_blocks(val_ids, spec.block_size)[: spec.eval_blocks]
    nll, count = token_nll(model, val_blocks, progress=True)
    redundant = _redundancy(model)
    result = ReferenceResult(
        name=spec.name,
        output_dir=str(output_dir),
        steps=trainer.state.global_step,
        seconds=time.monotonic() - started,
        train_tokens=train_ids.numel(),
        val_tokens=count,
        val_loss=nll / count,
        val_perplexity=math.exp(nll / count),
        unigram_perplexity=unigram_perplexity(train_ids, val_ids, len(tokenizer)),
        parameters=sum(p.numel() for p in model.parameters()),
        free_gauge_parameters=relational_parameter_count(replace_config(config, gauge="free")),
        llama_parameters=llama_parameter_count(config),
        redundant_dimensions=None if redundant is None else redundant.redundant_dimensions,
        redundant_by_group={} if redundant is None else redundant.by_group,
        settings=asdict(spec),
    )
    save_atomically(model, tokenizer, output_dir)
    card = reference_card(result, spec, output_dir, repo_id or f"relational-hf/{spec.name}")
    card.save(output_dir / "README.md")
    if card_path is not None:
        card_path = Path(card_path)
        card_path.parent.mkdir(parents=True, exist_ok=True)
        card.save(card_path)
        card_path.with_suffix(".json").write_text(json.dumps(asdict(result), indent=2) + "\n", encoding="utf-8")
    return result


def replace_config(config: RelationalConfig, **changes: Any) -> RelationalConfig:
    """A copy of `config` with `changes` applied."""
    return RelationalConfig(**{**config.to_dict(), **changes})


def _redundancy(model: torch.nn.Module):
    """The gauge dimensions left in storage (`relational_hf.symmetry.redundancy_report`), None if not computable."""
    from ..symmetry import redundancy_report

    try:
        return redundancy_report(model, descriptors=False)
    except ValueError:
        return None


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
    eval_results = [
        dict(
            task_type="text-generation",
            dataset_type=spec.dataset_id,
            dataset_name=spec.dataset_name,
            metric_type="perplexity",
            metric_name="validation perplexity (per token)",
            metric_value=round(result.val_perplexity, 4),
        ),
        dict(
            task_type="text-generation",
            dataset_type=spec.dataset_id,
            dataset_name=spec.dataset_name,
            metric_type="loss",
            metric_name="validation loss (nats per token)",
            metric_value=round(result.val_loss, 4),
        ),
        dict(
            task_type="text-generation",
            dataset_type=spec.dataset_id,
            dataset_name=spec.dataset_name,
            metric_type="perplexity",
            metric_name="unigram baseline perplexity",
            metric_value=round(result.unigram_perplexity, 4),
        ),
    ]
    return build_model_card(
        checkpoint_dir,
        repo_id,
        datasets=[spec.dataset_id],
        training_settings=settings,
        eval_results=eval_results,
        parameter_table=parameter_table(result),
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
        eval_results.append(
            dict(
                task_type="text-generation",
                dataset_type=dataset_id or name,
                dataset_name=name,
                metric_type="perplexity",
                metric_value=round(measured["perplexity"], 4),
            )
        )
    card = build_model_card(
        checkpoint_dir,
        repo_id,
        base_model=base_model,
        datasets=[dataset_id] if dataset_id else None,
        license=license,
        eval_results=eval_results,
    )
    return card, measured


__all__ = [
    "PRESETS",
    "ReferenceResult",
    "ReferenceSpec",
    "build_reference",
    "card_for_checkpoint",
    "document_split",
    "parameter_table",
    "reference_card",
]
