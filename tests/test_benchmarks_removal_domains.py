"""`benchmarks/removal_domains.py`: a removal level sets a healing beside a compression only when the healing is of
that compression (its folder, the same unhealed figures) and has its dense control; the worst of four and the targets
are read from the four target domains, never from prose; the plot draws every level."""

from __future__ import annotations

import json

import pytest
from conftest import benchmark_modules

DOMAINS = ("wikitext", "shakespeare", "python", "chat", "prose")


@pytest.fixture(scope="module")
def removal():
    with benchmark_modules("removal_domains") as (module,):
        yield module


def _write(tmp_path, unhealed: dict, healed: dict, folder: str = "compressed-remove20-same", heal_unhealed=None):
    cell = {"ratio": unhealed, "removed_share": 0.2, "stored": 80, "stored_before": 100, "calibration": {"x": 1}}
    (tmp_path / "cli.json").write_text(json.dumps({"variants": {"remove-20-same": cell}}))
    ratios = {"compressed": heal_unhealed or unhealed, "compressed, healed": healed,
              "dense, healed": dict.fromkeys(DOMAINS, 1.0)}  # fmt: skip
    (tmp_path / "heal.json").write_text(json.dumps({"compressed": folder, "ratio_to_dense": ratios}))


def test_a_level_tabulates_the_healing_of_its_own_compression(tmp_path, removal):
    unhealed = dict(zip(DOMAINS, (1.4, 1.6, 1.5, 1.7, 2.5), strict=True))
    healed = dict(zip(DOMAINS, (1.3, 1.5, 1.45, 1.59, 2.4), strict=True))  # prose over x1.6: not a target domain
    _write(tmp_path, unhealed, healed)
    cell = removal.level(tmp_path, "cli.json", "remove-20-same", "heal.json")
    assert cell["ratio"]["healed"] == healed and cell["ratio"]["unhealed"] == unhealed
    assert cell["worst_of_four"] == {"unhealed": 1.7, "healed": 1.59, "dense control": 1.0}
    assert cell["targets_met_healed"] is True
    _write(tmp_path, unhealed, healed | {"wikitext": 1.36})  # WikiText-2 over x1.35
    assert removal.level(tmp_path, "cli.json", "remove-20-same", "heal.json")["targets_met_healed"] is False
    removal.plot({"levels": [cell, cell | {"removed_share": 0.25}]}, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.parametrize("wrong", ["folder", "model", "control"])
def test_a_healing_of_another_compression_or_without_its_control_is_refused(tmp_path, removal, wrong):
    unhealed = dict.fromkeys(DOMAINS, 1.5)
    if wrong == "folder":
        _write(tmp_path, unhealed, unhealed, folder="compressed-calprompts")
    else:
        _write(tmp_path, unhealed, unhealed, heal_unhealed=unhealed | {"chat": 1.52} if wrong == "model" else None)
    if wrong == "control":
        heal = json.loads((tmp_path / "heal.json").read_text())
        del heal["ratio_to_dense"]["dense, healed"]
        (tmp_path / "heal.json").write_text(json.dumps(heal))
    match = {"folder": "not remove-20-same's", "model": "another model", "control": "no dense control"}[wrong]
    with pytest.raises(SystemExit, match=match):
        removal.level(tmp_path, "cli.json", "remove-20-same", "heal.json")


def test_missing_inputs_are_named_before_anything_is_written(tmp_path, removal):
    with pytest.raises(SystemExit, match="not measured yet: cli_domains_keptchat.json"):
        removal.main(["--results", str(tmp_path)])
