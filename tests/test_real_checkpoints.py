"""Real checkpoints in: SmolLM2-135M-Instruct from its folder and from its GGUF file, exact conversion of its first
layers through the CLI, a converted tokenizer that loads without the plugin, the GGUF file read one tensor at a time
(and compressed one layer at a time), and clear errors for bad sources."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import first_layers, run_without_plugin, truncated_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer, ResNetConfig

from relational_hf.commands.main import build_parser, main
from relational_hf.directional import compression_error
from relational_hf.loading import (
    ModelSource,
    ModelSourceError,
    ModelSourceNotFound,
    ModelSourceOffline,
    load_model_from,
    load_tokenizer_from,
    resolve_model_source,
)

LAYERS = 2
TEXT = (
    "The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest structure in "
    "Paris. Its base is square, measuring 125 metres on each side."
)


def _smollm2_cut(tmp_path_factory, name: str, **kwargs):
    """SmolLM2's GGUF file cut to its first `LAYERS` blocks, written as `name`; the test is skipped where the file is
    not installed."""
    from relational_hf.pretrained import PretrainedUnavailable, smollm2_gguf_path

    try:
        source = smollm2_gguf_path()
    except PretrainedUnavailable as err:
        pytest.skip(str(err))
    return truncated_gguf(source, tmp_path_factory.mktemp("gguf") / name, LAYERS, **kwargs)


@pytest.fixture(scope="module")
def gguf_two_layers(tmp_path_factory):
    """SmolLM2's GGUF file cut to its first two blocks (same metadata, tokenizer and quantised data)."""
    return _smollm2_cut(tmp_path_factory, "smollm2-2-layers.Q4_1.gguf")


@pytest.fixture(scope="module")
def converted(gguf_two_layers, tmp_path_factory):
    """`relational-hf convert FILE.gguf OUT`: the GGUF model converted to the relational pivot gauge."""
    out = tmp_path_factory.mktemp("converted") / "smollm2-relational"
    assert main(["convert", str(gguf_two_layers), str(out)]) == 0
    return out


def test_folder_source_loads_model_and_tokenizer_in_the_requested_dtype(smollm2_dir):
    model, tokenizer = load_model_from(str(smollm2_dir), dtype="bfloat16"), load_tokenizer_from(str(smollm2_dir))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = tokenizer(TEXT)["input_ids"]
    assert tokenizer.decode(ids) == TEXT


def test_gguf_named_in_its_folder_or_given_directly_is_the_same_source(gguf_two_layers):
    direct = resolve_model_source(str(gguf_two_layers))
    assert direct == ModelSource(str(gguf_two_layers.parent), gguf_two_layers.name, local=True)
    args = build_parser().parse_args(
        ["convert", str(gguf_two_layers.parent), "out", "--gguf-file", gguf_two_layers.name]
    )
    assert resolve_model_source(args.src, args.gguf_file) == direct
    with pytest.raises(ModelSourceError, match="--gguf-file NAME"):  # a folder of GGUF files, none chosen
        resolve_model_source(str(gguf_two_layers.parent))
    with pytest.raises(ModelSourceNotFound, match="other.gguf: no such file"):
        resolve_model_source(str(gguf_two_layers.parent), "other.gguf")


def test_convert_from_gguf_is_exact_on_the_first_layers(converted, smollm2_dir):
    report = json.loads((converted / "conversion_report.json").read_text())
    assert report["max_logit_difference"] <= 1e-4
    relational = AutoModelForCausalLM.from_pretrained(converted).eval()
    dense = first_layers(smollm2_dir, LAYERS)  # the cached folder: the same dequantised weights
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        diff = (relational(ids).logits - dense(ids).logits).abs().max().item()
    assert diff <= 1e-3  # issue 11: real text, fp32
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(relational.generate(ids[:, :12], **kwargs), dense.generate(ids[:, :12], **kwargs))


