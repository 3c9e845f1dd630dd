"""Strict loading of relational checkpoints: the checks `RelationalPreTrainedModel.from_pretrained` adds.

Relational checkpoints are written only by this project, so a checkpoint that disagrees with its config is a
mistake (an edited config.json, a replaced weights file), never a model to complete with random weights. This file
travels to the Hub with the model file (``trust_remote_code``); it imports torch, transformers and safetensors (a
dependency of transformers).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from .configuration_relational import RelationalConfig

# Task heads: absent from the checkpoint of another architecture (initialised) or unused by this one (skipped)
HEAD_NAMES = ("lm_head", "score")


def strip_prefix(key: str) -> str:
    """A state-dict key without the base model's `model.` prefix (the same key in every task class)."""
    return key[len("model.") :] if key.startswith("model.") else key


def check_checkpoint_dir(model_class: type[nn.Module], path: str) -> None:
    """Validate the safetensors weights of a local checkpoint directory against its config.json: a missing,
    unreadable or truncated weights file (OSError) or a tensor whose shape disagrees with the config (ValueError)
    is one clear error naming the file and the problem."""
    from safetensors import safe_open
    from transformers.initialization import no_init_weights

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            bin_only = any(f.endswith(".bin") for f in os.listdir(path))
            extra = " (relational checkpoints are stored as safetensors only)" if bin_only else ""
            raise OSError(f"{file}: weights file is missing{extra}")
        try:
            with safe_open(file, framework="pt") as st:
                for key in st.keys():
                    shapes[key] = tuple(st.get_slice(key).get_shape())
        except Exception as err:  # safetensors raises its own error type for truncated or corrupt files
            raise OSError(f"{file}: not a readable safetensors file, it may be truncated or corrupt ({err})") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        return  # transformers reports the missing config itself
    with torch.device("meta"), no_init_weights():
        reference = model_class(RelationalConfig.from_pretrained(path))
    expected = {strip_prefix(k): tuple(v.shape) for k, v in reference.state_dict().items()}
    owner = os.path.join(path, files[0] if len(files) == 1 else "a shard of model.safetensors")
    for key, shape in shapes.items():
        want = expected.get(strip_prefix(key))
        if want is not None and want != shape:
            raise ValueError(
                f"{owner}: tensor {key!r} has shape {list(shape)} but config.json implies "
                f"{list(want)}; the weights do not belong to this config"
            )


def raise_on_key_differences(model: nn.Module, info: dict, source, subfolder: str = "") -> None:
    """ValueError naming the missing and unexpected tensors of a load, except a task head that the checkpoint's own
    architecture does not have, and the final-norm gain of a config written before `final_norm_gain` existed (the
    gain is absent from those weights by design and starts at one: the same function)."""
    same_architecture = type(model).__name__ in (model.config.architectures or [])
    tolerated = set()
    if source is not None and any(strip_prefix(k) == "norm.weight" for k in info.get("missing_keys", ())):
        raw, _ = RelationalConfig.get_config_dict(source, subfolder=subfolder)
        if "final_norm_gain" not in raw:
            tolerated = {k for k in info["missing_keys"] if strip_prefix(k) == "norm.weight"}

    def counts(key: str) -> bool:
        return key not in tolerated and (same_architecture or key.split(".", 1)[0] not in HEAD_NAMES)

    missing = sorted(k for k in info.get("missing_keys", ()) if counts(k))
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if counts(k))
    if not missing and not unexpected:
        return

    def listing(keys: list[str]) -> str:
        shown = ", ".join(keys[:8])
        return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")

    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listing(unexpected)}")
    raise ValueError(
        f"{source}: the checkpoint does not hold exactly the tensors of the model its config.json describes; "
        + "; ".join(problems)
        + ". Relational checkpoints are written only by relational-hf: was config.json edited (e.g. "
        "num_hidden_layers) or a weights file replaced?"
    )
