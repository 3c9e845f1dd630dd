"""Nothing is lost: a save killed at any stage leaves a loadable checkpoint, one run per directory, resume picks a
complete trainer checkpoint, user files survive (whatever their names, and also when written during a save), LoRA
never lands beside full weights, pushes carry no pickles."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relational_hf import RelationalConfig, RelationalForCausalLM, outputs
from relational_hf.commands import main as cli
from relational_hf.errors import UsageError
from relational_hf.lm.data import generate_corpus
from relational_hf.outputs import MARKER, OutputLock, folders, recover_output_dir, stage_and_swap

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so nothing on the way catches it."""


def tiny(seed: int) -> RelationalForCausalLM:
    torch.manual_seed(seed)
    config = RelationalConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return RelationalForCausalLM(config)


def fingerprint(model) -> float:
    return float(model.model.embed_tokens.weight.detach().sum())


def save(model, out: Path) -> None:
    stage_and_swap(out, model.save_pretrained)


def loads(path: Path) -> float | None:
    """The fingerprint of the checkpoint at `path`, or None when it does not load."""
    try:
        return fingerprint(AutoModelForCausalLM.from_pretrained(path))
    except (OSError, ValueError):
        return None


@pytest.fixture
def two_models(tmp_path):
    """An output directory holding the old checkpoint (plus trainer state and a user file), and a new model."""
    old, new = tiny(1), tiny(2)
    out = tmp_path / "run"
    save(old, out)
    (out / "trainer_state" / "checkpoint-4").mkdir(parents=True)
    (out / "trainer_state" / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4}')
    (out / "notes.txt").write_text("my notes")
    return out, fingerprint(old), new, fingerprint(new)