def test_converted_tokenizer_loads_like_any_tokenizer_without_the_plugin(converted, smollm2_dir, tmp_path):
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # a class every Transformers version knows
    assert "auto_map" not in config and "is_local" not in config
    want = AutoTokenizer.from_pretrained(smollm2_dir)(TEXT)["input_ids"]
    code = f"""
from transformers import AutoTokenizer, PreTrainedTokenizerFast
folder, text = {str(converted)!r}, {TEXT!r}
plain = PreTrainedTokenizerFast.from_pretrained(folder)  # reads no model config at all
auto = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # the flag the model needs without the plugin
print("IDS", plain(text)["input_ids"] == auto(text)["input_ids"] == {want!r})
"""
    result = run_without_plugin(code, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "IDS True" in result.stdout
    assert "Do you wish to run the custom code" not in result.stderr + result.stdout
    assert "model of type ``" not in result.stderr


@pytest.fixture(scope="module")
def gguf_weights(tmp_path_factory):
    """SmolLM2's GGUF file cut to its first two blocks without its tokenizer (same quantised data; parses fast)."""
    return _smollm2_cut(tmp_path_factory, "smollm2-2-layers-weights.Q4_1.gguf", tokenizer=False)


@pytest.fixture(scope="module")
def gguf_whole(gguf_weights):
    """That file loaded whole by Transformers' GGUF loader (dequantised, fp32)."""
    return load_model_from(str(gguf_weights))


def test_gguf_reader_gives_the_tensors_transformers_loads(gguf_weights, gguf_whole, tmp_path):
    """`shards.GGUFCheckpointReader`: every tensor of the GGUF file, read and dequantised on its own under its
    Transformers name (query and key rows un-permuted), equals what Transformers' GGUF loader builds; the embedding
    read a block of rows at a time equals it whole; the names and shapes are the model's. Offloaded to disk (through
    the safetensors working copy written one tensor at a time), the file computes the whole model's logits."""
    from relational_hf.lm.offload import load_model
    from relational_hf.shards import GGUFCheckpointReader, check_complete, open_checkpoint

    reader, config, meta = open_checkpoint(gguf_weights)
    assert isinstance(reader, GGUFCheckpointReader) and config.num_hidden_layers == LAYERS
    check_complete(meta, reader)
    loaded = gguf_whole.state_dict()
    names = set(reader.keys())
    assert names == set(loaded) - {"lm_head.weight"}  # tied head: one copy
    for name in names:
        got = reader.get([name])[name]
        assert tuple(got.shape) == reader.shape(name) and torch.equal(got.float(), loaded[name].float()), name
    key = "model.embed_tokens.weight"
    blocks = list(reader.rows(key, block_bytes=2**20))
    assert len(blocks) > 1 and torch.equal(torch.cat(blocks), loaded[key])
    with pytest.raises(KeyError, match="not in the GGUF file"):
        reader.get(["model.layers.7.mlp.up_proj.weight"])
    offloaded, device_map = load_model(str(gguf_weights), max_memory=60_000_000, offload_folder=tmp_path / "off")
    assert "disk" in device_map.values()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, gguf_whole(ids).logits, rtol=0, atol=1e-4)
    del offloaded
    gc.collect()  # the working copy goes with the model (at the latest when the process exits)
    assert not any(p.name.startswith("relational-gguf-") for p in (tmp_path / "off").iterdir())


