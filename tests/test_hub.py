"""Publishing: model cards, and pushes through a local Hub-protocol server (tests/hub_server.py)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hub_server import FAKE_TOKEN, hub_server  # noqa: F401  (hub_server is a fixture)
from huggingface_hub import HfApi, ModelCard, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from relational_hf.commands.main import main
from relational_hf.hub import build_model_card, push_checkpoint

# huggingface_hub streams LFS uploads through an httpx argument that httpx deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

REPO = "test-user/tiny-llama"
EVAL = [
    {
        "task_type": "text-generation",
        "dataset_type": "wikitext",
        "dataset_name": "WikiText-2",
        "dataset_split": "test",
        "metric_type": "perplexity",
        "metric_value": 31.5,
    }
]


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (hidden 32, 2 layers, vocab 64) and a word-level tokenizer, saved with save_pretrained."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(63)} | {"<unk>": 63}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(path)
    return path


def _card(checkpoint: Path, **settings) -> ModelCard:
    return build_model_card(
        checkpoint,
        REPO,
        base_model="meta-llama/Llama-3.2-1B",
        datasets=["wikitext"],
        training_settings={"learning_rate": 3e-4, **settings},
        eval_results=EVAL,
        parameter_table="| group | dimension |\n| --- | --- |\n| QK gauge | 128 |",
    )


def _logits(model_dir: Path | str) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(torch.arange(12).reshape(2, 6)).logits


def test_push_then_download_gives_the_same_model_and_card(hub_server, llama_checkpoint, tmp_path):  # noqa: F811
    before = sorted(p.name for p in llama_checkpoint.iterdir())
    url = push_checkpoint(llama_checkpoint, REPO, card=_card(llama_checkpoint), commit_message="first upload")

    head = hub_server.head(REPO)
    assert url == f"{hub_server.endpoint}/{REPO}/commit/{head.oid}"
    assert hub_server.commit_count(REPO) == 2  # the repository's initial commit, then one upload commit
    assert head.title == "first upload"
    assert sorted(p.name for p in llama_checkpoint.iterdir()) == before  # the user's folder is untouched

    local = Path(snapshot_download(REPO, local_dir=tmp_path / "download"))
    assert {p.name for p in local.iterdir() if p.is_file()} == {*before, "README.md", ".gitattributes"}
    assert torch.equal(_logits(local), _logits(llama_checkpoint))
    text = "w3 w7 nonsense w62"
    assert AutoTokenizer.from_pretrained(local)(text).input_ids == [3, 7, 63, 62]

    card = ModelCard.load(REPO)
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert {"relational-hf", "relational-transformer", "llama"} <= set(card.data.tags)
    assert card.data.base_model == "meta-llama/Llama-3.2-1B"
    assert card.data.datasets == ["wikitext"]
    assert card.data.license == "apache-2.0"
    assert [(r.metric_type, r.metric_value, r.dataset_split) for r in card.data.eval_results] == [
        ("perplexity", 31.5, "test")
    ]
    assert "| QK gauge | 128 |" in card.text
    assert HfApi().model_info(REPO).card_data.base_model == "meta-llama/Llama-3.2-1B"


def test_second_push_to_an_existing_repo(hub_server, llama_checkpoint):  # noqa: F811
    push_checkpoint(llama_checkpoint, REPO, card=_card(llama_checkpoint))
    uploads = len(hub_server.lfs_uploads)
    assert uploads == 1  # model.safetensors goes through LFS, the rest as regular files

    url = push_checkpoint(llama_checkpoint, REPO, card=_card(llama_checkpoint, warmup_steps=100))
    assert hub_server.commit_count(REPO) == 3
    assert url.endswith(hub_server.head(REPO).oid)
    assert "| warmup_steps | 100 |" in hub_server.read(REPO, "README.md").decode()
    assert len(hub_server.lfs_uploads) == uploads  # the unchanged weights are not sent again

    again = push_checkpoint(llama_checkpoint, REPO, card=_card(llama_checkpoint, warmup_steps=100))
    assert again == url and hub_server.commit_count(REPO) == 3  # nothing changed: no empty commit


def test_push_keeps_the_checkpoints_own_readme_and_skips_resume_state(hub_server, llama_checkpoint, tmp_path):  # noqa: F811
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(llama_checkpoint, checkpoint)
    readme = "---\nlicense: mit\n---\n# My own card\n"
    (checkpoint / "README.md").write_text(readme)
    (checkpoint / "optimizer.pt").write_bytes(b"optimizer state")
    (checkpoint / "checkpoint-10").mkdir()
    (checkpoint / "checkpoint-10" / "config.json").write_text("{}")
    push_checkpoint(checkpoint, REPO)
    assert hub_server.read(REPO, "README.md").decode() == readme
    assert set(hub_server.head(REPO).files) == {".gitattributes", "README.md"} | {
        p.name for p in llama_checkpoint.iterdir()
    }


def test_failed_commit_raises_and_leaves_the_repo_unchanged(hub_server, llama_checkpoint, caplog):  # noqa: F811
    push_checkpoint(llama_checkpoint, REPO, card=_card(llama_checkpoint))
    head = hub_server.head(REPO)
    hub_server.fail_commits = True
    caplog.set_level(logging.INFO)
    with pytest.raises(RuntimeError, match=rf"^upload to {REPO} failed: .*500") as failure:
        push_checkpoint(llama_checkpoint, REPO, card=_card(llama_checkpoint, warmup_steps=100))
    assert hub_server.head(REPO) == head and hub_server.commit_count(REPO) == 2
    assert HfApi().model_info(REPO).sha == head.oid
    assert "Uploaded" not in caplog.text  # no success is claimed
    assert FAKE_TOKEN not in str(failure.value)


def test_failed_lfs_upload_raises_and_commits_nothing(hub_server, llama_checkpoint):  # noqa: F811
    hub_server.fail_lfs_uploads = True
    hub_server.failure_status = 507  # not retried by huggingface_hub, so the test stays fast
    with pytest.raises(RuntimeError, match=rf"^upload to {REPO} failed: .*model.safetensors.*507"):
        push_checkpoint(llama_checkpoint, REPO)
    assert hub_server.commit_count(REPO) == 1  # only the commit that created the repository
    assert hub_server.lfs_objects == {}


def test_private_push(hub_server, llama_checkpoint):  # noqa: F811
    push_checkpoint(llama_checkpoint, REPO, private=True)
    assert HfApi().model_info(REPO).private is True
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(REPO, "config.json", token=False)

    push_checkpoint(llama_checkpoint, "test-user/public")
    with pytest.raises(RuntimeError, match="public"):
        push_checkpoint(llama_checkpoint, "test-user/public", private=True, card="---\nlicense: mit\n---\nchanged\n")
    assert hub_server.commit_count("test-user/public") == 2


def _broken_checkpoint(path: Path, problem: str) -> None:
    """Write a checkpoint directory at `path` that has the given problem."""
    if problem == "missing":
        return
    path.mkdir()
    if problem == "no-config":
        return
    (path / "config.json").write_text("{oops" if problem == "bad-config" else "{}")
    if problem == "pickle-only":
        (path / "pytorch_model.bin").write_bytes(b"0")
    if problem == "missing-shard":
        shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        save_file({"a": torch.zeros(2)}, path / shards["a"])
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("missing", "does not exist or is not a directory"),
        ("no-config", "has no config.json"),
        ("bad-config", "config.json is not valid JSON"),
        ("no-weights", r"has no \*.safetensors weights$"),
        ("pickle-only", r"has no \*.safetensors weights \(found pytorch_model.bin"),
        ("missing-shard", "missing weight shards .*: model-00002-of-00002.safetensors$"),
    ],
)
def test_bad_checkpoint_directory_is_refused_before_any_upload(hub_server, tmp_path, problem, message):  # noqa: F811
    _broken_checkpoint(tmp_path / "checkpoint", problem)
    with pytest.raises(ValueError, match=message):
        push_checkpoint(tmp_path / "checkpoint", REPO)
    assert hub_server.repos == {}


def test_cli_push_uses_the_token_without_logging_it(hub_server, llama_checkpoint, caplog):  # noqa: F811
    secret = "hf_cliOnlySecret7d41b2c9e0a8f635"
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")
    assert main(["push", str(llama_checkpoint), "tiny", "--token", secret, "--message", "from the CLI"]) == 0

    assert secret in hub_server.tokens_seen and FAKE_TOKEN not in hub_server.tokens_seen
    assert hub_server.head("test-user/tiny").title == "from the CLI"  # the bare name went under the token's user
    hub_server.fail_commits = True
    with pytest.raises(RuntimeError) as failure:
        main(["--debug", "push", str(llama_checkpoint), "test-user/other", "--token", secret])
    assert "Uploading" in caplog.text and "local hub:" in caplog.text  # logs were captured down to debug level
    for text in (
        caplog.text,
        str(failure.value),
        repr(failure.value.__cause__),
        hub_server.read("test-user/tiny", "README.md").decode(),
    ):
        assert secret not in text


def test_token_falls_back_to_the_stored_login(hub_server, llama_checkpoint, monkeypatch):  # noqa: F811
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(RuntimeError, match=f"^upload to {REPO} failed: no Hugging Face token found"):
        push_checkpoint(llama_checkpoint, REPO)
    assert hub_server.repos == {}

    stored = "hf_storedLogin52e1f0c8a9d37b64"
    Path(constants.HF_TOKEN_PATH).write_text(stored)  # where `hf auth login` keeps it (a temp folder here)
    push_checkpoint(llama_checkpoint, REPO)
    assert hub_server.tokens_seen == {stored}


def test_model_card_of_a_plain_llama(llama_checkpoint):
    card = build_model_card(llama_checkpoint, REPO)
    assert card.data.to_dict() == {
        "library_name": "transformers",
        "license": "apache-2.0",
        "pipeline_tag": "text-generation",
        "tags": ["relational-hf", "relational-transformer", "llama"],
    }
    parameters = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(llama_checkpoint).parameters())
    for row in ("| Model type | llama |", "| Hidden size | 32 |", "| Layers | 2 |", "| Key/value heads | 2 |"):
        assert row in card.text
    assert f"| Stored parameters | {parameters:,} |" in card.text
    assert f'AutoModelForCausalLM.from_pretrained("{REPO}")' in card.text
    assert f'AutoTokenizer.from_pretrained("{REPO}")' in card.text
    assert "trust_remote_code=True" not in card.text
    assert "## Parameter reduction" not in card.text and "## Evaluation" not in card.text
    assert ModelCard(str(card)).data.to_dict() == card.data.to_dict()  # the front matter parses back


def test_model_card_of_a_relational_checkpoint(tmp_path):
    config = {
        "model_type": "relational-transformer",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "qk_rank": 4,
        "gauge": "pivot",
        "position_encoding": "rope",
        "value_parallel_removal": True,
        "auto_map": {"AutoModelForCausalLM": "modeling_relational.RelationalForCausalLM"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"embed": torch.zeros(10, 4), "norm": torch.zeros(3)}, tmp_path / "model.safetensors")
    save_file({"ids": torch.zeros(16, 16, dtype=torch.long)}, tmp_path / "heal_text.safetensors")  # not weights
    card = _card(tmp_path, schedule="cosine | warmup")
    for row in (
        "| QK rank | 4 |",
        "| Gauge | pivot |",
        "| Position encoding | rope |",
        "| Value-space parallel removal | yes |",
        "| Stored parameters | 43 |",
        "| learning_rate | 0.0003 |",
        "| schedule | cosine \\| warmup |",
        "| text-generation | WikiText-2 (`wikitext`) |  | test | perplexity |  | 31.5 |",
        "| QK gauge | 128 |",
    ):
        assert row in card.text
    assert "import relational_hf" in card.text
    assert 'from_pretrained("test-user/tiny-llama", trust_remote_code=True)' in card.text
    assert card.data.to_dict()["model-index"][0]["results"][0]["metrics"][0]["value"] == 31.5

    assert "gauge-fixed, invariant parameters" in card.text and "in the free gauge" not in card.text

    del config["auto_map"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    text = build_model_card(tmp_path, REPO).text
    assert "import relational_hf" in text and "has no `auto_map`" in text
    assert "trust_remote_code=True)" not in text
    # a sharded checkpoint: the files its index names, whatever else lies beside them
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {"embed": "model-00001-of-00001.safetensors", "norm": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "| Stored parameters | 43 |" in build_model_card(tmp_path, REPO).text
    # a free-gauge checkpoint is not described as storing gauge-fixed parameters
    (tmp_path / "config.json").write_text(json.dumps(config | {"gauge": "free"}))
    text = build_model_card(tmp_path, REPO).text
    assert "in the free gauge" in text and "gauge-fixed, invariant parameters" not in text and "| Gauge | free |" in text


def test_model_card_rejects_incomplete_eval_results(llama_checkpoint):
    with pytest.raises(ValueError, match=r"eval_results\[0\].*metric_value"):
        build_model_card(
            llama_checkpoint,
            REPO,
            eval_results=[{"task_type": "t", "dataset_type": "d", "dataset_name": "n", "metric_type": "m"}],
        )


def _how_to_load(text: str) -> str:
    """The "## How to load" section of a card (to the next heading of the same level or the end)."""
    section = text.split("## How to load", 1)[1]
    return section.split("\n## ", 1)[0].strip()


@pytest.mark.parametrize(
    "card_file",
    sorted(p.with_suffix(".md") for p in (Path(__file__).resolve().parents[1] / "model_cards").glob("*.json")),
    ids=lambda p: p.stem,
)
def test_committed_cards_load_as_the_generator_says_today(card_file, tmp_path):
    """Each committed model card's loading instructions are the ones `build_model_card` writes now for a relational
    checkpoint with its modeling code and a tokenizer (Transformers v5's AutoTokenizer reads config.json first, so
    without the plugin it needs trust_remote_code too: a card written before that was said gives a line that
    prompts or fails)."""
    committed = card_file.read_text(encoding="utf-8")
    repo = committed.split('AutoModelForCausalLM.from_pretrained("', 1)[1].split('"', 1)[0]
    config = {"model_type": "relational-transformer", "hidden_size": 8, "num_hidden_layers": 1, "gauge": "free"}
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_relational.RelationalForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"embed": torch.zeros(4, 8)}, tmp_path / "model.safetensors")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert _how_to_load(committed) == _how_to_load(build_model_card(tmp_path, repo).text)
