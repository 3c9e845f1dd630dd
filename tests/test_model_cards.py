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


def test_the_compressed_card_shows_every_domain_beside_the_source_and_names_its_calibration():
    """The committed compressed card is today's default command line measured on several domains: its per-domain
    rows are its own report's figures (each ratio is the checkpoint's perplexity over the source's on that domain,
    the source's figure beside it), the calibration is named with the windows the source sampled, and no path of
    the machine that compressed it is in the card."""
    path = PROJECT_ROOT / "model_cards" / "smollm2-135m-instruct-relational-compressed.md"
    card = ModelCard.load(path)
    report = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))["report"]
    texts = report["eval"]["texts"]
    assert len(texts) >= 4
    names = [Path(n).stem for n in texts]
    assert "| dense source, perplexity | " + " | ".join(f"{r['perplexity_before']:.2f}" for r in texts.values()) in card.text
    ratios = [r["perplexity_after"] / r["perplexity_before"] for r in texts.values()]
    row = "| this checkpoint, as the command wrote it | " + " | ".join(f"x{x:.2f}" for x in ratios)
    assert f"{row} | x{max(ratios[:4]):.2f} |" in card.text
    assert "| | " + " | ".join(names) + " | worst of the first four |" in card.text
    from relational_hf.hub.card import calibration_description

    said = calibration_description(report)  # the texts block describes it as the library's card does, once
    assert f"- *Calibration text*: {said}" in card.text and "sampled from the source itself (" in said
    assert "calibration_sampled.safetensors" in card.text and "the rest of the same documents" not in card.text
    assert "/root" not in path.read_text(encoding="utf-8") and '"/' not in path.with_suffix(".json").read_text()


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


def _builder():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_reference", PROJECT_ROOT / "model_cards" / "build_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_card_of_several_domains_shows_each_beside_the_source_and_refuses_figures_of_another_model(tmp_path):
    """A compress report measured on several --eval texts gets one per-domain block: each domain's source perplexity,
    the checkpoint's ratio to it and, from a heal_domains result on the same checkpoint, the healed ratios with the
    dense control, the worst of the first four beside each row; the chosen WikiText-2 text becomes the model-index
    results. Figures of another model (another folder, other perplexities), a healed block without its domains and
    an --eval text the report lacks are refused; absolute paths of the report are cut to their names."""
    from relational_hf import RelationalConfig, RelationalForCausalLM

    folder = tmp_path / "compressed"
    RelationalForCausalLM(RelationalConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=32)).save_pretrained(folder)  # fmt: skip
    dense = {"wikitext": 30.0, "verse": 20.0, "code": 8.0, "chat": 25.0, "prose": 15.0}
    after = {"wikitext": 42.0, "verse": 36.0, "code": 12.0, "chat": 50.0, "prose": 33.0}
    texts = {f"{d}.pt": {"windows": [3, 64], "perplexity_before": dense[d], "perplexity_after": after[d],
                         "ratio": after[d] / dense[d]} for d in dense}  # fmt: skip
    report = {
        "method": "relational", "remove": 0.25, "source": "/somewhere/private/smollm2", "eval_windows": [3, 64],
        "eval": {"texts": texts, "worst_ratio": 2.2, "worst_text": "prose.pt"}, "calibration_windows": [6, 64],
        "calibration": {"text": "cal.pt", "user_windows": 4, "self_windows": 2,
                        "sampling": {"seed": 1, "chat_share": 0.5, "prompts": "calibration",
                                     "file": "calibration_sampled.safetensors"}},
    }  # fmt: skip
    (folder / "compression_report.json").write_text(json.dumps(report))
    domains = {"protocol": {"domains": {"code": "source code"}, "calibration": "four windows of a text"},
               "variants": {"default": {"perplexity": dict(after)}}}  # fmt: skip
    healed_after = {d: v * 0.9 for d, v in after.items()}
    healed = {"compressed": "compressed", "steps": 200, "perplexity": {"compressed": dict(after)},
              "ratio_to_dense": {"compressed, healed": {d: healed_after[d] / dense[d] for d in dense},
                                 "dense, healed": {d: 1.0 for d in dense}}}  # fmt: skip
    files = {}
    for name, payload in (("domains", domains), ("healed", healed)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(payload))
    argv = ["smollm2-compressed", "--from", str(folder), "--card-dir", str(tmp_path / "cards"), "--domains-from",
            str(files["domains"]), "--wikitext-eval", "wikitext.pt"]  # fmt: skip
    module = _builder()
    assert module.main([*argv, "--healed-domains", str(files["healed"])]) == 0
    card = ModelCard.load(tmp_path / "cards" / "smollm2-135m-instruct-relational-compressed.md")
    assert "| dense source, perplexity | 30.00 | 20.00 | 8.00 | 25.00 | 15.00 | |" in card.text
    assert "| this checkpoint, as the command wrote it | x1.40 | x1.80 | x1.50 | x2.00 | x2.20 | x2.00 |" in card.text
    assert "| the same after `--heal-steps 200` | x1.26 | x1.62 | x1.35 | x1.80 | x1.98 | x1.80 |" in card.text
    assert "| the dense source through the same healing (the control) | x1.00 |" in card.text
    assert "*code*: source code" in card.text and "four windows of a text" in card.text
    assert ": 4 of `cal.pt` and 2 sampled from the source itself (" in card.text  # the library card's description
    assert "/somewhere" not in (tmp_path / "cards" / "smollm2-135m-instruct-relational-compressed.md").read_text()
    values = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert values == {"perplexity, the dense source (converted exactly)": 30.0, "perplexity, compressed": 42.0}
    assert all(r.metric_args == {"window": 64, "windows": 3, "tokens": 192} for r in card.data.eval_results)
    # figures of another model are refused, naming the option
    for name, payload, flag in (
        ("healed", dict(healed, compressed="elsewhere"), "--healed-domains"),
        ("healed", dict(healed, perplexity={"compressed": healed_after}), "--healed-domains"),
        ("domains", dict(domains, variants={"x": {"perplexity": healed_after}}), "--domains-from"),
    ):
        files[name].write_text(json.dumps(payload))
        with pytest.raises(SystemExit, match=flag):
            module.main([*argv, "--healed-domains", str(files["healed"])])
        files["domains"].write_text(json.dumps(domains))
        files["healed"].write_text(json.dumps(healed))
    with pytest.raises(SystemExit, match="needs --domains-from"):
        module.main(argv[:5] + ["--healed-domains", str(files["healed"])])
    with pytest.raises(SystemExit, match="--wikitext-eval test.pt"):
        module.main(argv[:-1] + ["test.pt"])


