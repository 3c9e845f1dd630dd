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
