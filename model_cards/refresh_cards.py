"""Rebuild the committed cards' metadata (`model-index`) and their Evaluation and Figures sections from the JSON each
card was written with, without the checkpoints (which are not in the repository). Every number stays the run's.

    python model_cards/refresh_cards.py            # every card of model_cards/

The same functions build a new card (`build_reference.py`, `smollm2_cards.py`); this script only brings the committed
cards to the metadata they would be built with today.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard

from relational_hf.hub.card import TEMPLATES
from relational_hf.hub.reference_cards import PRESETS, reference_eval_results, reference_figures

HERE = Path(__file__).resolve().parent


def _smollm2_cards():
    spec = importlib.util.spec_from_file_location("smollm2_cards", HERE / "smollm2_cards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def card_inputs(numbers: dict) -> tuple[list[dict], str | None]:
    """(model-index results, figures markdown) of the card whose JSON is `numbers`."""
    name = numbers["name"]
    reference = {spec.name: spec for spec in PRESETS.values()}
    if name in reference:
        spec = reference[name]
        results = reference_eval_results(spec, numbers["val_perplexity"], numbers["val_loss"], numbers["val_tokens"])
        return results, reference_figures(spec, numbers["unigram_perplexity"])
    cards = _smollm2_cards()
    if name == cards.CONVERTED_NAME:
        return cards.converted_eval_results(numbers), None
    if name == cards.COMPRESSED_NAME:
        report, control = numbers["report"], numbers.get("control")
        results = cards.compressed_card_inputs(report)[1]
        if control is not None and cards._is_wikitext(report):
            windows, window = report["eval_windows"][:2]
            results += [
                cards.wikitext_result(label, control[key], windows, window, cards.HELD_OUT)
                for label, key in (
                    ("perplexity, the dense control before healing", "perplexity_before"),
                    ("perplexity, the dense control after the same healing", "perplexity_after"),
                )
            ]
        blocks = cards.compressed_figures(report, control)
        domains = HERE.parent / cards.DOMAINS_JSON
        if numbers.get("domains") and domains.is_file():  # the card shows the benchmark's per-domain cells
            blocks.append(cards.domain_figures(json.loads(domains.read_text(encoding="utf-8")), numbers["domains"]))
        return results, "\n\n".join(b for b in blocks if b)
    raise ValueError(f"no card builder is known for {name!r}")


def refresh(card_path: Path) -> None:
    """Rewrite `card_path` (NAME.md beside NAME.json): its model-index and its Evaluation and Figures sections."""
    numbers = json.loads(card_path.with_suffix(".json").read_text(encoding="utf-8"))
    results, figures = card_inputs(numbers)
    card = ModelCard(card_path.read_text(encoding="utf-8"))
    card.data.eval_results = [EvalResult(**result) for result in results]
    card.data.model_name = card.data.model_name or numbers["name"]
    evaluation = TEMPLATES.get_template("evaluation.md").render(evaluation=card.data.eval_results).strip()
    sections = f"## Evaluation\n\n{evaluation}\n\n" + (f"## Figures\n\n{figures.strip()}\n\n" if figures else "")
    text, count = re.subn(r"## Evaluation\n.*?(?=## How to load)", lambda _: sections, card.text, flags=re.S)
    if count != 1:
        raise ValueError(f"{card_path}: no single Evaluation section before 'How to load'")
    card.text = text
    card_path.write_text(str(card), encoding="utf-8")


def main() -> int:
    for path in sorted(HERE.glob("*.md")):
        if path.with_suffix(".json").is_file():
            refresh(path)
            print(f"refreshed {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
