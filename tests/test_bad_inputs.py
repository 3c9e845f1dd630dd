"""Every command refuses bad input before any work, with one line that names the flag or file and what is allowed.

Each case runs `relational_hf.cli.main([...])` in-process and checks: exit status 2, no traceback, and the error
message contains the expected words (the flag or file, and the rule). Training is forbidden in this module (a
Trainer.train call fails the test), so every check must happen before the expensive work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from relational_hf.commands import main as cli
from relational_hf.lm.data import byte_level_tokenizer, generate_corpus
from relational_hf.outputs import MARKER

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Inputs good and bad: texts, checkpoints (relational fp32/fp16, Llama), foreign folders, junk files."""
    from tiny_models import tiny_llama

    from relational_hf import RelationalConfig, RelationalForCausalLM

    root = tmp_path_factory.mktemp("bad_inputs")
    f = {"root": root}
    f["text"] = root / "train.txt"
    f["text"].write_text(generate_corpus(400, seed=2), encoding="utf-8")
    f["short_val"] = root / "shortval.txt"
    f["short_val"].write_text("ada counts one two three.\n" * 60, encoding="utf-8")  # ~1.5k chars: val < 1024 tokens
    f["binary"] = root / "weights.bin"
    f["binary"].write_bytes(bytes(range(256)) * 20)
    f["latin1"] = root / "latin1.txt"
    f["latin1"].write_bytes(("caf\xe9 na\xefve " * 200).encode("latin-1"))
    f["empty"] = root / "empty.txt"
    f["empty"].write_text("")
    f["tiny"] = root / "tiny.txt"
    f["tiny"].write_text("too short")
    f["a_file"] = root / "plain_file"
    f["a_file"].write_text("x")
    f["foreign"] = root / "foreign"
    f["foreign"].mkdir()
    (f["foreign"] / "thesis.tex").write_text("precious")
    f["no_config"] = root / "no_config"
    f["no_config"].mkdir()
    (f["no_config"] / "notes.txt").write_text("no model here")
    torch.manual_seed(0)
    tokenizer = byte_level_tokenizer()
    config = RelationalConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = RelationalForCausalLM(config)
    f["model"] = root / "model"
    model.save_pretrained(f["model"])
    tokenizer.save_pretrained(f["model"])
    f["fp16"] = root / "model_fp16"
    model.half().save_pretrained(f["fp16"])
    tokenizer.save_pretrained(f["fp16"])
    f["llama"] = root / "llama"
    tiny_llama().save_pretrained(f["llama"])
    f["bin_only"] = root / "bin_only"
    f["bin_only"].mkdir()
    (f["bin_only"] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (f["bin_only"] / "pytorch_model.bin").write_bytes(b"0")
    f["lora_out"] = root / "lora_out"
    f["lora_out"].mkdir()
    (f["lora_out"] / MARKER).write_text(json.dumps({"command": "finetune", "kind": "lora"}))
    f["incomplete"] = root / "incomplete_run"
    (f["incomplete"] / "trainer_state" / "checkpoint-5").mkdir(parents=True)
    (f["incomplete"] / MARKER).write_text(json.dumps({"command": "train", "kind": "full"}))
    (f["incomplete"] / "trainer_state" / "checkpoint-5" / "model.safetensors").write_bytes(b"partial")
    f["no_traj"] = root / "no_traj"
    f["no_traj"].mkdir()
    f["junk_npz"] = root / "junk.npz"
    f["junk_npz"].write_bytes(b"PK\x03\x04 not really a zip")
    f["ids"] = root / "ids.pt"
    torch.save(torch.randint(0, 40, (30,)), f["ids"])
    f["a_dir"] = root / "a_dir"
    f["a_dir"].mkdir()
    np.savez(root / "steps_only.npz", step=np.arange(3))  # an archive without the recorder's arrays
    f["steps_only"] = root / "steps_only.npz"
    _broken_checkpoints(root, f, tokenizer)
    zeroed = tiny_llama()
    with torch.no_grad():
        zeroed.model.layers[1].self_attn.k_proj.weight[:8] = 0.0  # key head 0 of layer 1: every rotary pair zero
    f["zeroed_head"] = root / "zeroed_head"
    zeroed.save_pretrained(f["zeroed_head"])
    return f


def _broken_checkpoints(root: Path, f: dict[str, Path], tokenizer) -> None:
    """Checkpoints whose weights disagree with their config.json (Llama and relational, vocabulary 259 so that the
    byte tokenizer fits): a tensor missing, the file cut short, a layer more or fewer in the config."""
    from safetensors.torch import load_file, save_file
    from tiny_models import tiny_model

    for family, model in (
        ("llama", tiny_model("llama", vocab_size=259, num_key_value_heads=2)),
        ("rel", tiny_model("relational", vocab_size=259, gauge="pivot")),
    ):
        whole = root / f"{family}_whole"
        model.save_pretrained(whole)
        tokenizer.save_pretrained(whole)
        for case in ("missing", "cut", "more_layers", "fewer_layers"):
            folder = root / f"{family}_{case}"
            shutil.copytree(whole, folder)
            weights, config = folder / "model.safetensors", folder / "config.json"
            if case == "missing":
                tensors = load_file(weights)
                del tensors["model.layers.1.mlp.down_proj.weight"]
                save_file(tensors, weights, metadata={"format": "pt"})
            elif case == "cut":
                weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
            else:
                values = json.loads(config.read_text())
                values["num_hidden_layers"] = 3 if case == "more_layers" else 1
                values.pop("layer_types", None)
                config.write_text(json.dumps(values))
            f[f"{family}_{case}"] = folder
    _damaged_checkpoints(root, f)


def _damaged_checkpoints(root: Path, f: dict[str, Path]) -> None:
    """A Llama checkpoint with a config field of the wrong type, one whose config's sizes disagree with its weights,
    one with a NaN weight; a forged teacher-text file (the right format tag, no settings)."""
    from safetensors.torch import load_file, save_file

    from relational_hf.compress.distill import _FORMAT

    whole = f["llama_whole"] = root / "llama_whole"
    for case, field, value in (("two", "num_hidden_layers", "two"), ("wide", "intermediate_size", None)):
        folder = root / f"llama_{case}"
        shutil.copytree(whole, folder)
        values = json.loads((folder / "config.json").read_text())
        values[field] = value if value is not None else values[field] * 2
        (folder / "config.json").write_text(json.dumps(values))
        f[f"llama_{case}"] = folder
    f["llama_nan"] = root / "llama_nan"
    shutil.copytree(whole, f["llama_nan"])
    tensors = load_file(f["llama_nan"] / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, f["llama_nan"] / "model.safetensors", metadata={"format": "pt"})
    import socket

    f["socket"] = root / "a_socket"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(f["socket"]))  # the socket's node stays after it is closed
    listener.close()
    f["forged_text"] = root / "forged_text.safetensors"
    save_file({"input_ids": torch.zeros(4, 16, dtype=torch.long)}, f["forged_text"], metadata={"format": _FORMAT})


