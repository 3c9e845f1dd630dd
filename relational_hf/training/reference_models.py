"""Train the project's reference checkpoints (`build_reference`); their specifications and cards are in
`relational_hf.hub.reference_cards`.

`build_reference(PRESETS[name], ...)` trains one of the reference relational models on a corpus of
`../shared/data`, measures it (validation perplexity, the unigram baseline, parameter counts against the free gauge
and a Llama of the same dimensions, the redundant dimensions left) and writes the checkpoint with a model card whose
numbers come from that run. The card names (`PRESETS`, `ReferenceSpec`, `reference_card`, `card_for_checkpoint`,
...) and `document_split` stay importable from here.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import set_seed

from ..hub.reference_cards import (
    PRESETS,
    ReferenceResult,
    ReferenceSpec,
    card_for_checkpoint,
    parameter_table,
    reference_card,
)
from ..lm.data import (
    RandomBlockDataset,
    byte_level_tokenizer,
    document_split,
    encode,
    lm_blocks,
    split_text,
    train_bpe_tokenizer,
    unigram_perplexity,
)
from ..lm.metrics import token_nll
from ..modeling import RelationalConfig, RelationalForCausalLM
from ..outputs import save_checkpoint
from ..params import llama_parameter_count, relational_parameter_count
from .arguments import RelationalTrainingArguments
from .callbacks import TimeLimitCallback
from .trainer import RelationalTrainer


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
    save_checkpoint(model, tokenizer, output_dir)
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


__all__ = [
    "PRESETS",
    "ReferenceResult",
    "ReferenceSpec",
    "build_reference",
    "card_for_checkpoint",
    "document_split",
    "parameter_table",
    "reference_card",
    "replace_config",
]
