"""The fine-tuning job and the training scripts: LoRA and full fine-tuning run end to end and report perplexity and
parameter counts; every script's --help documents every flag."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from hub_server import hub_server  # noqa: F401  (a fixture: a local Hub-protocol server)
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.commands import finetune
from relational_hf.lm.data import byte_level_tokenizer, generate_corpus
from relational_hf.modeling import GaugeFixedLinear

SCRIPTS = Path(__file__).resolve().parents[1] / "training_scripts"



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny pivot-gauge relational model with the byte-level tokenizer, and a training text."""
    root = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(0)
    tokenizer = byte_level_tokenizer()
    config = RelationalConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    RelationalForCausalLM(config).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    (root / "train.txt").write_text(generate_corpus(1500, seed=5), encoding="utf-8")
    return root


def run(checkpoint: Path, capsys, *flags: str) -> str:
    common = ["--train-file", str(checkpoint / "train.txt"), "--block-size", "32", "--batch-size", "8"]
    common += ["--max-steps", "15", "--eval-blocks", "4", "--logging-steps", "5", "--learning-rate", "1e-2"]
    assert finetune.main([str(checkpoint / "base"), *common, *flags]) == 0
    return capsys.readouterr().out


def summary_numbers(printed: str) -> tuple[float, float, int, int]:
    ppl = printed.split("validation perplexity:")[1].split()
    counts = printed.split("parameters:")[1].split()
    return float(ppl[0]), float(ppl[2]), int(counts[0].replace(",", "")), int(counts[2].replace(",", ""))


def test_lora_finetune_reports_perplexity_and_counts_and_saves_adapter_and_merged_model(checkpoint, capsys, tmp_path):
    out = tmp_path / "lora"
    printed = run(checkpoint, capsys, "--method", "lora", "--lora-r", "4", "--merge", "--output-dir", str(out))
    before, after, total, trainable = summary_numbers(printed)
    assert after < before
    base = sum(p.numel() for p in RelationalForCausalLM.from_pretrained(checkpoint / "base").parameters())
    assert 0 < trainable < total and total - trainable == base  # only the adapters train
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert isinstance(merged.model.layers[0].self_attn.k_proj, GaugeFixedLinear)


def test_full_finetune_with_projection_and_suppression_saves_a_loadable_model(checkpoint, capsys, tmp_path):
    out = tmp_path / "full"
    printed = run(
        checkpoint, capsys, "--projection", "update", "--parallel-suppression", "0.05",
        "--parallel-suppression-site", "value", "--gradient-accumulation-steps", "2", "--output-dir", str(out),
    )  # fmt: skip
    before, after, total, trainable = summary_numbers(printed)
    assert after < before and total == trainable
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "relational-transformer"


def test_contradictory_flags_are_refused(checkpoint, capsys):
    for flags, words in ((["--method", "lora", "--projection", "update"], "--method full"), (["--merge"], "--merge")):
        assert finetune.main([str(checkpoint / "base"), *flags]) == 2  # one line naming the flags, status 2
        assert words in capsys.readouterr().err


def _parser_of(script: str) -> argparse.ArgumentParser:
    """The argparse parser a script builds (captured when its main() parses --help)."""
    spec = importlib.util.spec_from_file_location(f"script_{script}", SCRIPTS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    captured = []
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured.append(self)
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_args = capture
    try:
        code = module.main(["--help"])
    except SystemExit as stop:
        code = stop.code
    finally:
        argparse.ArgumentParser.parse_args = original
    assert code == 0
    return captured[0]


@pytest.mark.parametrize(
    "script",
    [
        "finetune",
        "convert",
        "push_to_hub",
        "analyze",
        "pretrain",
    ],
)
def test_every_script_flag_has_help(script, capsys):
    parser = _parser_of(script)
    assert parser.description
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help and action.help.strip(), f"{script}: {action.option_strings or action.dest} has no help"
    assert "usage:" in capsys.readouterr().out


def test_reference_builder_help_names_its_presets(capsys):
    spec = importlib.util.spec_from_file_location(
        "build_reference", SCRIPTS.parent / "model_cards" / "build_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    printed = capsys.readouterr().out
    assert "tinyshakespeare-char" in printed and "wikitext2" in printed


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_reference_card_numbers_come_from_the_run(shared_data, tmp_path):
    """A (tiny, 4-step) reference build on Tiny Shakespeare: the card's model-index and tables carry exactly the
    numbers the run measured and wrote to JSON."""
    import json
    from dataclasses import replace

    from relational_hf.training.reference_models import PRESETS, build_reference

    spec = replace(
        PRESETS["tinyshakespeare-char"], hidden_size=32, layers=1, heads=2, intermediate_size=64, block_size=32,
        batch_size=4, max_steps=4, warmup_steps=1, eval_blocks=4,
    )  # fmt: skip
    card_path = tmp_path / "cards" / "reference.md"
    result = build_reference(spec, SCRIPTS.parent, tmp_path / "ckpt", card_path, "me/reference")
    saved = json.loads(card_path.with_suffix(".json").read_text())
    assert saved["val_perplexity"] == result.val_perplexity and saved["steps"] == result.steps == 4
    card = ModelCard.load(card_path)
    metrics = card.data.eval_results
    assert metrics[0].metric_value == round(result.val_perplexity, 4)
    assert (metrics[0].dataset_type, metrics[0].dataset_config, metrics[0].dataset_split) == (
        "karpathy/tiny_shakespeare", "default", "validation+test"
    )  # fmt: skip
    assert metrics[0].metric_args["window"] == 32 and metrics[0].metric_args["tokens"] == result.val_tokens
    assert len(metrics) == 2 and f"perplexity {result.unigram_perplexity:.4f}" in card.text  # a baseline, in the body
    assert f"| this checkpoint (relational, pivot gauge) | {result.parameters:,} |" in card.text
    assert result.parameters < result.free_gauge_parameters < result.llama_parameters
    assert (tmp_path / "ckpt" / "README.md").read_text() == card_path.read_text()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").num_parameters() == result.parameters


def test_push_script_measures_perplexity_into_the_published_card(hub_server, checkpoint, capsys):  # noqa: F811
    spec = importlib.util.spec_from_file_location("push_to_hub", SCRIPTS / "push_to_hub.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = checkpoint / "train.txt"
    flags = ["--eval-text", str(text), "--dataset-id", "generated", "--block-size", "32", "--eval-blocks", "4"]
    assert module.main([str(checkpoint / "base"), "me/tiny-relational", *flags]) == 0
    printed = capsys.readouterr().out
    measured = float(printed.split("perplexity ")[1].split()[0])
    card = ModelCard.load("me/tiny-relational")
    assert card.data.eval_results[0].metric_type == "perplexity"
    assert card.data.eval_results[0].metric_value == pytest.approx(measured, abs=1e-3)
    assert hub_server.commit_count("me/tiny-relational") == 2


@pytest.mark.parametrize(("before", "after"), [(60.0, 50.0), (50.0, 60.0)])
def test_finetune_summary_gives_the_loss_change_with_its_sign(before, after):
    """The summary's nats/token figure is the change of the mean loss, log(after / before): negative when the
    perplexity fell, positive when it rose."""
    import math

    from relational_hf.commands.finetune import FinetuneResult, format_finetune_result

    result = FinetuneResult("out", "full", 10, 10, before, after, steps=2, seconds=1.0)
    text = format_finetune_result(result)
    assert f"{before:.3f} -> {after:.3f} (loss {math.log(after / before):+.3f} nats/token)" in text
