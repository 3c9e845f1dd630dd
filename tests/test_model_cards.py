"""Every committed model card (model_cards/*.md) has metadata by the Hub's schema, read with huggingface_hub's own
card classes (`ModelCard`, `ModelCardData`, `EvalResult`): its `model-index` results name a real Hub dataset with its
configuration and split, and give the metric, the window length, the number of windows and the token count; texts
that are not a Hub dataset (calibration text, the text a source sampled for healing, a baseline) are in the body.
The template the cards are built from (relational_hf/hub/templates/) gives the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CARDS = sorted((PROJECT_ROOT / "model_cards").glob("*.md"))
CARDS = [card for card in CARDS if card.with_suffix(".json").is_file()]  # model_cards/README.md is no card
#: the Hub datasets the project's figures are measured on (`relational_hf.lm.corpora`)
DATASETS = {"Salesforce/wikitext": {"wikitext-2-v1"}, "karpathy/tiny_shakespeare": {"default"}}
SPLITS = {"train", "validation", "test"}
NOT_DATASETS = ("calibration", "heal", "control", "compress", "report", "unigram", ".txt")


def test_there_are_cards_to_check():
    assert len(CARDS) >= 4


@pytest.mark.parametrize("path", CARDS, ids=[p.stem for p in CARDS])
def test_card_metadata_follows_the_hub_schema(path):
    card = ModelCard.load(path)
    assert isinstance(card.data, ModelCardData)
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation" and data.license
    assert data.eval_results, "a card without results"
    assert data.model_name == json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))["name"]
    for result in data.eval_results:
        assert isinstance(result, EvalResult)
        assert result.task_type == "text-generation"
        assert result.dataset_type in DATASETS, f"{result.dataset_type!r} is not a Hub dataset the figures come from"
        assert result.dataset_config in DATASETS[result.dataset_type]
        assert set(result.dataset_split.split("+")) <= SPLITS
        assert not any(word in result.dataset_name.lower() for word in NOT_DATASETS), result.dataset_name
        assert result.metric_type in {"perplexity", "loss"} and result.metric_value > 0
        args = result.metric_args
        assert {"window", "windows", "tokens"} <= set(args) and args["tokens"] == args["window"] * args["windows"] > 0
    # the metadata survives huggingface_hub's own round trip: model-index -> EvalResults -> model-index
    name, results = model_index_to_eval_results(eval_results_to_model_index(data.model_name, data.eval_results))
    assert name == data.model_name and results == data.eval_results
    if data.datasets:
        assert set(data.datasets) <= set(DATASETS)


@pytest.mark.parametrize("path", CARDS, ids=[p.stem for p in CARDS])
def test_card_body_shows_every_result_with_its_windows(path):
    card = ModelCard.load(path)
    for result in card.data.eval_results:
        args = result.metric_args
        row = f"| {result.metric_name} | {args['windows']} x {args['window']} ({args['tokens']:,}) | {result.metric_value} |"
        assert row in card.text


def test_the_compressed_card_describes_calibration_and_healing_texts_in_its_body():
    card = ModelCard.load(PROJECT_ROOT / "model_cards" / "smollm2-135m-instruct-relational-compressed.md")
    assert "*Calibration text*" in card.text and "*Healing text*" in card.text and "sampled itself" in card.text
    assert "| calibration text | 19.50 | 21.75 | 21.49 |" in card.text


def test_a_card_built_from_the_template_follows_the_same_schema(tmp_path):
    from relational_hf import RelationalConfig, RelationalForCausalLM
    from relational_hf.hub import build_model_card

    RelationalForCausalLM(RelationalConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=32)).save_pretrained(tmp_path)  # fmt: skip
    result = dict(
        task_type="text-generation", dataset_type="Salesforce/wikitext", dataset_name="WikiText-2 validation",
        dataset_config="wikitext-2-v1", dataset_split="validation", metric_type="perplexity", metric_value=12.5,
        metric_name="perplexity", metric_args={"window": 64, "windows": 4, "tokens": 256},
    )  # fmt: skip
    card = build_model_card(tmp_path, "me/tiny", eval_results=[result], figures="Calibration text: perplexity 9.")
    loaded = ModelCard(str(card))
    (parsed,) = loaded.data.eval_results
    assert (parsed.dataset_config, parsed.dataset_split, parsed.metric_args) == (
        "wikitext-2-v1", "validation", {"window": 64, "windows": 4, "tokens": 256}
    )  # fmt: skip
    assert "| perplexity | 4 x 64 (256) | 12.5 |" in loaded.text
    assert "## Figures\n\nCalibration text: perplexity 9." in loaded.text