# bad input must be refused before training: any Trainer.train call fails the test (conftest); runs in a fresh cwd
pytestmark = pytest.mark.usefixtures("no_training")


T, FT, CV, AN, RD, PU, DY = "train", "finetune", "convert", "analyze", "redundancy", "push", "dynamics"

# (command line with {name} placeholders for the fixture files, words the error message must contain)
CASES: list[tuple[str, list[str]]] = [
    # --- train: numbers ---
    (f"{T} --block-size 0", ["--block-size", ">= 2", "got 0"]),
    (f"{T} --block-size 1", ["--block-size", ">= 2"]),
    (f"{T} --block-size abc", ["--block-size", "invalid int value", "'abc'"]),
    (f"{T} --block-size 2.5", ["--block-size", "invalid int value", "'2.5'"]),
    (f"{T} --batch-size 0", ["--batch-size", ">= 1"]),
    (f"{T} --batch-size -3", ["--batch-size", ">= 1"]),
    (f"{T} --max-steps 0", ["--max-steps", ">= 1"]),
    (f"{T} --max-minutes -1", ["--max-minutes", "(0, inf)"]),
    (f"{T} --max-minutes nan", ["--max-minutes", "finite"]),
    (f"{T} --max-minutes inf", ["--max-minutes", "finite"]),
    (f"{T} --max-minutes 0", ["--max-minutes", "(0, inf)"]),
    (f"{T} --learning-rate inf", ["--learning-rate", "finite"]),
    (f"{T} --learning-rate 0", ["--learning-rate", "(0, inf)"]),
    (f"{T} --learning-rate=-1e-3", ["--learning-rate", "(0, inf)"]),
    (f"{T} --learning-rate nan", ["--learning-rate", "finite"]),
    (f"{T} --learning-rate fast", ["--learning-rate", "invalid float value", "'fast'"]),
    (f"{T} --weight-decay -1", ["--weight-decay", "[0, inf)"]),
    (f"{T} --weight-decay nan", ["--weight-decay", "finite"]),
    (f"{T} --save-steps 0", ["--save-steps", ">= 1"]),
    (f"{T} --eval-blocks 0", ["--eval-blocks", ">= 1"]),
    (f"{T} --eval-blocks -1", ["--eval-blocks", ">= 1"]),
    (f"{T} --sample-tokens -1", ["--sample-tokens", ">= 0"]),
    (f"{T} --warmup-steps -1", ["--warmup-steps", ">= 0"]),
    (f"{T} --seed -1", ["--seed", ">= 0"]),
    (f"{T} --tokenizer bpe --bpe-vocab-size 10", ["--bpe-vocab-size", ">= 260"]),
    (f"{T} --bpe-vocab-size 5000", ["--bpe-vocab-size", "--tokenizer bpe"]),
    (f"{T} --parallel-suppression -1", ["--parallel-suppression", "[0, inf)"]),
    (f"{T} --parallel-suppression nan", ["--parallel-suppression", "finite"]),
    (f"{T} --parallel-suppression-site value", ["--parallel-suppression-site", "--parallel-suppression > 0"]),
    # --- train: model shape ---
    (f"{T} --hidden-size 0", ["--hidden-size", ">= 1"]),
    (f"{T} --layers 0", ["--layers", ">= 1"]),
    (f"{T} --heads 0", ["--heads", ">= 1"]),
    (f"{T} --heads 3", ["--heads 3", "--hidden-size 64"]),
    (f"{T} --kv-heads 3", ["--kv-heads 3", "--heads 4"]),
    (f"{T} --kv-heads 8", ["--kv-heads 8", "divide"]),
    (f"{T} --kv-heads 0", ["--kv-heads", ">= 1"]),
    (f"{T} --intermediate-size 0", ["--intermediate-size", ">= 1"]),
    (f"{T} --qk-rank 0", ["--qk-rank", ">= 1"]),
    (f"{T} --qk-rank 3", ["--qk-rank", "even"]),
    (f"{T} --qk-rank 64", ["--qk-rank"]),
    (f"{T} --architecture llama --qk-rank 8", ["--qk-rank", "relational"]),
    (f"{T} --architecture llama --value-parallel-removal", ["--value-parallel-removal", "relational"]),
    (f"{T} --architecture llama --gauge free", ["--gauge", "relational"]),
    (f"{T} --architecture llama --position-encoding none", ["--position-encoding", "relational"]),
    (f"{T} --architecture gpt", ["--architecture", "invalid choice"]),
    (f"{T} --tokenizer words", ["--tokenizer", "invalid choice"]),
    (f"{T} --projection maybe", ["--projection", "invalid choice"]),
    # --- train: data ---
    (f"{T} --train-file {{root}}/missing.txt", ["--train-file", "no such file or directory", "missing.txt"]),
    (f"{T} --train-file {{binary}}", ["--train-file", "weights.bin", "binary"]),
    (f"{T} --train-file {{latin1}}", ["--train-file", "latin1.txt", "not valid UTF-8"]),
    (f"{T} --train-file {{empty}}", ["--train-file", "empty.txt", "empty"]),
    (f"{T} --train-file {{a_dir}}", ["--train-file", "not a regular file"]),
    (f"{T} --train-file {{tiny}}", ["--train-file", "tiny.txt", "need at least 1000"]),
    (f"{T} --train-file {{text}} --dataset wikitext", ["--train-file", "--dataset"]),
    (f"{T} --dataset-config wikitext-2-raw-v1", ["--dataset-config", "--dataset"]),
    (f"{T} --text-column ''", ["--text-column", "empty"]),
    (f"{T} --dataset ''", ["--dataset", "empty"]),
    (f"{T} --dataset ./corpora/wiki", ["--dataset ./corpora/wiki", "no such file or directory"]),
    (f"{T} --train-file {{short_val}} --block-size 1024", ["validation text", "--block-size"]),
    (f"{T} --train-file {{text}} --block-size 100000", ["training text", "--block-size"]),
    # --- train: output directory ---
    (f"{T} --output-dir .", ["--output-dir", "current directory"]),
    (f"{T} --output-dir ..", ["--output-dir", "current directory"]),
    (f"{T} --output-dir ''", ["--output-dir", "empty"]),
    (f"{T} --output-dir {{foreign}}", ["--output-dir", "not empty", "--overwrite"]),
    (f"{T} --output-dir {{a_file}}", ["--output-dir", "not a directory"]),
    (f"{T} --output-dir {{lora_out}}", ["--output-dir", "lora", "--overwrite"]),
    (f"{T} --resume --output-dir {{root}}/never_ran", ["--resume", "does not exist"]),
    (f"{T} --resume --output-dir {{incomplete}}", ["--resume", "no complete trainer checkpoint"]),
    # --- finetune ---
    (f"{FT} ./no/such/model", ["MODEL", "no such file or directory"]),
    (f"{FT} {{root}}/nothing_here", ["MODEL", "no such file or directory"]),
    (f"{FT} {{no_config}}", ["MODEL", "no config.json"]),
    (f"{FT} {{model}} --tokenizer ./missing_tok", ["--tokenizer", "no such file or directory"]),
    (f"{FT} {{model}} --lora-r 0 --method lora", ["--lora-r", ">= 1"]),
    (f"{FT} {{model}} --method lora --lora-alpha 0", ["--lora-alpha", "(0, inf)"]),
    (f"{FT} {{model}} --method lora --lora-alpha nan", ["--lora-alpha", "finite"]),
    (f"{FT} {{model}} --method lora --lora-dropout 1.0", ["--lora-dropout", "[0, 1)"]),
    (f"{FT} {{model}} --method lora --lora-dropout -0.1", ["--lora-dropout", "[0, 1)"]),
    (f"{FT} {{model}} --method lora --lora-targets ''", ["--lora-targets", "empty"]),
    (f"{FT} {{model}} --learning-rate 0", ["--learning-rate", "(0, inf)"]),
    (f"{FT} {{model}} --learning-rate inf", ["--learning-rate", "finite"]),
    (f"{FT} {{model}} --gradient-accumulation-steps 0", ["--gradient-accumulation-steps", ">= 1"]),
    (f"{FT} {{model}} --logging-steps 0", ["--logging-steps", ">= 1"]),
    (f"{FT} {{model}} --save-steps 0", ["--save-steps", ">= 1"]),
    (f"{FT} {{model}} --eval-blocks 0", ["--eval-blocks", ">= 1"]),
    (f"{FT} {{model}} --max-steps 0", ["--max-steps", ">= 1"]),
    (f"{FT} {{model}} --max-minutes nan", ["--max-minutes", "finite"]),
    (f"{FT} {{model}} --weight-decay -1", ["--weight-decay", "[0, inf)"]),
    (f"{FT} {{model}} --block-size 1", ["--block-size", ">= 2"]),
    (f"{FT} {{model}} --batch-size 0", ["--batch-size", ">= 1"]),
    (f"{FT} {{model}} --parallel-suppression -1", ["--parallel-suppression", "[0, inf)"]),
    (f"{FT} {{model}} --method lora --projection update", ["--projection", "--method full"]),
    (f"{FT} {{model}} --merge", ["--merge", "--method lora"]),
    (f"{FT} {{model}} --lora-r 4", ["--lora-r", "--method lora"]),
    (f"{FT} {{model}} --method lora --output-dir {{model}}", ["--output-dir", "model's own folder"]),
    (f"{FT} {{model}} --method lora --output-dir {{llama}}", ["--output-dir", "full model checkpoint"]),
    (f"{FT} {{model}} --output-dir {{model}}", ["--output-dir", "model's own folder", "--overwrite"]),
    (f"{FT} {{model}} --output-dir {{foreign}}", ["--output-dir", "not empty"]),
    (f"{FT} {{model}} --train-file {{binary}}", ["--train-file", "binary"]),
    (f"{FT} {{model}} --train-file {{latin1}}", ["--train-file", "not valid UTF-8"]),
    (f"{FT} {{model}} --train-file {{text}} --dataset x", ["--train-file", "--dataset"]),
    (f"{FT} {{model}} --resume --output-dir {{root}}/no_run", ["--resume", "does not exist"]),
    (f"{FT} {{model}} --dataset {{root}}/no_dataset", ["--dataset", "no such file or directory"]),
    (f"{FT} {{model}} --report-to nowhere", ["--report-to", "nowhere", "tensorboard"]),
    (
        f"{FT} {{fp16}} --dtype float16 --projection update --train-file {{text}} --block-size 32 --output-dir {{root}}/ft16",
        ["--projection update", "fp32", "float16"],
    ),
    (
        f"{FT} {{model}} --method lora --lora-targets nonexistent_proj --train-file {{text}} --block-size 32 "
        f"--eval-blocks 1 --output-dir {{root}}/ftlora",
        ["--lora-targets"],
    ),
    (f"{FT} {{model}} --train-file {{text}} --block-size 100000 --output-dir {{root}}/ftbig", ["--block-size"]),
    # --- convert ---
    (f"{CV} ./missing_src {{root}}/out1", ["SRC", "no such file or directory"]),
    (f"{CV} {{no_config}} {{root}}/out2", ["SRC", "no config.json"]),
    (f"{CV} {{llama}} {{a_file}}", ["OUT", "not a directory"]),
    (f"{CV} {{llama}} {{foreign}}", ["OUT", "not empty"]),
    (f"{CV} {{llama}} {{llama}}", ["OUT", "SRC's own folder"]),
    (f"{CV} {{llama}} {{root}}/o --slice 1.0", ["--slice", "[0, 1)"]),
    (f"{CV} {{llama}} {{root}}/o --slice -0.1", ["--slice", "[0, 1)"]),
    (f"{CV} {{llama}} {{root}}/o --slice nan", ["--slice", "finite"]),
    (f"{CV} {{llama}} {{root}}/o --slice 0.2", ["--slice", "--calibration"]),
    (f"{CV} {{llama}} {{root}}/o --slice 0.2 --calibration {{root}}/nope.txt", ["--calibration", "no such file"]),
    (f"{CV} {{llama}} {{root}}/o --slice 0.2 --calibration {{binary}}", ["--calibration", "binary"]),
    (f"{CV} {{llama}} {{root}}/o --slice 0.2 --calibration {{latin1}}", ["--calibration", "not valid UTF-8"]),
    (f"{CV} {{llama}} {{root}}/o --seq-len 0", ["--seq-len", ">= 2"]),
    (f"{CV} {{llama}} {{root}}/o --eval-fraction 1.0", ["--eval-fraction", "(0, 1)"]),
    (f"{CV} {{llama}} {{root}}/o --eval-fraction 0", ["--eval-fraction", "(0, 1)"]),
    (f"{CV} {{llama}} {{root}}/o --calibration-samples 0", ["--calibration-samples", ">= 1"]),
    (f"{CV} {{llama}} {{root}}/o --tolerance 0", ["--tolerance", "(0, inf)"]),
    (f"{CV} {{llama}} {{root}}/o --tolerance nan", ["--tolerance", "finite"]),
    (f"{CV} {{a_file}} {{root}}/o", ["SRC", "not a model folder"]),
    (
        f"{CV} {{llama}} {{root}}/o9 --slice 0.2 --calibration {{ids}} --seq-len 10 --eval-fraction 0.9",
        ["--eval-fraction 0.9", "no calibration sequence"],
    ),
    # --- analyze ---
    (f"{AN} ./missing_model --text {{text}}", ["MODEL_OR_DIR", "no such file or directory"]),
    (f"{AN} {{model}} --text {{root}}/none.txt", ["--text", "no such file or directory"]),
    (f"{AN} {{model}} --text {{binary}}", ["--text", "binary"]),
    (f"{AN} {{model}} --text {{latin1}}", ["--text", "not valid UTF-8"]),
    (f"{AN} {{model}} --text {{empty}}", ["--text", "empty"]),
    (f"{AN} {{model}} --text {{text}} --calibration-fraction 1.5", ["--calibration-fraction", "[0, 1)"]),
    (f"{AN} {{model}} --text {{text}} --calibration-fraction -0.1", ["--calibration-fraction", "[0, 1)"]),
    (f"{AN} {{model}} --text {{text}} --seq-len 0", ["--seq-len", ">= 2"]),
    (f"{AN} {{model}} --text {{text}} --max-tokens 0", ["--max-tokens", ">= 1"]),
    (f"{AN} {{model}} --text {{text}} --batch-size 0", ["--batch-size", ">= 1"]),
    (f"{AN} {{model}} --text {{text}} --max-tokens 10 --seq-len 256", ["--max-tokens 10", "--seq-len"]),
    (f"{AN} {{model}} --text {{text}} --sweep-values 0 nan", ["--sweep-values", "finite"]),
    (f"{AN} {{model}} --text {{text}} --group-size 0", ["--group-size", ">= 1"]),
    (f"{AN} {{model}} --text {{text}} --seed -2", ["--seed", ">= 0"]),
    (f"{AN} {{model}} --text {{text}} --out {{a_file}}", ["--out", "not a directory"]),
    (f"{AN} {{model}} --text {{text}} --sites nowhere", ["--sites", "invalid choice"]),
    # --- redundancy ---
    (f"{RD} ./missing_model", ["MODEL_OR_DIR", "no such file or directory"]),
    (f"{RD} {{no_config}}", ["MODEL_OR_DIR", "no config.json"]),
    (f"{RD} {{model}} --rank-tol -1", ["--rank-tol", "(0, 1)"]),
    (f"{RD} {{model}} --rank-tol 0", ["--rank-tol", "(0, 1)"]),
    (f"{RD} {{model}} --rank-tol nan", ["--rank-tol", "finite"]),
    (f"{RD} {{model}} --png {{a_dir}}", ["--png", "is a directory"]),
    (f"{RD} {{model}} --json {{a_dir}}", ["--json", "is a directory"]),
    (f"{RD} {{model}} --heatmap-dir {{a_file}}", ["--heatmap-dir", "not a directory"]),
    (f"{RD} {{model}} --meta --heatmap-dir {{root}}/h", ["--heatmap-dir", "--meta"]),
    # --- push ---
    (f"{PU} {{root}}/missing_ckpt user/repo", ["checkpoint_dir", "no such file or directory"]),
    (f"{PU} {{a_file}} user/repo", ["checkpoint_dir", "not a directory"]),
    (f"{PU} {{model}} a/b/c", ["repo_id", "not a valid Hub repository id"]),
    (f"{PU} {{model}} -bad", ["repo_id"]),
    (f"{PU} {{model}} 'bad name'", ["repo_id", "not a valid Hub repository id"]),
    (f"{PU} {{model}} user/repo --endpoint ftp://hub", ["--endpoint", "http"]),
    (f"{PU} {{model}} user/repo --message ''", ["--message", "empty"]),
    (f"{PU} {{no_config}} user/repo", ["no_config", "config.json"]),
    (f"{PU} {{bin_only}} user/repo", ["bin_only", "safetensors"]),
    # --- dynamics ---
    (f"{DY} {{root}}/no_run", ["RUN_DIR", "no such file or directory"]),
    (f"{DY} {{no_traj}}", ["RUN_DIR", "quotient_trajectory.npz"]),
    (f"{DY} {{junk_npz}}", ["junk.npz", "not a readable trajectory file"]),
    (f"{DY} {{junk_npz}} --out {{a_file}}", ["junk.npz"]),
    # --- bench and the top level ---
    ("bench --dir ./no_benchmarks", ["--dir", "no such file or directory"]),
    (f"bench --dir {BENCHMARKS} no_such_benchmark", ["unknown benchmark", "no_such_benchmark"]),
    ("frobnicate", ["invalid choice", "frobnicate"]),
    # --- compress ---
    ("compress {model} {root}/c --remove 0", ["--remove", "(0, 1)"]),
    ("compress {model} {root}/c --remove 1", ["--remove", "(0, 1)"]),
    ("compress {model} {root}/c --remove nan", ["--remove"]),
    ("compress {model} {root}/c", ["--remove", "required"]),
    ("compress {model} {root}/c --remove 0.2 --heal-steps -1", ["--heal-steps", ">= 0"]),
    ("compress {model} {root}/c --remove 0.2 --window 1", ["--window", ">= 2"]),
    ("compress {model} {root}/c --remove 0.2 --calibration-windows 0", ["--calibration-windows", ">= 1"]),
    ("compress {model} {root}/c --remove 0.2 --calibration {binary}", ["--calibration", "weights.bin"]),
    ("compress {model} {root}/c --remove 0.2 --eval {latin1}", ["--eval", "latin1.txt"]),
    ("compress {model} {root}/c --remove 0.2 --method slice --slice-fraction 0.1", ["--slice-fraction", "relational"]),
    ("compress {model} {root}/c --remove 0.2 --method slice --mlp-order greedy", ["--mlp-order", "relational"]),
    ("compress {model} {root}/c --remove 0.2 --mlp-order best", ["--mlp-order", "invalid choice"]),
    ("compress {model} {foreign} --remove 0.2", ["OUT", "not empty"]),
    ("compress {root}/missing_model {root}/c --remove 0.2", ["missing_model", "no such file or directory"]),
    ("compress {model} {root}/c --remove 0.2 --method prune", ["--method", "invalid choice"]),
    ("compress {model} {root}/c --remove 0.2 --heal-steps 1 --heal-samples 0", ["--heal-samples", ">= 1"]),
    ("compress {model} {root}/c --remove 0.2 --heal-steps 1 --heal-length 1", ["--heal-length", ">= 2"]),
    ("compress {model} {root}/c --remove 0.2 --heal-steps 1 --heal-loss mse", ["--heal-loss", "invalid choice"]),
    ("compress {model} {root}/c --remove 0.2 --heal-seed 3", ["--heal-seed", "--heal-steps"]),
    (
        "compress {model} {root}/c --remove 0.2 --heal-steps 1 --heal-text {root}/none.safetensors",
        ["--heal-text", "no such file"],
    ),
    # --- export ---
    ("export {root}/missing_model {root}/e", ["missing_model", "no such file or directory"]),
    ("export {model} {foreign}", ["foreign", "not empty"]),
    ("export {model} {root}/e --to gpt3", ["--to", "invalid choice"]),
    ("export {model} {root}/e --to gpt2", ["--to gpt2", "mlp_gated=True"]),  # a Llama-shaped model has no GPT-2 form
    ("export {model} {root}/e --tolerance -1", ["--tolerance", "(0, inf)"]),
    ("export {model} {root}/e --tolerance nan", ["--tolerance", "finite"]),
    # --- options that do not apply, sizes beyond what a run can hold ---
    (f"{T} --text-column body", ["--text-column", "only to --dataset"]),
    (f"{FT} {{model}} --text-column body", ["--text-column", "only to --dataset"]),
    (f"{FT} {{model}} --dataset-config wikitext-2-raw-v1", ["--dataset-config", "only to --dataset"]),
    (f"{T} --max-steps 1000000000000000000", ["--max-steps", "--batch-size", "training sequences"]),
    (f"{T} --max-steps 100000000000000000000000", ["--max-steps", "training sequences"]),
    (f"{FT} {{model}} --max-steps 1000000000000000000", ["--max-steps", "training sequences"]),
    (f"{CV} {{llama}} {{root}}/o --verify-layers -1", ["--verify-layers", ">= 0"]),
    (f"{DY} {{steps_only}}", ["steps_only.npz", "not a trajectory", "seconds"]),
    (f"{DY} {{steps_only}} {{junk_npz}}", ["steps_only.npz", "not a trajectory"]),
    # a zeroed head: named by the streaming converter (the default for a local folder) as by the in-memory one
    (f"{CV} {{zeroed_head}} {{root}}/zh", ["layer 1, key/value head 0", "W_K rotary pair 0 is zero"]),
    (f"{CV} {{zeroed_head}} {{root}}/zhw --no-stream", ["layer 1, key/value head 0", "W_K rotary pair 0 is zero"]),
]

