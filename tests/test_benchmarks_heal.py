"""`benchmarks/heal.py` refuses settings that do not go together in one line naming the flag, before any model loads."""

from __future__ import annotations

import pytest
from conftest import benchmark_modules


@pytest.fixture(scope="module")
def heal():
    with benchmark_modules("heal") as (module,):
        yield module


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--loss", "lm", "--kd-text", "calibration"], "--kd-text"),
        (["--refit-holdout", "-1"], "--refit-holdout"),
        (["--steps", "0"], "--steps"),
        (["--lr", "2"], "--lr"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(heal, argv, named, capsys, monkeypatch):
    def never(*_args, **_kwargs):
        raise AssertionError("a refused run must not load the model")

    monkeypatch.setattr(heal, "load_model", never)
    with pytest.raises(SystemExit) as exit_info:
        heal.main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