def _fail_on_call(monkeypatch, owner, name, n=1):
    """Make the n-th call of owner.name raise Crash (earlier calls go through)."""
    real, calls = getattr(owner, name), {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise Crash(f"killed in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


def _use_two_renames(monkeypatch):
    monkeypatch.setattr(folders, "exchange", lambda a, b: False)


STAGES = {
    # stage name: (set-up of the crash, which checkpoint the directory must hold after recovery)
    "while writing": (lambda mp, new: mp.setattr(new, "save_pretrained", _raise_midway(new)), "old"),
    "before fsync": (lambda mp, new: _fail_on_call(mp, folders, "_fsync_tree"), "old"),
    "at the exchange": (lambda mp, new: _fail_on_call(mp, folders, "exchange"), "old"),
    "after the exchange": (lambda mp, new: _fail_on_call(mp, folders, "_retire"), "new"),
    "retiring the old": (lambda mp, new: _fail_on_call(mp, os, "unlink", 2), "new"),
    "renaming the old away": (lambda mp, new: (_use_two_renames(mp), _fail_on_call(mp, os, "rename", 1)), "old"),
    "renaming the new in": (lambda mp, new: (_use_two_renames(mp), _fail_on_call(mp, os, "rename", 2)), "new"),
    "deleting the old": (lambda mp, new: (_use_two_renames(mp), _fail_on_call(mp, folders, "_retire")), "new"),
}


def _siblings(out: Path) -> list[Path]:
    """The project's staging / old folders beside `out`."""
    return sorted(out.parent.glob(f".{out.name}.relational-hf-*"))


def _raise_midway(model):
    real = model.save_pretrained

    def partial(folder, **kwargs):
        real(folder, **kwargs)
        (Path(folder) / "model.safetensors").write_bytes(b"truncated")
        raise Crash("killed while writing")

    return partial


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_save_killed_at_any_stage_leaves_a_loadable_checkpoint(stage, two_models, monkeypatch):
    out, old_fp, new, new_fp = two_models
    setup, expected = STAGES[stage]
    setup(monkeypatch, new)
    with pytest.raises(Crash):
        save(new, out)
    monkeypatch.undo()
    # at the moment of the crash a complete checkpoint exists: NAME, or during the two-rename window the old folder
    # or the finished staging folder beside it
    candidates = [out, *_siblings(out)]
    assert any(loads(p) in (old_fp, new_fp) for p in candidates if p.is_dir())
    recover_output_dir(out)  # what every command does first
    assert loads(out) == (old_fp if expected == "old" else new_fp)
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "trainer_state" / "checkpoint-4" / "trainer_state.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]  # no staging/old leftovers after recovery


# a subprocess that imports relational_hf.outputs without the package's heavy __init__ (torch, transformers)
LIGHT_IMPORT = f"""
import os, shutil, sys, types
package = types.ModuleType("relational_hf")
package.__path__ = [{str(PROJECT_ROOT / "relational_hf")!r}]
sys.modules["relational_hf"] = package
from relational_hf import outputs
"""


def test_a_save_killed_by_a_signal_between_the_renames(two_models, tmp_path):
    """A real process death (os._exit: no clean-up runs) between the two renames of the fallback swap."""
    out, old_fp, new, new_fp = two_models
    new.save_pretrained(tmp_path / "new_files")
    script = (
        LIGHT_IMPORT
        + f"""
outputs.folders.exchange = lambda a, b: False
real, calls = os.rename, []
def rename(a, b):
    calls.append(a)
    if len(calls) == 2:
        os._exit(9)
    real(a, b)
os.rename = rename
write = lambda folder: shutil.copytree({str(tmp_path / "new_files")!r}, folder, dirs_exist_ok=True)
outputs.stage_and_swap({str(out)!r}, write)
"""
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    (old,) = [p for p in _siblings(out) if "-old-" in p.name]
    assert not out.exists() and loads(old) == old_fp  # the old one is whole, beside
    recover_output_dir(out)
    assert loads(out) == new_fp and (out / "notes.txt").is_file()


def test_a_save_replaces_only_the_files_it_wrote_before_whatever_their_names(two_models):
    """Ownership by manifest: a file the last save wrote and nobody changed since is replaced or removed; a file the
    user added is kept even when its name looks like a checkpoint file; a file of ours the user edited is kept."""
    out, _old_fp, new, new_fp = two_models

    def with_extra(folder):
        new.save_pretrained(folder)
        (folder / "extra_report.json").write_text("{}")
        (folder / "edited.json").write_text("{}")

    save(new, out)
    stage_and_swap(out, with_extra)
    assert set(outputs.owned_files(out)) >= {"config.json", "model.safetensors", "extra_report.json", "edited.json"}
    for name in ("model-00009-of-00009.safetensors", "tokenizer-notes.md", "vocab.csv", "model-best.safetensors"):
        (out / name).write_bytes(b"the user's")
    (out / "edited.json").write_text('{"edited": "by the user"}')
    save(new, out)
    assert loads(out) == new_fp
    assert not (out / "extra_report.json").exists()  # ours and unchanged: superseded
    assert (out / "edited.json").read_text() == '{"edited": "by the user"}'  # ours once, but edited since: kept
    for name in ("model-00009-of-00009.safetensors", "tokenizer-notes.md", "vocab.csv", "model-best.safetensors"):
        assert (out / name).read_bytes() == b"the user's", name
    assert (out / "notes.txt").read_text() == "my notes" and (out / MARKER).is_file()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_a_save_writes_gets_the_umasks_mode_and_the_users_files_keep_theirs(two_models, umask):
    """Writers that stage through a private temporary file (safetensors, hence `save_pretrained`) leave 0o600: a
    saved checkpoint's files all get the mode a new file of the user's gets (0o666 less the umask), the model's
    weights included, whatever the writer left; a file of the user's carried over keeps its own mode, and so does
    a file of the user's that a writer's hard link shares."""
    out, _old_fp, new, new_fp = two_models
    elsewhere = out.parent / "elsewhere.bin"
    elsewhere.write_bytes(b"the user's")
    os.chmod(elsewhere, 0o600)

    def write(folder):
        new.save_pretrained(folder)
        (folder / "private.json").write_text("{}")
        os.chmod(folder / "private.json", 0o600)
        os.link(elsewhere, folder / "linked.bin")

    (out / "secret.txt").write_text("the user's")
    os.chmod(out / "secret.txt", 0o600)
    previous = os.umask(umask)
    try:
        stage_and_swap(out, write)
    finally:
        os.umask(previous)
    assert loads(out) == new_fp
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"] == modes["private.json"] == 0o666 & ~umask
    assert modes["secret.txt"] == 0o600 and stat.S_IMODE(elsewhere.stat().st_mode) == 0o600


def test_a_save_refuses_to_replace_a_file_it_did_not_write_unless_overwrite(two_models):
    out, old_fp, new, new_fp = two_models
    (out / "config.json").write_text('{"written": "by the user"}')  # a name the save writes, no longer ours
    with pytest.raises(UsageError, match="config.json.*--overwrite"):
        save(new, out)
    assert (out / "config.json").read_text() == '{"written": "by the user"}' and _siblings(out) == []
    stage_and_swap(out, new.save_pretrained, overwrite=True)
    assert loads(out) == new_fp and (out / "notes.txt").is_file()


def test_files_written_into_the_folder_during_a_save_survive_it(two_models, monkeypatch):
    """Another program writes into the output folder while a save runs (after the carry-over, before the swap): its
    files end up in the new folder."""
    out, _old_fp, new, new_fp = two_models
    real = folders._fsync_tree

    def meanwhile(folder):
        real(folder)
        (out / "written-during-the-save.txt").write_text("late")
        (out / "notes.txt").write_text("my notes, edited during the save")

    monkeypatch.setattr(folders, "_fsync_tree", meanwhile)
    save(new, out)
    assert loads(out) == new_fp
    assert (out / "written-during-the-save.txt").read_text() == "late"
    assert (out / "notes.txt").read_text() == "my notes, edited during the save"
    assert _siblings(out) == []


def test_a_users_folder_named_like_a_swap_folder_is_never_touched(two_models):
    out, _old_fp, new, _new_fp = two_models
    for name in (f".{out.name}.old", f".{out.name}.staging", f".{out.name}.partial-1"):
        (out.parent / name).mkdir()
        (out.parent / name / "precious.txt").write_text("mine")
    save(new, out)
    recover_output_dir(out)
    for name in (f".{out.name}.old", f".{out.name}.staging", f".{out.name}.partial-1"):
        assert (out.parent / name / "precious.txt").read_text() == "mine"


def test_a_second_run_into_a_locked_directory_fails_at_once(tmp_path, capsys):
    out = tmp_path / "run"
    with OutputLock(out):
        with pytest.raises(UsageError, match="in use by another relational-hf run"):
            OutputLock(out).__enter__()
        assert cli.main(["train", "--output-dir", str(out), "--max-steps", "1"]) == 2
        assert "in use by another relational-hf run" in capsys.readouterr().err
    with OutputLock(out):  # released on exit
        pass


def test_a_lock_held_by_another_process_refuses_until_that_process_dies(tmp_path):
    out = tmp_path / "run"
    script = (
        LIGHT_IMPORT
        + f"""
outputs.OutputLock({str(out)!r}).__enter__()
print("locked", flush=True)
sys.stdin.read()
"""
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError, match="in use by another relational-hf run"):
            OutputLock(out).__enter__()
    finally:
        holder.kill()
        holder.wait(timeout=60)
    with OutputLock(out):  # the operating system released the dead process's lock
        pass


def _checkpoint(folder: Path, step: int, complete: bool) -> None:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    if complete:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def test_resume_picks_the_newest_complete_checkpoint_and_sets_the_others_aside(tmp_path):
    trainer_dir = tmp_path / "trainer_state"
    _checkpoint(trainer_dir / "checkpoint-10", 10, True)
    _checkpoint(trainer_dir / "checkpoint-20", 20, True)
    _checkpoint(trainer_dir / "checkpoint-30", 30, False)  # killed before trainer_state.json
    (trainer_dir / "checkpoint-40").mkdir()
    (trainer_dir / "checkpoint-40" / "trainer_state.json").write_text('{"global_st')  # killed while writing it
    assert outputs.complete_checkpoint(trainer_dir) == str(trainer_dir / "checkpoint-20")
    moved = outputs.set_aside_incomplete_checkpoints(trainer_dir)
    assert sorted(p.name for p in moved) == ["incomplete-checkpoint-30", "incomplete-checkpoint-40"]
    assert (trainer_dir / "incomplete-checkpoint-30" / "model.safetensors").is_file()  # kept, not deleted
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(trainer_dir)).endswith("checkpoint-20")  # the Trainer sees the complete one


@pytest.fixture
def small_text(tmp_path) -> Path:
    path = tmp_path / "train.txt"
    path.write_text(generate_corpus(600, seed=4), encoding="utf-8")
    return path


TINY_TRAIN = [
    "--layers", "1", "--hidden-size", "32", "--heads", "2", "--batch-size", "4", "--block-size", "32",
    "--eval-blocks", "2", "--sample-tokens", "0", "--warmup-steps", "0",
]  # fmt: skip


def test_train_resumes_from_the_complete_checkpoint_and_keeps_user_files(tmp_path, small_text, capsys):
    """A foreign folder is used only with --overwrite, and its files survive; every file the run wrote, the trainer
    checkpoint's included, has the umask's mode; after a crash during a later checkpoint save, --resume continues
    from the last complete one."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    common = ["train", "--train-file", str(small_text), "--output-dir", str(out), *TINY_TRAIN, "--save-steps", "3"]
    assert cli.main([*common, "--max-steps", "6"]) == 2  # foreign and non-empty: refused
    assert cli.main([*common, "--max-steps", "6", "--overwrite"]) == 0
    capsys.readouterr()
    assert (out / "thesis.tex").read_text() == "precious" and loads(out) is not None
    ckpt = out / "trainer_state" / "checkpoint-6"
    assert outputs.checkpoint_is_complete(ckpt)
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.relative_to(out): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # the trainer checkpoint's weights too, not 0o600
    shutil.copytree(ckpt, out / "trainer_state" / "checkpoint-9")  # a later save, killed before its state file
    (out / "trainer_state" / "checkpoint-9" / "trainer_state.json").unlink()
    assert cli.main([*common, "--max-steps", "8", "--resume"]) == 0  # no --overwrite needed: our own output now
    printed = capsys.readouterr().out
    assert "8 steps" in printed  # resumed from checkpoint-6: checkpoint-9 has no state to resume from
    assert (out / "thesis.tex").read_text() == "precious" and loads(out) is not None
    assert not (out / "trainer_state" / "incomplete-checkpoint-9").exists()  # dropped once the model was saved
    # resuming with other model flags is refused before training, naming the setting and its flag
    assert cli.main([*common, "--max-steps", "9", "--resume", "--hidden-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "hidden_size 32" in err and "--hidden-size" in err
    # a fresh run in the same folder: the earlier run's checkpoint-6 (a higher step) must not make the Trainer's
    # rotation delete the new run's checkpoint-3
    assert cli.main([*common, "--max-steps", "3"]) == 0
    assert sorted(p.name for p in (out / "trainer_state").iterdir() if p.is_dir()) == ["checkpoint-3"]


def test_a_diverged_run_does_not_replace_the_previous_checkpoint(tmp_path, small_text, monkeypatch, capsys):
    out = tmp_path / "run"
    save(tiny(1), out)
    before = loads(out)
    from relational_hf.lm import metrics

    monkeypatch.setattr(metrics, "perplexity", lambda model, blocks, **kwargs: float("nan"))
    argv = ["train", "--train-file", str(small_text), "--output-dir", str(out), *TINY_TRAIN, "--max-steps", "2"]
    assert cli.main(argv) == 2
    assert "diverged" in capsys.readouterr().err
    assert loads(out) == before


def test_lora_into_a_full_checkpoint_is_refused_and_the_checkpoint_still_loads(tmp_path, small_text, capsys):
    base = tmp_path / "base"
    save(tiny(1), base)
    from relational_hf.lm.data import byte_level_tokenizer

    byte_level_tokenizer().save_pretrained(base)
    before = loads(base)
    other = tmp_path / "other_full"
    save(tiny(2), other)
    for target in (base, other):
        argv = ["finetune", str(base), "--method", "lora", "--train-file", str(small_text), "--output-dir", str(target)]
        assert cli.main(argv) == 2
        assert "--output-dir" in capsys.readouterr().err
        assert not any(p.name.startswith("adapter_") for p in target.iterdir())
    assert loads(base) == before and loads(other) is not None


def test_push_stages_no_trainer_state_and_no_pickles_at_any_depth(tmp_path):
    from relational_hf.hub.publish import _stage

    src = tmp_path / "ckpt"
    files = {
        "config.json": True,
        "model.safetensors": True,
        "tokenizer.json": True,
        "README.md": True,
        "merged/config.json": True,
        "merged/model.safetensors": True,
        "notes/results.json": True,
        MARKER: False,
        "optimizer.pt": False,
        "training_args.bin": False,
        "trainer_state/checkpoint-3/optimizer.pt": False,
        "trainer_state/checkpoint-3/rng_state.pth": False,
        "trainer_state/checkpoint-3/model.safetensors": False,
        "trainer_state/checkpoint-3/trainer_state.json": False,
        "trainer_state/incomplete-checkpoint-5/scheduler.pt": False,
        "runs/a/checkpoint-7/model.safetensors": False,
        "deep/er/still/scaler.pt": False,
        "deep/er/still/state.pkl": False,
        ".git/config": False,
        "sub/.cache/x.json": False,
    }
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(b"x")
    staging = tmp_path / "staging"
    staging.mkdir()
    _stage(src, staging, None)
    staged = {p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file() or p.is_symlink()}
    assert staged == {name for name, kept in files.items() if kept}


def test_outputs_of_earlier_versions_count_as_project_outputs(tmp_path):
    """A folder saved before the marker existed (config.json beside trainer_state/) is accepted; a folder with only
    a config.json is not, and is left untouched."""
    legacy, foreign = tmp_path / "legacy", tmp_path / "foreign"
    save(tiny(1), legacy)
    (legacy / MARKER).unlink()
    (legacy / "trainer_state").mkdir()
    assert outputs.prepare_output_dir(legacy) == legacy and (legacy / MARKER).is_file()
    save(tiny(1), foreign)
    (foreign / MARKER).unlink()
    with pytest.raises(UsageError, match="not written by relational-hf"):
        outputs.prepare_output_dir(foreign)
    assert not (foreign / MARKER).exists()


def test_a_failed_write_leaves_the_old_checkpoint_and_no_staging_folder(two_models):
    out, old_fp, new, _new_fp = two_models

    def disk_full(folder):
        new.save_pretrained(folder)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="^no space left on device while writing"):
        stage_and_swap(out, disk_full)
    assert loads(out) == old_fp
    assert sorted(p.name for p in out.parent.iterdir()) == ["run"]


def test_a_symlinked_output_directory_stays_a_link_to_the_new_checkpoint(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    save(tiny(1), real)
    link.symlink_to(real)
    new = tiny(2)
    save(new, outputs.normalise_output_dir(link))
    assert link.is_symlink() and loads(link) == fingerprint(new) == loads(real)


def test_new_only_outputs_refuse_a_non_empty_folder_and_leave_nothing_on_failure(tmp_path):
    """`write_new_output` (convert, compress): a non-empty OUT is refused byte for byte unchanged, an empty OUT
    and a new one receive the complete output with the marker, a failed write leaves no OUT, no staging folder and
    no lock file, and a locked OUT is refused."""
    model = tiny(3)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(UsageError, match="OUT .* is not empty"):
        outputs.write_new_output(foreign, model.save_pretrained, command="convert", kind="relational")
    assert [p.name for p in foreign.iterdir()] == ["thesis.tex"] and (foreign / "thesis.tex").read_text() == "precious"
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new"):
        out = outputs.write_new_output(tmp_path / name, model.save_pretrained, command="compress", kind="relational")
        assert loads(out) == fingerprint(model)
        marker = outputs.read_marker(out)
        assert (marker["command"], marker["kind"]) == ("compress", "relational")
        assert set(marker["files"]) == {p.name for p in out.iterdir()} - {MARKER}  # every file it wrote, listed

    def crash(folder):
        model.save_pretrained(folder)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="^no space left on device while writing"):
        outputs.write_new_output(tmp_path / "failed", crash, command="convert", kind="relational")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "foreign", "new"]
    with OutputLock(tmp_path / "locked"), pytest.raises(UsageError, match="in use by another relational-hf run"):
        outputs.write_new_output(tmp_path / "locked", model.save_pretrained, command="convert", kind="relational")


def test_an_unfinished_first_write_is_removed_by_the_next_recovery(tmp_path):
    """A first write killed where nothing can clean up (SIGKILL) leaves its staging folder and no OUT: the next command
    into OUT removes it (nothing of the user's lives there), and a finished staging folder is still recovered."""
    out = tmp_path / "run"
    staging = tmp_path / f".run.{folders.TAG}-staging-0123456789ab"
    staging.mkdir()
    (staging / "model-00001-of-00002.safetensors").write_bytes(b"partial shard")
    (tmp_path / "mine.txt").write_text("my notes")
    recover_output_dir(out)
    assert not out.exists() and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_sigterm_during_a_command_removes_its_staging_folder(tmp_path):
    """SIGTERM while a command writes into its staging folder unwinds like Ctrl-C: exit 143, one line, no OUT and no
    staging folder left beside it."""
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from relational_hf.commands import main as cli
from relational_hf import outputs

def write(folder):
    (folder / "part").write_text("half")
    os.kill(os.getpid(), signal.SIGTERM)
    (folder / "rest").write_text("never")

cli.command_module("export").run = lambda args: outputs.write_new_output({str(tmp_path / "out")!r}, write,
                                                                      command="export", kind="llama") and 0
sys.exit(cli.main(["export", "src", {str(tmp_path / "out")!r}]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 143, done.stderr
    assert "terminated" in done.stderr
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name or p.name == "out"] == []


# ---------------------------------------------------------------------------------------------------------------
# what is not a regular file: written through, or refused before any work; never renamed over, moved or removed
# ---------------------------------------------------------------------------------------------------------------


def _char_device(path: Path) -> Path:
    """A character device node (the /dev/null device) made at `path` in a temporary folder; skips where the user may
    not make one."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, AttributeError, OSError) as err:
        pytest.skip(f"cannot make a device node here ({err})")
    return path


def _socket(path: Path) -> Path:
    """A unix socket's file at `path` (it stays a socket node after the socket is closed)."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(path))
    finally:
        sock.close()
    return path


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail (instead of hanging for ever) when the block takes longer than `seconds`: opening a FIFO nobody reads
    blocks."""

    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s: something opened a FIFO or a socket")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "model"
    tiny(5).save_pretrained(path)
    return path


def _redundancy(checkpoint: Path, *flags: str) -> list[str]:
    return ["redundancy", str(checkpoint), "--no-descriptors", *flags]


def test_json_to_a_character_device_or_a_fifo_is_written_through_and_the_node_stays(tmp_path, checkpoint, capsys):
    """--json naming a device node or a FIFO writes the JSON through it as a stream: the node stays the same node
    (same inode, same kind), a reader of the FIFO receives the whole JSON, and a full device fails in one line."""
    device = _char_device(tmp_path / "null")
    before = device.lstat()
    assert cli.main(_redundancy(checkpoint, "--json", str(device))) == 0
    after = device.lstat()
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    with _deadline(60):
        assert cli.main(_redundancy(checkpoint, "--json", str(fifo))) == 0
    reader.join(30)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert json.loads(received[0])["model_class"] == "RelationalForCausalLM"
    capsys.readouterr()
    full = tmp_path / "full"
    try:
        os.mknod(full, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except OSError:
        return
    assert cli.main(_redundancy(checkpoint, "--json", str(full))) == 2
    assert "no space left on device" in capsys.readouterr().err
    assert stat.S_ISCHR(full.lstat().st_mode)


def _printed_json(out: str) -> dict:
    return json.loads(out[out.index("\n{") + 1 :])


def test_json_to_standard_output_prints_the_json(checkpoint, capsys):
    """`--json -` and `--json /dev/stdout` (here a file, pytest's capture: written through the stream, after the
    report, not renamed over) print the JSON on standard output after the report, whole; and so does /dev/stdout
    when it is a pipe. The "wrote" line goes to stderr."""
    for target in ("-", "/dev/stdout"):
        assert cli.main(_redundancy(checkpoint, "--json", target)) == 0
        printed = capsys.readouterr()
        assert printed.out.startswith("## Redundancy") and _printed_json(printed.out)["model_class"]
        assert "wrote standard output" in printed.err
    argv = [sys.executable, "-m", "relational_hf.commands", *_redundancy(checkpoint, "--json", "/dev/stdout")]
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=PROJECT_ROOT)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.startswith("## Redundancy") and _printed_json(piped.stdout)["model_class"]


def test_json_through_a_symbolic_link_writes_its_target_and_keeps_the_link(tmp_path, checkpoint, capsys):
    """A --json link to a shared results file: the file receives the new JSON, the link stays a link to it; a
    dangling link's target is created."""
    shared, link = tmp_path / "shared.json", tmp_path / "link.json"
    shared.write_text("old results")
    link.symlink_to(shared)
    assert cli.main(_redundancy(checkpoint, "--json", str(link))) == 0
    assert link.is_symlink() and os.readlink(link) == str(shared)
    assert json.loads(shared.read_text())["model_class"] == "RelationalForCausalLM"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made" / "target.json")
    assert cli.main(_redundancy(checkpoint, "--json", str(dangling))) == 0
    assert dangling.is_symlink() and json.loads((tmp_path / "made" / "target.json").read_text())


@pytest.mark.parametrize("kind", ["socket", "directory", "link loop", "through a file"])
def test_an_output_file_that_cannot_be_written_is_refused_before_any_work(kind, tmp_path, checkpoint, capsys):
    """A socket, a directory, a symbolic-link loop or a path through a file as --json or --png: refused in one line
    naming the flag, before the report is computed (nothing printed on stdout), and left as it was."""
    path = tmp_path / "target"
    if kind == "socket":
        _socket(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link loop":
        path.symlink_to(path)
    else:
        path.write_text("a file")
        path = path / "report.json"
    before = os.lstat(path if kind != "through a file" else path.parent)
    for flag in ("--json", "--png"):
        assert cli.main(_redundancy(checkpoint, flag, str(path))) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and flag in captured.err and len(captured.err.strip().splitlines()) == 1
    after = os.lstat(path if kind != "through a file" else path.parent)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


def test_atomic_writes_never_replace_what_is_not_a_regular_file(tmp_path):
    """The atomic writer (every file of an output folder) refuses a FIFO, a socket, a device node or a directory at
    its path instead of renaming over it, and writes a link's target."""
    nodes = {"fifo": lambda p: os.mkfifo(p), "socket": _socket, "directory": lambda p: p.mkdir()}
    for name, make in nodes.items():
        make(tmp_path / name)
        with _deadline(30), pytest.raises(UsageError):
            outputs.atomic_write_text(tmp_path / name, "data")
        assert not (tmp_path / name).is_file()
    (tmp_path / "real").write_text("old")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    outputs.atomic_write_text(tmp_path / "link", "new")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real").read_text() == "new"


def _fill_special_entries(out: Path) -> dict[str, tuple[int, int]]:
    """A FIFO, a socket and (where allowed) a device node inside `out` and in a sub-folder: {name: (inode, mode)}."""
    (out / "sub").mkdir(exist_ok=True)
    os.mkfifo(out / "fifo")
    os.mkfifo(out / "sub" / "fifo")
    _socket(out / "sock")
    with contextlib.suppress(OSError):
        os.mknod(out / "dev", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return {rel: (os.lstat(out / rel).st_ino, os.lstat(out / rel).st_mode) for rel in ("fifo", "sub/fifo", "sock", "dev")
            if os.path.lexists(out / rel)}  # fmt: skip


def test_fifos_sockets_and_devices_in_an_output_folder_are_kept_unopened(two_models):
    """A re-save into a folder holding the user's FIFOs, socket and device node finishes (nothing opens them: a FIFO
    would block) and leaves each the same node at the same path; nothing beside the folder."""
    out, _old_fp, new, new_fp = two_models
    special = _fill_special_entries(out)
    with _deadline(120):
        outputs.write_output(out, new.save_pretrained, command="train", kind="full", overwrite=True)
    assert loads(out) == new_fp and (out / "notes.txt").read_text() == "my notes"
    assert {rel: (os.lstat(out / rel).st_ino, os.lstat(out / rel).st_mode) for rel in special} == special
    assert _siblings(out) == []


def test_a_users_fifo_at_a_name_the_output_writes_is_never_replaced(two_models):
    out, old_fp, new, _new_fp = two_models
    (out / "config.json").unlink()
    os.mkfifo(out / "config.json")
    with _deadline(60), pytest.raises(UsageError, match="config.json, which is a FIFO"):
        outputs.write_output(out, new.save_pretrained, command="train", kind="full", overwrite=True)
    assert stat.S_ISFIFO(os.lstat(out / "config.json").st_mode) and _siblings(out) == []


def test_a_symbolic_link_loop_in_an_output_folder_is_named_and_nothing_is_left(two_models):
    out, old_fp, new, _new_fp = two_models
    (out / "a").symlink_to("b")
    (out / "b").symlink_to("a")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UsageError, match="symbolic link that loops"):
        outputs.write_output(out, new.save_pretrained, command="train", kind="full", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before and loads(out) == old_fp and _siblings(out) == []


MOUNT_SCRIPT = """
import os, subprocess, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from relational_hf.commands import main as cli
out = Path({out!r})
mount = out / {mount!r}
mount.mkdir(exist_ok=True)
if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount)]).returncode:
    sys.exit(77)
(mount / "user.txt").write_text("on the mount")
before = sorted(p.name for p in out.iterdir())
code = cli.main(["canonicalize", {src!r}, str(out), "--overwrite"])
assert code == 2, code
assert os.path.ismount(mount) and (mount / "user.txt").read_text() == "on the mount"
assert sorted(p.name for p in out.iterdir()) == before
assert [p.name for p in out.parent.iterdir() if p.name.startswith("." + out.name)] == []
print("refused")
"""


@pytest.mark.parametrize("where", ["inside", "itself"])
def test_a_mount_point_in_or_at_an_output_folder_is_refused_before_any_work(where, tmp_path):
    """A tmpfs mounted inside OUT (or at OUT), in a private mount namespace: the save refuses in one line naming the
    mount, the mount stays mounted with its files, nothing is left beside OUT. Skipped where no private mount
    namespace can be made."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available")
    src = tmp_path / "src"
    tiny(6).save_pretrained(src)
    out = tmp_path / "run"
    stage_and_swap(out, tiny(7).save_pretrained)
    mount = "mnt" if where == "inside" else "."
    script = MOUNT_SCRIPT.format(root=str(PROJECT_ROOT), out=str(out), mount=mount, src=str(src))
    try:
        done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", script],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    except OSError as err:
        pytest.skip(f"unshare cannot run ({err})")
    if done.returncode == 77 or "unshare failed" in done.stderr or "Operation not permitted" in done.stderr:
        pytest.skip(f"no private mount namespace here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    assert "mount point" in done.stderr and "OUT" in done.stderr
    assert loads(out) is not None


def _without_root_powers(script: str, home: Path) -> subprocess.CompletedProcess:
    """Run `script` in a Python process for which file permissions hold (as root: without the capabilities that
    override them, through util-linux's setpriv; skips where that is impossible)."""
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(PROJECT_ROOT)}
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: permissions cannot be made to hold")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
        probe = subprocess.run([*prefix, sys.executable, "-c", "pass"], capture_output=True, timeout=60)
        if probe.returncode:
            pytest.skip(f"cannot drop root's file capabilities here: {probe.stderr[-200:]!r}")
    return subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)


READ_ONLY_SCRIPT = """
import os, sys
from pathlib import Path
from relational_hf.commands import main as cli
from relational_hf.outputs import write_output
out = Path({out!r})
os.chmod(out / "ro", 0o555)
def write(folder):
    (folder / "config.json").write_text("{{}}")
try:
    write_output(out, write, command="train", kind="full", overwrite=True)
except ValueError as err:
    print("refused:", err)
os.chmod(out.parent, 0o555)
code = cli.main(["redundancy", {model!r}, "--no-descriptors", "--json", str(out.parent / "r.json")])
print("json exit", code)
"""


def test_a_read_only_sub_folder_is_named_and_an_unwritable_json_folder_refused_first(tmp_path):
    """Where permissions hold (as root: without the capabilities that override them): a save into a folder with a read-only sub-folder is refused in one line
    naming it, the folder keeps its files and nothing is left beside it; --json into a folder the user cannot write
    is refused before the report is computed (no report on stdout)."""
    base = tmp_path / "base"
    out = base / "run"
    out.mkdir(parents=True)
    (out / "ro").mkdir()
    (out / "ro" / "kept.txt").write_text("mine")
    model = tmp_path / "model"
    tiny(8).save_pretrained(model)
    done = _without_root_powers(READ_ONLY_SCRIPT.format(out=str(out), model=str(model)), base)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "ro is read-only" in done.stdout
    assert (out / "ro" / "kept.txt").read_text() == "mine" and sorted(p.name for p in base.iterdir()) == ["run"]
    assert "json exit 2" in done.stdout and "Redundancy" not in done.stdout
    assert "--json" in done.stderr and "not writable" in done.stderr


# ---------------------------------------------------------------------------------------------------------------
# --overwrite at the end as at the start; the user's files inside the trainer's folders
# ---------------------------------------------------------------------------------------------------------------


def test_train_overwrite_into_a_users_folder_saves_and_user_files_in_checkpoints_survive(tmp_path, small_text, capsys):
    """`train --overwrite` into a user's folder holding a config.json trains and saves (the final save honours
    --overwrite); a user file put into a trainer checkpoint (also in a sub-folder of it) survives the next run, which
    supersedes and drops that checkpoint."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "thesis.tex").write_text("precious")
    common = ["train", "--train-file", str(small_text), "--output-dir", str(out), *TINY_TRAIN, "--save-steps", "2"]
    assert cli.main([*common, "--max-steps", "2", "--overwrite"]) == 0, capsys.readouterr().err
    assert loads(out) is not None and (out / "thesis.tex").read_text() == "precious"
    checkpoint = out / "trainer_state" / "checkpoint-2"
    assert outputs.checkpoint_is_complete(checkpoint)
    (checkpoint / "my_notes.txt").write_text("about step 2")
    (checkpoint / "plots").mkdir()
    (checkpoint / "plots" / "loss.png").write_bytes(b"png")
    assert cli.main([*common, "--max-steps", "2"]) == 0, capsys.readouterr().err  # a fresh run: step 2 superseded
    left = {
        p.relative_to(out / "trainer_state").as_posix(): p.read_bytes()
        for p in (out / "trainer_state").rglob("*")
        if p.is_file() and p.relative_to(out / "trainer_state").parts[0] != "checkpoint-2"
    }
    # of the superseded checkpoint, the user's files alone are left, nothing of the Trainer's
    assert left == {
        "superseded-checkpoint-2/my_notes.txt": b"about step 2",
        "superseded-checkpoint-2/plots/loss.png": b"png",
    }
    assert outputs.checkpoint_is_complete(out / "trainer_state" / "checkpoint-2")  # the new run's


def test_rotation_and_discarding_remove_only_the_trainers_files(tmp_path):
    """The one-kept rotation after a checkpoint save, a failed run's discarding and the dropping of set-aside
    checkpoints remove the files the Trainer wrote (its manifest, or its file names where there is none) and keep
    every other file, and the folder holding it."""
    trainer_dir = tmp_path / "trainer_state"
    for step in (2, 4):
        _checkpoint(trainer_dir / f"checkpoint-{step}", step, complete=True)
        outputs.rotate_checkpoints(trainer_dir)
        (trainer_dir / f"checkpoint-{step}" / "user.txt").write_text(f"mine {step}")
    assert sorted(p.name for p in (trainer_dir / "checkpoint-2").iterdir()) == ["user.txt"]
    _checkpoint(trainer_dir / "checkpoint-6", 6, complete=True)  # a failed run's, killed before its manifest
    (trainer_dir / "checkpoint-6" / "optimizer.pt").write_bytes(b"state")
    (trainer_dir / "checkpoint-6" / "results.csv").write_text("mine 6")
    outputs.discard_run_checkpoints(trainer_dir, after_step=4)
    assert sorted(p.name for p in (trainer_dir / "checkpoint-6").iterdir()) == ["results.csv"]
    outputs.set_aside_incomplete_checkpoints(trainer_dir, everything=True)
    outputs.drop_set_aside_checkpoints(trainer_dir)
    left = {p.relative_to(trainer_dir).as_posix(): p.read_text() for p in trainer_dir.rglob("*") if p.is_file()}
    assert left == {
        "incomplete-checkpoint-2/user.txt": "mine 2",
        "superseded-checkpoint-4/user.txt": "mine 4",
        "incomplete-checkpoint-6/results.csv": "mine 6",
    }


@pytest.mark.usefixtures("no_training")
def test_a_clash_with_a_users_checkpoint_file_is_refused_before_training(tmp_path, small_text, capsys):
    """In an earlier output whose config.json the user has since edited, a run without --overwrite is refused before
    any training (naming the file and --overwrite), and the folder is left byte for byte as it was."""
    out = tmp_path / "run"
    stage_and_swap(out, tiny(1).save_pretrained)
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), "edited": 1}))
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    argv = ["train", "--train-file", str(small_text), "--output-dir", str(out), *TINY_TRAIN, "--max-steps", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "--overwrite" in err
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert _siblings(out) == []


def test_a_refused_run_leaves_nothing_of_the_tools_in_a_users_folder(tmp_path, capsys):
    """A run into a user's folder (--overwrite) refused after the claim (the data are too short) leaves no marker,
    no trainer_state/ and no lock file: the folder is as it was."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    argv = ["train", "--train-file", str(short), "--output-dir", str(out), *TINY_TRAIN, "--overwrite"]
    assert cli.main(argv) == 2
    assert "--train-file" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"] and sorted(os.listdir(tmp_path)) == [
        "mine",
        "short.txt",
    ]
