"""Everything a command writes: output folders owned by manifest, one staging path, atomic single files.

Guarantees (see the README section "What is guaranteed on failure"):

- **Ownership by manifest.** A folder is this project's output when it holds the marker file `.relational-hf-output`.
  The marker lists every file the last save wrote, with its size and a fingerprint (SHA-256 up to 64 MiB, the
  modification time beyond). A save replaces or removes only files the marker lists *and* that still match their
  fingerprint: a file the user added, renamed into the folder or edited since is never deleted, whatever its name.
  A new file that would take the name of a file that is not ours is refused unless the user passed `--overwrite`
  (which allows exactly that replacement). A non-empty folder without the marker is refused unless `--overwrite`;
  the current directory and its parents are always refused; paths are compared after resolving symbolic links.
- **One writer.** `OutputLock` holds an exclusive `fcntl` lock on the sibling file `.NAME.relational-hf-lock` for the
  whole run; a second run into the same folder fails at once.
- **Stage and swap.** `stage_and_swap` writes the new output into the sibling `.NAME.relational-hf-staging-TOKEN`,
  hard-links into it every file of the old folder that is not ours (and the trainer checkpoints in `trainer_state/`),
  writes the marker last, fsyncs, and exchanges the two folders with one atomic `renameat2(RENAME_EXCHANGE)` (or,
  where the file system lacks it, renames the old folder to `.NAME.relational-hf-old-TOKEN` and the new one in).
  The old folder is then retired file by file: files created in it during the save are moved into the new folder,
  our own files and the carried links are removed, and the folder is removed only when empty (never recursively).
  `recover_output_dir` (run at the start of every write) finishes or undoes a swap a crash interrupted, the same way.
- **Atomic files.** `atomic_write_text` / `atomic_write_bytes` write a single file through a temporary sibling,
  fsynced and renamed over it: a reader never sees half a file.
- **One rule for every path written** (`paths`): a regular file or a new path is written atomically; a symbolic
  link is resolved and its target written (the link kept; a loop refused); `-`, a character device or a FIFO named
  by the user (`--json /dev/stdout`, `--json -`) is written through as a stream; a socket, a directory where a
  file is expected, a block device is refused before any work (`check_output_file`, `write_file`, `save_figure`).
  Nothing that is not a regular file is ever renamed over, moved or removed, and the folder every output goes into
  is checked writable before the work.
- **What a save cannot keep is refused first.** FIFOs, sockets and device nodes in an output folder are the user's:
  kept by a hard link across the swap, never opened; one at a name the output writes is refused even with
  `--overwrite`. A mount point in (or at) a folder a save swaps, a symbolic-link loop, a read-only or unreadable
  sub-folder: refused in one line before any work (`check_folder_entries`), nothing left behind.
- **A full disk said so.** A save that runs out of space (whatever the writer raised: an OSError, safetensors' or
  tokenizers' error, torch's errno-less zip-writer failure on a file system with no space left) ends with one
  `DiskFullError` (an OSError, errno ENOSPC) whose message starts "no space left on device" and says what was kept
  (`reporting_disk_full`); the old output is untouched, as for any failed save.
- **Complete trainer checkpoints.** The Trainer writes `trainer_state.json` last into `checkpoint-N/`;
  `complete_checkpoint` accepts a checkpoint only when that file parses and the weights it needs are present, and
  `set_aside_incomplete_checkpoints` renames the others to `incomplete-checkpoint-N` (and, when a fresh run starts
  in an earlier run's folder, that run's checkpoints to `superseded-checkpoint-N`), so that neither `--resume` nor
  the rotation picks them; they are removed only after the new run's model is saved. A checkpoint is never removed
  whole: only the files the Trainer wrote go (its manifest, `record_checkpoint`; by name where it has none), so a
  file the user put into `trainer_state/...` survives, with its folder (`remove_checkpoint`, `rotate_checkpoints`).
- **--overwrite at the end as at the start.** `prepare_output_dir` refuses, before any training, a file of a
  checkpoint's name that relational-hf did not write (unless `--overwrite`), and the final save of `train` and
  `finetune` receives the same `--overwrite`; `unclaimed_on_failure` takes back what a failed run's claim added.
"""

from .checkpoints import normalize_tokenizer_config, save_checkpoint, save_tokenizer
from .files import (
    HASH_LIMIT,
    DiskFullError,
    atomic_write_bytes,
    atomic_write_text,
    fingerprint,
    is_disk_full,
    reporting_disk_full,
)
from .folders import (
    MARKER,
    TRAINER_DIR,
    OutputLock,
    check_folder_entries,
    check_new_output,
    check_owned_names,
    holds_full_checkpoint,
    is_project_output,
    normalise_output_dir,
    owned_files,
    prepare_output_dir,
    read_marker,
    record_files,
    recover_output_dir,
    remove_if_unused,
    stage_and_swap,
    unclaimed_on_failure,
    write_marker,
    write_new_output,
    write_output,
    write_owned_file,
)
from .paths import STDOUT, FileTarget, check_output_file, file_target, save_figure, say_wrote, write_file
from .trainer_state import (
    CHECKPOINT_MANIFEST,
    checkpoint_is_complete,
    complete_checkpoint,
    discard_run_checkpoints,
    drop_set_aside_checkpoints,
    record_checkpoint,
    remove_checkpoint,
    rotate_checkpoints,
    set_aside_incomplete_checkpoints,
)

__all__ = [
    "CHECKPOINT_MANIFEST",
    "HASH_LIMIT",
    "MARKER",
    "DiskFullError",
    "FileTarget",
    "STDOUT",
    "TRAINER_DIR",
    "OutputLock",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_folder_entries",
    "check_new_output",
    "check_output_file",
    "check_owned_names",
    "checkpoint_is_complete",
    "complete_checkpoint",
    "discard_run_checkpoints",
    "drop_set_aside_checkpoints",
    "file_target",
    "fingerprint",
    "holds_full_checkpoint",
    "is_disk_full",
    "is_project_output",
    "normalise_output_dir",
    "normalize_tokenizer_config",
    "owned_files",
    "prepare_output_dir",
    "read_marker",
    "record_checkpoint",
    "record_files",
    "recover_output_dir",
    "remove_checkpoint",
    "remove_if_unused",
    "reporting_disk_full",
    "rotate_checkpoints",
    "save_checkpoint",
    "save_figure",
    "say_wrote",
    "save_tokenizer",
    "set_aside_incomplete_checkpoints",
    "stage_and_swap",
    "unclaimed_on_failure",
    "write_file",
    "write_marker",
    "write_new_output",
    "write_output",
    "write_owned_file",
]
