"""`benchmarks/domains.py`'s chat domain: sampled text differs from one CPU to another, so the protocol's windows are
kept in the repository and every machine measures those; they are used only for the model that sampled them, with
the protocol's seed and shape, and sampled afresh otherwise."""

from __future__ import annotations

import pytest
import torch
from conftest import benchmark_modules
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def domains():
    with benchmark_modules("domains") as (module,):
        yield module


def _keep(path, model, ids, **changes):
    from relational_hf.compress.distill import model_fingerprint, save_teacher_text

    settings = {"samples": ids.shape[0], "length": ids.shape[1], "seed": 7, "chat_share": 1.0}
    save_teacher_text(path, ids, settings | {"source": model_fingerprint(model)} | changes)


@pytest.fixture
def sampled(monkeypatch):
    """Every call of the sampler, recorded; it returns zeros of the asked shape."""
    from relational_hf.compress import distill

    calls = []

    def fake(model, tokenizer, *, samples, length, seed, chat_share, **_):
        calls.append({"samples": samples, "length": length, "seed": seed, "chat_share": chat_share})
        return torch.zeros(samples, length, dtype=torch.long)

    monkeypatch.setattr(distill, "generate_teacher_text", fake)
    return calls


def test_the_kept_windows_are_read_for_the_model_that_sampled_them(tmp_path, domains, sampled):
    model = tiny_llama()
    ids = torch.randint(1, 100, (5, 16))
    _keep(tmp_path / "chat.safetensors", model, ids)
    got = domains.chat_windows(model, None, 16, 3, path=tmp_path / "chat.safetensors")
    assert torch.equal(got, ids[:3]) and not sampled


@pytest.mark.parametrize(
    "window, n, changes",
    [(16, 3, {"source": "another-model"}), (16, 3, {"seed": 8}), (16, 3, {"chat_share": 0.5}), (8, 3, {}), (16, 6, {})],
    ids=["another source", "another seed", "not all chat", "another window", "too few rows"],
)
def test_windows_kept_for_another_protocol_are_not_used(tmp_path, domains, sampled, window, n, changes):
    model = tiny_llama()
    _keep(tmp_path / "chat.safetensors", model, torch.randint(1, 100, (5, 16)), **changes)
    got = domains.chat_windows(model, None, window, n, path=tmp_path / "chat.safetensors")
    assert got.shape == (n, window) and int(got.abs().sum()) == 0  # the sampler's
    assert sampled == [{"samples": n, "length": window, "seed": domains.CHAT_SEED, "chat_share": 1.0}]


def test_without_the_file_the_windows_are_sampled(tmp_path, domains, sampled):
    got = domains.chat_windows(tiny_llama(), None, 16, 2, path=tmp_path / "absent.safetensors")
    assert got.shape == (2, 16) and len(sampled) == 1


def test_the_committed_windows_are_smollm2s_and_fit_the_protocol(domains, smollm2_dir):
    """The kept file belongs to SmolLM2-135M-Instruct as this machine loads it (its fingerprint does not depend on
    the CPU), so the benchmarks here measure the same chat windows as the machine that drew them."""
    from transformers import AutoModelForCausalLM

    from relational_hf.compress.distill import load_teacher_text, model_fingerprint

    ids, info = load_teacher_text(domains.CHAT_WINDOWS)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert ids.shape == (12, 512) and info["seed"] == domains.CHAT_SEED and info["chat_share"] == 1.0
    assert info["source"] == model_fingerprint(model)
    assert 0 <= int(ids.min()) and int(ids.max()) < model.config.vocab_size
