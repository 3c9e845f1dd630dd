"""A full disk during a save ends with one line that says "no space left on device", and the old output stays.

The saves run for real on a small tmpfs mounted in a private mount namespace (`unshare -rm`), so the errors are
whatever safetensors, torch and Python raise when the device is full; the test skips where such a namespace cannot
be made."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relational_hf.outputs import DiskFullError, is_disk_full, reporting_disk_full
from relational_hf.outputs import files as output_files

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _can_mount_tmpfs(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k none {probe}"], capture_output=True, timeout=60
    )
    return done.returncode == 0


def run_on_full_disk(tmp_path: Path, size_kib: int, script: str) -> subprocess.CompletedProcess:
    """Run the Python `script` with MNT (a tmpfs of `size_kib` KiB, in a private mount namespace) and TMP (a folder
    on the ordinary disk) defined; its stdout and stderr are returned."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs `unshare -rm` and tmpfs mounts (Linux user and mount namespaces)")
    mnt, work = tmp_path / "mnt", tmp_path / "work"
    mnt.mkdir()
    work.mkdir()
    program = tmp_path / "script.py"
    program.write_text(f"from pathlib import Path\nMNT, TMP = Path({str(mnt)!r}), Path({str(work)!r})\n" + script)
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), TOKENIZERS_PARALLELISM="false")
    command = f"mount -t tmpfs -o size={size_kib}k none {mnt} && exec {sys.executable} {program}"
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, timeout=600, env=env, cwd=work
    )


_TINY = textwrap.dedent(
    """
    import torch
    from relational_hf import RelationalConfig, RelationalForCausalLM
    from relational_hf.commands import main as cli
    from relational_hf.outputs import OutputLock, stage_and_swap

    def tiny(d, seed=0):
        torch.manual_seed(seed)
        config = RelationalConfig(vocab_size=259, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=1,
                                  num_attention_heads=2)
        return RelationalForCausalLM(config)

    def listing(folder):
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    """
)


def _error_line(stderr: str, command: str) -> str:
    """The one error line of `command` in `stderr` (fails the test unless there is exactly one)."""
    lines = [line for line in stderr.splitlines() if line.startswith(f"relational-hf {command}: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_full_disk_while_training_says_so_and_keeps_the_previous_model(tmp_path):
    """train into a folder holding a model, on a disk too small for the trainer checkpoint: exit 2, one line "no
    space left on device", the previous model loads with its own weights, no half-written checkpoint is left."""
    script = _TINY + textwrap.dedent(
        """
        from relational_hf.lm.data import generate_corpus
        from transformers import AutoModelForCausalLM
        (TMP / "text.txt").write_text(generate_corpus(200, seed=1))
        out = MNT / "run"
        old = tiny(8)
        with OutputLock(out):
            stage_and_swap(out, old.save_pretrained)
        code = cli.main(["train", "--train-file", str(TMP / "text.txt"), "--output-dir", str(out), "--hidden-size",
                         "64", "--layers", "1", "--heads", "2", "--batch-size", "2", "--block-size", "16",
                         "--max-steps", "2", "--eval-blocks", "1", "--sample-tokens", "0"])
        print("CODE", code)
        loaded = AutoModelForCausalLM.from_pretrained(out)
        print("SAME", bool(torch.equal(loaded.model.embed_tokens.weight, old.model.embed_tokens.weight)))
        print("TRAINER", listing(out / "trainer_state"))
        print("SIBLINGS", sorted(p.name for p in MNT.iterdir()))
        """
    )
    done = run_on_full_disk(tmp_path, 400, script)
    assert "CODE 2" in done.stdout, done.stdout + done.stderr
    last = _error_line(done.stderr, "train")
    assert last.startswith("relational-hf train: error: no space left on device while writing"), last
    assert "keeps its previous model" in last and "Traceback" not in done.stderr
    assert "SAME True" in done.stdout
    assert "TRAINER []" in done.stdout  # the half-written checkpoint, useless to --resume, is gone
    assert "SIBLINGS ['run']" in done.stdout  # no staging folder, no lock file left


def test_a_full_disk_while_converting_says_so_and_leaves_nothing(tmp_path):
    """convert (streamed and in memory) onto a disk too small for the output: exit 2, one line, no OUT, no staging
    folder, no lock file."""
    script = _TINY + textwrap.dedent(
        """
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        src = TMP / "llama"
        LlamaForCausalLM(LlamaConfig(vocab_size=2000, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(src)
        for extra in ([], ["--no-stream"]):
            print("CODE", cli.main(["convert", str(src), str(MNT / "out"), *extra]), listing(MNT))
        """
    )
    done = run_on_full_disk(tmp_path, 100, script)
    assert done.stdout.count("CODE 2 []") == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("relational-hf convert: error:")]
    assert len(errors) == 2 and all("no space left on device while writing" in e for e in errors), errors
    assert all("out was not created" in e for e in errors) and "Traceback" not in done.stderr


def test_disk_full_is_recognised_in_every_form_the_writers_use(tmp_path, monkeypatch):
    """ENOSPC and EDQUOT, the Rust writers' text (safetensors, tokenizers), an error raised from one of them, and
    torch's errno-less zip-writer failure where the file system has almost no space left; nothing else."""
    rust = Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })')
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(rust) and is_disk_full(Exception("No space left on device (os error 28)"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("could not save the checkpoint") from inner
    except RuntimeError as chained:
        assert is_disk_full(chained)
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(output_files, "free_bytes", lambda path: 10_000)
    assert is_disk_full(torch_error, tmp_path)
    monkeypatch.setattr(output_files, "free_bytes", lambda path: 50 * 2**30)
    assert not is_disk_full(torch_error, tmp_path)  # plenty of space: some other write failure, reported as is
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("space is not a valid token"))
    with pytest.raises(DiskFullError, match=r"^no space left on device while writing .*out; .* free there\. kept"):
        with reporting_disk_full(tmp_path / "out", "kept"):
            raise rust
    with pytest.raises(PermissionError):
        with reporting_disk_full(tmp_path / "out", "kept"):
            raise PermissionError(errno.EACCES, "Permission denied")
