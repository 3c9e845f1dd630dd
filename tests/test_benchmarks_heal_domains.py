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


def test_a_dense_control_healed_on_another_stream_is_refused(tmp_path, heal_domains):
    """Runs that recorded no calibration share healed on the sampled text alone: they control a share of 0, not the
    CLI's half-and-half stream, and an equal share on other calibration windows controls nothing either."""
    dense = {d: 10.0 + i for i, d in enumerate(DOMAINS)}
    path, healed = _earlier(tmp_path, dense)
    assert heal_domains._earlier_control(path, 200, dense, 0.0)[0] == healed
    with pytest.raises(SystemExit, match="healing stream"):
        heal_domains._earlier_control(path, 200, dense, 0.5, {"calibration_share": 0.5})
    payload = json.loads(path.read_text()) | {"calibration_share": 0.5, "stream": {"calibration_tokens": 10}}
    path.write_text(json.dumps(payload))
    assert heal_domains._earlier_control(path, 200, dense, 0.5, {"calibration_tokens": 10})[0] == healed
    with pytest.raises(SystemExit, match="healing stream"):
        heal_domains._earlier_control(path, 200, dense, 0.5, {"calibration_tokens": 11})


def test_a_dense_control_healed_on_text_seeded_otherwise_is_refused(tmp_path, heal_domains):
    """A healing text seeded from both prompt sets is another text: an earlier run that recorded no prompts healed on
    the generic ones, so it controls a generic run only, and a run seeded from both controls only its like."""
    dense = {d: 10.0 + i for i, d in enumerate(DOMAINS)}
    path, healed = _earlier(tmp_path, dense)
    assert heal_domains._earlier_control(path, 200, dense, prompts="generic")[0] == healed
    with pytest.raises(SystemExit, match="healing stream"):
        heal_domains._earlier_control(path, 200, dense, prompts="both")
    path.write_text(json.dumps(json.loads(path.read_text()) | {"heal_prompts": "both"}))
    assert heal_domains._earlier_control(path, 200, dense, prompts="both")[0] == healed
    with pytest.raises(SystemExit, match="healing stream"):
        heal_domains._earlier_control(path, 200, dense)


def test_a_dense_control_healed_with_other_settings_is_refused(tmp_path, heal_domains):
    """A control healed at another learning rate, LoRA rank, batch size, block size, adapter or residual-stream weight
    controls nothing for today's run; an earlier run that recorded none of them healed with the defaults, so it
    controls a run with the defaults only."""
    dense = {d: 10.0 + i for i, d in enumerate(DOMAINS)}
    path, healed = _earlier(tmp_path, dense)
    defaults = dict(heal_domains.HEAL_DEFAULTS)
    assert heal_domains._earlier_control(path, 200, dense, settings=defaults)[0] == healed
    others = (("learning_rate", 6e-4), ("lora_rank", 64), ("batch_size", 4), ("block_size", 512), ("adapter", "full"),
              ("hidden_weight", 1.0))  # fmt: skip
    for key, other in others:
        with pytest.raises(SystemExit, match="settings"):
            heal_domains._earlier_control(path, 200, dense, settings=defaults | {key: other})
    payload = json.loads(path.read_text())
    payload["heal"]["dense"] |= {"lora_rank": 64}
    path.write_text(json.dumps(payload))
    assert heal_domains._earlier_control(path, 200, dense, settings=defaults | {"lora_rank": 64})[0] == healed
    with pytest.raises(SystemExit, match="settings"):
        heal_domains._earlier_control(path, 200, dense, settings=defaults)


def _workdir(tmp_path, user_windows: int = 8, self_windows: int = 4):
    from relational_hf.compress.distill import save_teacher_text

    torch = pytest.importorskip("torch")
    (tmp_path / "texts").mkdir()
    user = torch.randint(0, 100, (8, 16))
    torch.save(user, tmp_path / "texts" / "calibration.pt")
    sampling = {"samples": self_windows, "length": 16, "seed": 1, "chat_share": 0.5, "prompts": "calibration"}
    report = {"calibration": {"user_windows": user_windows, "self_windows": self_windows, "sampling": sampling}}
    (tmp_path / "compressed").mkdir()
    (tmp_path / "compressed" / "compression_report.json").write_text(json.dumps(report))
    rows = torch.randint(100, 200, (self_windows, 16))
    name = "calibration_sampled_calibration_{samples}x{length}_seed{seed}.safetensors".format(**sampling)
    save_teacher_text(tmp_path / name, rows, sampling)
    return user, rows


def test_the_calibration_windows_are_the_commands_mixture_with_nothing_lost(tmp_path, heal_domains):
    """The rebuilt calibration holds every user window and every cached sample once, spread as the command spreads
    them (a third sampled, so every prefix of three holds one sample)."""
    user, rows = _workdir(tmp_path)
    windows, info = heal_domains.calibration_windows(tmp_path, tmp_path / "compressed", teacher=None)
    assert windows.shape == (12, 16) and info["self_windows"] == 4 and info["user_windows"] == 8
    got = sorted(map(tuple, windows.tolist()))
    assert got == sorted(map(tuple, user.tolist() + rows.tolist()))
    sampled = [bool((w >= 100).all()) for w in windows]
    assert all(sum(sampled[: 3 * (k + 1)]) == k + 1 for k in range(4))


