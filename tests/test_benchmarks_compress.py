"""The compression benchmark's --resume keeps what the earlier runs measured and who measured it."""

from __future__ import annotations

import pytest
from conftest import benchmark_modules


@pytest.fixture(scope="module")
def bench():
    with benchmark_modules("compress") as (module,):
        yield module


def test_resume_keeps_measured_cells_and_every_earlier_command(bench):
    protocol = {"evaluation": "last 10%", "calibration": "first 90%"}
    first = bench.resumed_payload(None, protocol, "compress.py --targets 0.25")
    assert first == {"protocol": protocol, "cells": {}, "command": "compress.py --targets 0.25"}
    first["cells"] = {"relational@0.25": {"perplexity": 54.8}, "relational@0.9": {"perplexity": None}}
    first["wall_seconds"] = 600.0
    second = bench.resumed_payload(first, protocol, "compress.py --targets 0.2 --resume")
    assert second["cells"] == {"relational@0.25": {"perplexity": 54.8}}  # a cell that failed is measured again
    assert second["wall_seconds"] == 600.0 and second["command"] == "compress.py --targets 0.2 --resume"
    assert second["earlier_commands"] == ["compress.py --targets 0.25"]
    third = bench.resumed_payload(second, protocol, "compress.py --targets 0.3 --resume")
    assert third["earlier_commands"] == ["compress.py --targets 0.25", "compress.py --targets 0.2 --resume"]


def test_resume_refuses_a_file_measured_on_other_windows(bench):
    earlier = {"protocol": {"evaluation": "first 10%"}, "cells": {}, "command": "compress.py --split reverse"}
    with pytest.raises(ValueError, match="another protocol"):
        bench.resumed_payload(earlier, {"evaluation": "last 10%"}, "compress.py --resume")


def test_cells_of_other_calibration_texts_have_their_own_keys(bench):
    """A cell calibrated on another text than the default is a cell of its own (the default keeps the old key, so
    earlier results resume), and dense has one key whatever the calibration."""
    assert bench.cell_key("relational", 0.25) == bench.cell_key("relational", 0.25, "wikitext") == "relational@0.25"
    assert bench.cell_key("relational", 0.25, "self") == "relational@0.25~self"
    assert bench.cell_key("dense", None, "self") == "dense"
    keys = {bench.cell_key("relational", 0.25, text) for text in bench.CALIBRATIONS}
    assert len(keys) == len(bench.CALIBRATIONS)


def test_resume_keeps_the_calibration_texts_of_the_kept_cells(bench):
    earlier = {"protocol": {"evaluation": "e", "calibration_texts": {"self": "sampled"}}, "cells": {}, "command": "a"}
    protocol = {"evaluation": "e", "calibration_texts": {"wikitext": "given"}}
    payload = bench.resumed_payload(earlier, protocol, "b")
    assert payload["protocol"]["calibration_texts"] == {"self": "sampled", "wikitext": "given"}


def test_domain_ratios_and_the_worst_of_the_target_domains():
    """Each domain's ratio to dense; the worst is over the four target domains only (prose is the check no choice
    was made on), and a domain dense did not measure has no ratio."""
    with benchmark_modules("domains") as (domains,):
        dense = {"wikitext": 10.0, "shakespeare": 20.0, "python": 5.0, "chat": 8.0, "prose": 4.0}
        cell = {"wikitext": 12.0, "shakespeare": 30.0, "python": 10.0, "chat": 8.0, "prose": 40.0, "other": 1.0}
        r = domains.ratios(cell, dense)
        assert r["python"] == pytest.approx(2.0) and r["prose"] == pytest.approx(10.0) and "other" not in r
        assert r["worst"] == pytest.approx(2.0)
        assert set(domains.TARGET_DOMAINS) < set(domains.DOMAINS)
