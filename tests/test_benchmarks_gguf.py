"""`benchmarks/gguf_llamacpp.py`: every compressed model in a run is judged against the dense one on its own (its
llama.cpp/plugin agreement, decode speed at every type, Q4_K_M file), whichever compressions the run holds."""

from __future__ import annotations

import pytest
from conftest import benchmark_modules


@pytest.fixture(scope="module")
def gguf_llamacpp():
    with benchmark_modules("gguf_llamacpp") as (module,):
        yield module


def _measures(models: dict[str, tuple[float, float, float]]) -> dict:
    """name -> (perplexity, decode tokens/s, Q4_K_M MiB), the same at every type but the file size."""
    out = {}
    for name, (ppl, speed, size) in models.items():
        for t in ("F16", "Q8_0", "Q4_K_M"):
            out[f"{name}/{t}"] = {"perplexity": {"wikitext": ppl}, "decode_tokens_per_s": speed, "file_mib": size}
    return out


def test_each_compression_is_judged_on_its_own_without_the_default_one(gguf_llamacpp):
    models = {"dense": (10.0, 100.0, 100.0), "compressed-mlp-w256": (12.0, 125.0, 77.0), "compressed-w256": (12.0, 110.0, 80.0)}
    plugin = {"dense": {"wikitext": 10.0}, "compressed-mlp-w256": {"wikitext": 12.0}, "compressed-w256": {"wikitext": 11.0}}
    out = gguf_llamacpp.summarise(_measures(models), plugin, ["wikitext"], tuple(models))
    met = out["targets_met"]
    assert met["compressed-mlp-w256: decode >= 1.2x dense at every type"]
    assert met["compressed-mlp-w256: Q4_K_M file <= 0.78x dense"]
    assert met["compressed-mlp-w256: llama.cpp/plugin within 1% (F16)"]
    assert not met["compressed-w256: decode >= 1.2x dense at every type"]
    assert not met["compressed-w256: Q4_K_M file <= 0.78x dense"]
    assert not met["compressed-w256: llama.cpp/plugin within 1% (F16)"]  # 12 in llama.cpp against the plugin's 11
    assert "compressed" not in {k.split(":")[0] for k in met}