def test_the_samples_the_compressed_folder_kept_are_read_before_the_workdir_cache(tmp_path, heal_domains):
    """Where the command kept its sampled windows in OUT (calibration_sampled.safetensors), those very tokens are the
    calibration's samples, not the workdir's re-sampled cache."""
    from relational_hf.commands.compress_texts import SAMPLED_CALIBRATION_NAME
    from relational_hf.compress.distill import save_teacher_text

    torch = pytest.importorskip("torch")
    user, cached = _workdir(tmp_path)
    kept = torch.randint(300, 400, cached.shape)
    save_teacher_text(tmp_path / "compressed" / SAMPLED_CALIBRATION_NAME, kept, {"seed": 1})
    windows, info = heal_domains.calibration_windows(tmp_path, tmp_path / "compressed", teacher=None)
    assert sorted(map(tuple, windows.tolist())) == sorted(map(tuple, user.tolist() + kept.tolist()))
    assert info["sampling"]["from"] == f"compressed/{SAMPLED_CALIBRATION_NAME}"


def test_a_calibration_the_workdir_cannot_rebuild_is_refused(tmp_path, heal_domains):
    _workdir(tmp_path, user_windows=64)
    with pytest.raises(SystemExit, match="cannot be rebuilt"):
        heal_domains.calibration_windows(tmp_path, tmp_path / "compressed", teacher=None)


def test_full_healing_without_a_learning_rate_is_refused_before_anything_loads(tmp_path, heal_domains, capsys):
    """The LoRA learning rate is no default for training the maps' own entries: --adapter full without --lr stops at
    the command line, in one line naming --lr, before the workdir is read."""
    with pytest.raises(SystemExit) as stop:
        heal_domains.main(["--workdir", str(tmp_path / "absent"), "--adapter", "full"])
    assert stop.value.code == 2
    assert "--adapter full needs --lr" in capsys.readouterr().err


def test_a_dense_control_on_the_very_same_tokens_is_taken_however_described(tmp_path, heal_domains):
    """Calibration windows described otherwise (e.g. the same sampled windows read from another file) are the same
    stream when the earlier run's stream, rebuilt, is today's token for token; told otherwise, they are refused."""
    dense = {d: 10.0 + i for i, d in enumerate(DOMAINS)}
    path, healed = _earlier(tmp_path, dense)
    payload = json.loads(path.read_text()) | {"calibration_share": 0.5, "stream": {"from": "a"}, "compressed": "x"}
    path.write_text(json.dumps(payload))
    seen = []
    same = lambda earlier: seen.append(earlier["compressed"]) or True  # noqa: E731
    assert heal_domains._earlier_control(path, 200, dense, 0.5, {"from": "b"}, same_tokens=same)[0] == healed
    assert seen == ["x"]
    with pytest.raises(SystemExit, match="healing stream"):
        heal_domains._earlier_control(path, 200, dense, 0.5, {"from": "b"}, same_tokens=lambda earlier: False)


def test_a_presampled_calibration_is_rebuilt_as_the_command_interleaves_it(tmp_path, heal_domains):
    """A compression given the WikiText-2 windows and a sampled file as two --calibration texts is rebuilt as the
    command builds it (`commands.compress_texts.user_calibration`: counts from the report, interleaved), described
    like the command's own sampled calibration; a file missing from texts/ stops in one line."""
    import torch

    from relational_hf.commands.compress_texts import user_calibration
    from relational_hf.compress.distill import save_teacher_text

    texts = tmp_path / "texts"
    texts.mkdir()
    user = torch.arange(6 * 8).reshape(6, 8)
    sampled = 1000 + torch.arange(4 * 8).reshape(4, 8)
    torch.save(user, texts / "calibration.pt")
    save_teacher_text(texts / "sampled_x.safetensors", sampled, {"seed": 3, "samples": 4, "length": 8, "prompts": "p"})
    paths = [str(texts / "calibration.pt"), str(texts / "sampled_x.safetensors")]
    command, taken = user_calibration(paths, None, 8, 9, 10_000)
    windows, info = heal_domains._presampled_calibration(tmp_path, tmp_path / "c", taken)
    assert taken == {"calibration.pt": 5, "sampled_x.safetensors": 4}
    assert torch.equal(windows, command) and (info["user_windows"], info["self_windows"]) == (5, 4)
    assert info["sampling"]["seed"] == 3 and info["sampling"]["from"] == "texts/sampled_x.safetensors"
    with pytest.raises(SystemExit, match="not in"):
        heal_domains._presampled_calibration(tmp_path, tmp_path / "c", {"calibration.pt": 6, "gone.safetensors": 3})