# --- damaged checkpoints and files: one line naming the file, the tensor or the field, and what to do ---
CASES += [
    ("evaluate {model} --text {ids} --window 8 --json {socket}", ["--json", "a_socket", "is a socket"]),
    ("evaluate {model} --text {ids} --window 8 --json {a_dir}", ["--json", "is a directory"]),
    ("evaluate {model} --text {ids} --window 8 --json {a_file}/r.json", ["--json", "not a directory"]),
    ("redundancy {model} --png {socket}", ["--png", "is a socket"]),
    ("evaluate {llama_two} --text {ids} --window 8", ["llama_two", "config.json", "num_hidden_layers", "'two'"]),
    ("redundancy {llama_two}", ["llama_two", "config.json", "num_hidden_layers"]),
    ("redundancy {llama_two} --no-stream", ["llama_two", "config.json", "num_hidden_layers"]),
    ("convert {llama_two} {root}/cv_two", ["config.json", "num_hidden_layers"]),
    (
        "compress {llama_two} {root}/cp_two --remove 0.2 --calibration {text} --window 16",
        ["config.json", "num_hidden_layers"],
    ),
    ("evaluate {llama_wide} --text {ids} --window 8", ["llama_wide", "other shapes", "mlp", "(config: ["]),
    (
        "finetune {llama_wide} --train-file {text} --block-size 16 --eval-blocks 1 --output-dir {root}/ft_wide",
        ["llama_wide", "other shapes", "(config: ["],
    ),
    ("evaluate {llama_nan} --text {ids} --window 8", ["llama_nan", "model.layers.0.mlp.up_proj.weight", "NaN"]),
    (
        "compress {llama_nan} {root}/cp_nan --remove 0.2 --calibration {text} --window 16 --no-stream",
        ["model.layers.0.mlp.up_proj.weight", "non-finite"],
    ),
    (
        "compress {llama_nan} {root}/cp_nan2 --remove 0.2 --calibration {text} --window 16 --heal-steps 1",
        ["model.layers.0.mlp.up_proj.weight", "non-finite"],
    ),
    (
        "compress {llama_whole} {root}/cp_forged --remove 0.2 --calibration {text} --window 16 --heal-steps 1 "
        "--heal-text {forged_text}",
        ["--heal-text", "forged_text.safetensors", "settings"],
    ),
]