def test_a_gguf_file_compresses_one_layer_at_a_time_as_loaded_whole(gguf_weights, gguf_whole, tmp_path):
    """`jobs.compress_checkpoint(FILE.gguf, ...)` streams the real GGUF file (each tensor dequantised as it is read)
    and gives the model that compressing the file loaded whole gives: same widths, same stored count, the same logits
    (float tolerance), in float32 (the file is quantised). The command line streams a local GGUF file by default."""
    from relational_hf.commands.compress import CompressArguments
    from relational_hf.jobs import compress_checkpoint, compress_model

    ids = torch.randint(0, gguf_whole.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    options = dict(plan_windows=2, batch_size=2, eval_windows=2)
    ref, ref_report = compress_model(gguf_whole, remove=0.05, calibration=ids, progress=False, **options)
    report = compress_checkpoint(
        gguf_weights, tmp_path / "out", remove=0.05, calibration=ids, progress=False, copy_tokenizer=False, **options
    )
    assert report["widths"] == ref_report["widths"] and report["parameters_after"] == ref_report["parameters_after"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert next(loaded.parameters()).dtype == torch.float32
    with torch.no_grad():
        expected, got = ref(ids[:2]).logits, loaded(ids[:2]).logits
    assert (got - expected).abs().max() <= 1e-4 * max(1.0, float(expected.abs().max()))
    for src, extra in ((str(gguf_weights), {}), (str(gguf_weights.parent), {"gguf_file": gguf_weights.name})):
        args = CompressArguments(src=src, out=str(tmp_path / "cli"), remove=0.25, **extra)
        assert args.local_gguf() == gguf_weights and args.stream_chosen()


def test_compression_error_names_differing_hidden_sizes(converted):
    from relational_hf.compress.slicing import slice_relational

    relational = AutoModelForCausalLM.from_pretrained(converted).eval()
    ids = torch.randint(0, relational.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    sliced, _ = slice_relational(relational, 0.25, ids)
    with pytest.raises(ValueError, match=r"hidden sizes differ \(dense 576, compressed 432\)"):
        compression_error(relational, sliced, ids)


def test_missing_local_path_says_so(tmp_path):
    for text in (str(tmp_path / "nope"), "./nope", "checkpoints/../nope"):
        with pytest.raises(ModelSourceNotFound, match="no such file or directory"):
            resolve_model_source(text)
    with pytest.raises(ModelSourceNotFound, match="no config.json"):
        resolve_model_source(str(tmp_path))


def test_uncached_hub_id_offline_says_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceOffline, match="not in the local Hugging Face cache while offline"):
        resolve_model_source("relational-hf-tests/no-such-model")
    assert main(["redundancy", "relational-hf-tests/no-such-model", "--meta"]) == 2  # the CLI reports, no traceback


def test_unsupported_architectures_are_named(tmp_path):
    ResNetConfig().save_pretrained(tmp_path / "resnet")
    with pytest.raises(ModelSourceError, match="unsupported architecture 'resnet'"):
        load_model_from(str(tmp_path / "resnet"))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "config.json").write_text(json.dumps({"model_type": "brand-new-arch"}))
    with pytest.raises(ModelSourceError, match="unsupported architecture 'brand-new-arch'"):
        load_model_from(str(tmp_path / "new"))


def test_unsupported_gguf_architecture_is_named(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(path, arch="oddarch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match="oddarch"):
        load_model_from(str(path))


def test_compressed_card_is_filled_from_the_compress_report(tmp_path):
    """The SmolLM2-compressed card builder takes every number from the compress report JSON (here a tiny model and
    a report with the fields issue 11 asks for) and puts perplexities in the model-index, counts in tables."""
    import importlib.util

    from huggingface_hub import ModelCard

    from relational_hf.modeling import RelationalConfig, RelationalForCausalLM

    folder = tmp_path / "compressed"
    model = RelationalForCausalLM(RelationalConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32))  # fmt: skip
    model.save_pretrained(folder)
    report = {
        "method": "relational",
        "remove": 0.25,
        "stored_parameters": {"embedding": 1024, "attention": 512, "mlp": 1536},
        "perplexity": {"calibration": 12.5, "evaluation": 14.25},
        "seconds": 12.3,
        "peak_rss_bytes": 3 * 2**30,
    }
    (folder / "compress_report.json").write_text(json.dumps(report))
    root = Path(__file__).resolve().parents[1] / "model_cards" / "build_reference.py"
    spec = importlib.util.spec_from_file_location("build_reference", root)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["smollm2-compressed", "--from", str(folder), "--card-dir", str(tmp_path / "cards")]) == 0
    card = ModelCard.load(tmp_path / "cards" / "smollm2-135m-instruct-relational-compressed.md")
    # perplexities on texts that are not a Hub dataset's are described in the card's body, not posed as datasets
    assert not card.data.eval_results
    assert "`perplexity.calibration`: 12.5000" in card.text and "`perplexity.evaluation`: 14.2500" in card.text
    assert "| mlp | 1,536 |" in card.text and "3.00 GiB" in card.text and "| method | relational |" in card.text
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # a healed report with its dense control: the control's figures stand beside the healed ones, the texts named
    report["heal"] = {"loss": "kd", "steps": 2, "learning_rate": 1e-3, "lora_rank": 16, "batch_size": 2, "block_size": 8}
    report["eval_perplexity_after"] = 15.5
    report.update(eval_file="wikitext2_last10.txt", eval_windows=[20, 512], calibration_perplexity_before=9.5)
    (folder / "compress_report.json").write_text(json.dumps(report))
    control = {"perplexity_before": 10.0, "perplexity_after": 10.1, "heal": dict(report["heal"])}
    (tmp_path / "heal_cli.json").write_text(json.dumps({"control": control}))
    argv = ["smollm2-compressed", "--from", str(folder), "--card-dir", str(tmp_path / "cards")]
    assert module.main([*argv, "--control", str(tmp_path / "heal_cli.json")]) == 0
    card = ModelCard.load(tmp_path / "cards" / "smollm2-135m-instruct-relational-compressed.md")
    values = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert values["perplexity, the dense control before healing"] == 10.0
    assert values["perplexity, the dense control after the same healing"] == 10.1
    assert values["perplexity, compressed and healed"] == 15.5 and "+1.0%" in card.text and "held out" in card.text
    # the held-out WikiText-2 side is the model-index's one dataset, with its configuration, split and windows
    datasets = {(r.dataset_type, r.dataset_config, r.dataset_split) for r in card.data.eval_results}
    assert datasets == {("Salesforce/wikitext", "wikitext-2-v1", "validation")}
    assert all(r.metric_args == {"window": 512, "windows": 20, "tokens": 10240} for r in card.data.eval_results)
    assert "| calibration text | 9.50 |" in card.text and "calibration" not in str(datasets)
    # a control healed on another mix of the texts than the report's is refused, naming the share
    report["heal"]["text"] = {"calibration_share": 0.5}
    (folder / "compress_report.json").write_text(json.dumps(report))
    (tmp_path / "heal_cli.json").write_text(json.dumps({"control": control}))
    with pytest.raises(SystemExit, match="calibration_share"):
        module.main([*argv, "--control", str(tmp_path / "heal_cli.json")])
    mixed = {"control": control, "command_report": {"heal": {"text": {"calibration_share": 0.5}}}}
    (tmp_path / "heal_cli.json").write_text(json.dumps(mixed))
    assert module.main([*argv, "--control", str(tmp_path / "heal_cli.json")]) == 0
    # a control healed otherwise, or a file without one, is refused
    control["heal"]["steps"] = 3
    (tmp_path / "heal_cli.json").write_text(json.dumps({"control": control}))
    with pytest.raises(SystemExit, match="steps"):
        module.main([*argv, "--control", str(tmp_path / "heal_cli.json")])
    (tmp_path / "heal_cli.json").write_text("{}")
    with pytest.raises(SystemExit, match="control"):
        module.main([*argv, "--control", str(tmp_path / "heal_cli.json")])


def test_compressed_card_shows_the_speed_of_its_own_widths_and_gauge(tmp_path):
    """`--speed` puts the speed-ups of a compress_speed result in the card, only when that result timed the report's
    widths at the report's share in the checkpoint's gauge; any other result is refused with the reason."""
    import importlib.util

    from huggingface_hub import ModelCard

    from relational_hf.modeling import RelationalConfig, RelationalForCausalLM

    folder = tmp_path / "compressed"
    config = RelationalConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=32, gauge="free")  # fmt: skip
    RelationalForCausalLM(config).save_pretrained(folder)
    widths = {"qk": [8], "vo": [8], "mlp": [32]}
    (folder / "compression_report.json").write_text(json.dumps({"method": "relational", "remove": 0.25, "widths": widths}))
    speedup = {"prefill": 1.234, "prefill_batched": 1.29, "decode": 1.217, "prefill_bare": 1.2, "prefill_last": 1.3}
    dense = {"prefill": {"tokens_per_s": 480.0}, "decode": {"tokens_per_s": 17.7}}
    level = {"widths": widths, "speedup": speedup, "dense": dense}
    payload = {"device": "cpu", "threads": 1, "dtype": "float32", "attn": "sdpa", "gauge": "free", "levels": {"0.25": level}}
    root = Path(__file__).resolve().parents[1] / "model_cards" / "build_reference.py"
    spec = importlib.util.spec_from_file_location("build_reference", root)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    speed = tmp_path / "speed.json"
    argv = ["smollm2-compressed", "--from", str(folder), "--card-dir", str(tmp_path / "cards"), "--speed", str(speed)]
    speed.write_text(json.dumps(payload))
    assert module.main(argv) == 0
    card = ModelCard.load(tmp_path / "cards" / "smollm2-135m-instruct-relational-compressed.md")
    assert "greedy decoding x1.22" in card.text and "prefill 1 x 512 tokens x1.23" in card.text
    assert "17.7 tokens/s" in card.text and "speed.json" in card.text
    numbers = json.loads((tmp_path / "cards" / "smollm2-135m-instruct-relational-compressed.json").read_text())
    assert numbers["speed"]["speedup"] == speedup
    for change, reason in (
        ({"gauge": "pivot"}, "pivot gauge"),
        ({"levels": {"0.25": level | {"widths": {**widths, "mlp": [16]}}}}, "other widths"),
        ({"levels": {"0.5": level}}, "share"),
    ):
        speed.write_text(json.dumps(payload | change))
        with pytest.raises(SystemExit, match=reason):
            module.main(argv)