@pytest.mark.parametrize(
    ("calibration", "expected", "absent"),
    [
        # the user's text alone: nothing sampled, no sampling settings
        ({"text": "/data/cal.txt", "user_windows": 8, "self_windows": 0}, "8 windows of 64 tokens: 8 of `cal.txt`", "("),
        # no text given: every window sampled, with the settings the report records and only those
        (
            {"self_windows": 8, "sampling": {"seed": 3, "file": "calibration_sampled.safetensors"}},
            "8 windows of 64 tokens, all sampled from the source itself (no text given) (seed 3); the sampled "
            "windows are in `calibration_sampled.safetensors`",
            "temperature",
        ),
        # a report from before the settings were recorded: the windows, no empty parentheses
        ({"text": "cal.txt", "user_windows": 6, "self_windows": 2, "sampling": {}},
         "8 windows of 64 tokens: 6 of `cal.txt` and 2 sampled from the source itself", "()"),  # fmt: skip
        # every sampled row from a request: no "others" to describe
        (
            {"text": "cal.txt", "user_windows": 6, "self_windows": 2,
             "sampling": {"temperature": 1.0, "chat_share": 1.0, "prompts": "calibration"}},  # fmt: skip
            "2 sampled from the source itself (at temperature 1; 100% of the rows start from a request of the "
            "'calibration' prompt set in its chat template)",
            "random token",
        ),
    ],
)
def test_the_calibration_is_described_from_what_the_report_records(calibration, expected, absent):
    """The one description of a compression's calibration (the library's card and the reference cards): each text by
    its name only, the sampled windows with the settings recorded and no others, the file that keeps them."""
    from relational_hf.hub.card import calibration_description, compression_markdown

    report = {"calibration_windows": [8, 64], "calibration": calibration}
    said = calibration_description(report)
    assert expected in said and absent not in said and "/data" not in said
    assert f"Calibration: {said}." in compression_markdown(report)
    assert calibration_description({"calibration": calibration}) is None  # no windows recorded: nothing claimed