# --- checkpoints whose weights disagree with their config.json: every command that reads weights names the problem
# (Transformers alone would fill the missing tensors with random values and go on) ---
_BROKEN = {
    "missing": ["missing tensors", "model.layers.1.mlp.down_proj.weight"],
    "cut": ["model.safetensors", "not a readable safetensors file"],
    "more_layers": ["missing tensors", "model.layers.2."],
    "fewer_layers": ["unexpected tensors", "model.layers.1."],
}
_READERS = {
    "finetune": "finetune {ckpt} --train-file {text} --block-size 16 --eval-blocks 1 --output-dir {root}/ft_{name}",
    "evaluate": "evaluate {ckpt} --text {ids} --window 8",
    "redundancy": "redundancy {ckpt}",
    "redundancy-whole": "redundancy {ckpt} --no-stream",
    "convert": "convert {ckpt} {root}/cv_{name}",
    "convert-whole": "convert {ckpt} {root}/cvw_{name} --no-stream",
    "canonicalize": "canonicalize {ckpt} {root}/cn_{name}",
    "canonicalize-whole": "canonicalize {ckpt} {root}/cnw_{name} --no-stream",
    "analyze": "analyze {ckpt} --text {text} --seq-len 16 --max-tokens 64 --out {root}/an_{name}",
    "compress": "compress {ckpt} {root}/cp_{name} --remove 0.2 --calibration {text} --window 16",
}
for _family in ("llama", "rel"):
    for _case, _words in _BROKEN.items():
        for _command, _line in _READERS.items():
            if _family == "rel" and _command.startswith("convert"):
                continue  # convert takes standard checkpoints; a relational one is refused for that
            _name = f"{_family}_{_case}"
            CASES.append((_line.replace("{ckpt}", f"{{{_name}}}").replace("{name}", f"{_name}_{_command}"), _words))
    for _case, _words in _BROKEN.items():
        if _family == "rel":
            CASES.append((f"export {{rel_{_case}}} {{root}}/ex_{_case}", _words))


