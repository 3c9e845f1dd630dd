"""`benchmarks/heal_domains.py`: the healed dense control of an earlier run is reused only when that run healed the
same way on the same windows (its unhealed dense perplexities equal today's, the same steps); anything else is refused
in one line rather than set beside figures it does not control."""

from __future__ import annotations

import json

import pytest
from conftest import benchmark_modules

DOMAINS = ("wikitext", "shakespeare", "python", "chat", "prose")


@pytest.fixture(scope="module")
def heal_domains():
    with benchmark_modules("heal_domains") as (module,):
        yield module


def _earlier(tmp_path, dense: dict, steps: int = 200):
    healed = {d: v * 1.01 for d, v in dense.items()}
    payload = {"steps": steps, "perplexity": {"dense": dense, "dense, healed": healed}, "heal": {"dense": {"steps": steps}}}
    path = tmp_path / "heal_domains.json"
    path.write_text(json.dumps(payload))
    return path, healed


def test_the_earlier_dense_control_is_taken_when_it_healed_the_same_windows(tmp_path, heal_domains):
    dense = {d: 10.0 + i for i, d in enumerate(DOMAINS)}
    path, healed = _earlier(tmp_path, dense)
    figures, report = heal_domains._earlier_control(path, 200, dense)
    assert figures == healed and report == {"steps": 200}


@pytest.mark.parametrize("change", ["steps", "windows"])
def test_another_healing_or_other_windows_is_refused(tmp_path, heal_domains, change):
    dense = {d: 10.0 + i for i, d in enumerate(DOMAINS)}
    path, _ = _earlier(tmp_path, dense, steps=100 if change == "steps" else 200)
    today = dense | ({"python": dense["python"] * 1.001} if change == "windows" else {})
    with pytest.raises(SystemExit, match="heal it again"):
        heal_domains._earlier_control(path, 200, today)