def _argv(line: str, files: dict[str, Path]) -> list[str]:
    import shlex

    return shlex.split(line.format(**{k: str(v) for k, v in files.items()}))


@pytest.mark.parametrize("line,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_a_message_naming_it(line, expected, files, capsys):
    code = cli.main(_argv(line, files))
    err = capsys.readouterr().err
    assert code == 2, f"exit status {code}; stderr: {err}"
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("relational-hf"), last
    for words in expected:
        assert words in last, f"{words!r} not in {last!r}"


def test_enough_cases():
    assert len(CASES) >= 100


def test_refusals_change_nothing(files, capsys):
    """A refused run leaves a foreign directory byte for byte as it was, and creates no output directory."""
    before = {p.name: p.read_bytes() for p in files["foreign"].iterdir()}
    assert cli.main(_argv(f"{T} --output-dir {{foreign}}", files)) == 2
    assert cli.main(_argv(f"{CV} {{llama}} {{foreign}}", files)) == 2
    assert {p.name: p.read_bytes() for p in files["foreign"].iterdir()} == before
    assert cli.main(_argv(f"{T} --block-size 0 --output-dir {{root}}/never", files)) == 2
    assert not (files["root"] / "never").exists()
    # refused after the output was claimed (the data is checked then): the new folder and its lock file are gone
    assert cli.main(_argv(f"{T} --train-file {{tiny}} --output-dir {{root}}/claimed", files)) == 2
    assert not (files["root"] / "claimed").exists() and not (files["root"] / ".claimed.relational-hf-lock").exists()


def test_dynamics_out_file_is_named(files, tmp_path, capsys):
    """With a readable trajectory, a --out that is a file is named (checked before any figure is drawn)."""
    from relational_hf.dynamics.trajectory import REQUIRED_FIELDS, TRAJECTORY_NAME

    run = tmp_path / "run"
    run.mkdir()
    arrays = {key: np.zeros(3) for key in REQUIRED_FIELDS} | {"step": np.arange(3), "raw_sketch": np.zeros((3, 4))}
    np.savez(run / TRAJECTORY_NAME, **arrays)
    assert cli.main(["dynamics", str(run), "--out", str(files["a_file"])]) == 2
    assert "--out" in capsys.readouterr().err


def test_debug_flag_shows_the_traceback(files):
    with pytest.raises(ValueError, match="--slice needs --calibration"):
        cli.main(["--debug", "convert", str(files["llama"]), str(files["root"] / "dbg"), "--slice", "0.2"])


def test_singular_head_is_named_by_the_converter():
    """A zeroed key head: the converter names layer and head instead of failing in linalg.inv or giving NaN."""
    from tiny_models import tiny_llama

    from relational_hf.convert import to_relational
    from relational_hf.convert.relational import ConversionError

    model = tiny_llama()
    d_h = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[d_h : 2 * d_h] = 0.0
    with pytest.raises(ConversionError, match=r"layer 1, key/value head 1: W_V block has rank 0"):
        to_relational(model)


def test_a_config_whose_heads_do_not_divide_the_width_is_refused_as_the_command_line_does():
    """`AutoConfig.for_model` with 3 heads over a width of 128 used to build a model (head_dim 42) that `train
    --heads 3` refuses; without an explicit head_dim both refuse now, naming the fields."""
    from transformers import AutoConfig

    from relational_hf.modeling.configuration_relational import RelationalConfigError

    with pytest.raises(RelationalConfigError, match="num_attention_heads: 3 does not divide hidden_size 128"):
        AutoConfig.for_model("relational-transformer", vocab_size=512, hidden_size=128, num_hidden_layers=2,
                             num_attention_heads=3)  # fmt: skip
    config = AutoConfig.for_model("relational-transformer", vocab_size=512, hidden_size=128, num_hidden_layers=2,
                                  num_attention_heads=3, head_dim=32)  # fmt: skip
    assert config.head_dim == 32  # an explicit head width, as Llama allows


def test_an_empty_input_is_a_clear_error(files):
    from relational_hf import RelationalForCausalLM

    model = RelationalForCausalLM.from_pretrained(files["model"])
    empty = torch.empty(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids holds no token \(shape \(1, 0\)\)"):
        model.generate(empty, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="input_ids holds no token"):
        model(input_ids=empty)


def test_the_python_api_refuses_weights_that_do_not_match_their_config(files):
    """The library's loaders (not only the commands) refuse a checkpoint that lacks a tensor, naming it."""
    from relational_hf.loading import load_model_from
    from relational_hf.shards import open_checkpoint
    from relational_hf.symmetry.report import redundancy_report_from_checkpoint

    for loader in (load_model_from, open_checkpoint, redundancy_report_from_checkpoint):
        with pytest.raises(ValueError, match=r"missing tensors \(1\): model.layers.1.mlp.down_proj.weight"):
            loader(str(files["llama_missing"]))


def test_an_error_of_several_lines_is_printed_on_one(monkeypatch, capsys):
    from relational_hf.commands import redundancy

    def fails(args):
        raise RuntimeError("first line\n  second line\n\nthird")

    monkeypatch.setattr(redundancy, "run", fails)
    assert cli.main(["redundancy", "x"]) == 2
    err = capsys.readouterr().err
    assert err == "relational-hf redundancy: error: first line; second line; third\n"


def test_world_size_without_a_launcher_is_refused_before_any_work(files, monkeypatch, capsys):
    """WORLD_SIZE=2 left in the environment without the variables a launcher sets: one line naming the variable and
    how to launch (instead of waiting for ever for a peer that never comes); with them all set, no refusal."""
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["redundancy", str(files["model"]), "--meta"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "WORLD_SIZE=2" in last and "torchrun" in last and "RANK" in last
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.main(["redundancy", str(files["model"]), "--meta"]) == 0
