"""One way in for every command that takes a model: a Hub id, a local checkpoint folder, or a GGUF file.

    relational-hf convert HuggingFaceTB/SmolLM2-135M-Instruct out/       # Hub id (or its local cache offline)
    relational-hf convert ./my-llama out/                                 # a save_pretrained() folder
    relational-hf convert ./gguf-folder out/ --gguf-file model.Q4_1.gguf  # a GGUF file inside a folder or Hub repo
    relational-hf convert ./model.Q4_1.gguf out/                          # or the .gguf file itself

A GGUF file goes through Transformers' GGUF loader (the ``gguf`` package), which dequantises the tensors; the
model is then rebuilt as a plain fp32 model without a ``quantization_config`` (`relational_hf.pretrained.
plain_model_from_gguf`), so it saves, converts and trains like any other checkpoint. The tokenizer comes from the
same source. Errors say what is wrong with the source itself: a local path that does not exist, a Hub id that is
not in the local cache while offline, a GGUF architecture or a model type that Transformers cannot build.

Commands check their model argument first (`check_model_argument`, before anything is loaded), then load with
`resolve_model_source` and `load_model_from` / `load_tokenizer_from` / `load_config_from`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UsageError, invalid_config_error

logger = logging.getLogger(__name__)

#: --dtype choices; "auto" keeps the dtype the checkpoint was saved in
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
#: a Hub repository id: `name` or `namespace/name`
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def looks_like_local_path(text: str) -> bool:
    """True when `text` can only be meant as a local path, not a Hub id (`name` or `namespace/name`): it exists, is
    absolute, starts with ".", "/" or "~", holds a backslash or "..", names a weights/config file (.gguf,
    .safetensors, .json, .bin, .pt), is no valid Hub id, or its first component is an existing local folder
    ("checkpoints/run1" where ./checkpoints exists)."""
    if os.path.exists(text) or os.path.isabs(text) or text.startswith((".", "/", "~")) or "\\" in text:
        return True
    if ".." in text or not _HUB_ID.match(text):
        return True
    if text.lower().endswith((".gguf", ".safetensors", ".json", ".bin", ".pt")):
        return True
    head = text.split("/", 1)[0]
    return "/" in text and os.path.isdir(head)


class ModelSourceError(UsageError):
    """A model source (Hub id, folder, GGUF file) that cannot be used, with the reason and what to pass instead."""


class ModelSourceNotFound(ModelSourceError, FileNotFoundError):
    """A local path that does not exist, or a folder without the file it needs."""


class ModelSourceOffline(ModelSourceError, ConnectionError):
    """A Hub id that is not in the local cache while the Hub cannot be reached (offline mode or no network)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. `location`: a local folder or a Hub id; `gguf_file`: a GGUF file name inside it
    (None: a Transformers checkpoint); `local`: `location` is a folder on this machine."""

    location: str
    gguf_file: str | None = None
    local: bool = True

    def __str__(self) -> str:
        if self.gguf_file is None:
            return self.location
        return str(Path(self.location) / self.gguf_file) if self.local else f"{self.location} (GGUF {self.gguf_file})"


def _gguf_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.gguf"))


def resolve_model_source(source: str | os.PathLike, gguf_file: str | None = None) -> ModelSource:
    """Decide what `source` is (a .gguf file, a checkpoint folder, a Hub id) and check that it can be loaded from
    here, raising `ModelSourceNotFound` / `ModelSourceOffline` / `ModelSourceError` with the reason otherwise."""
    text = os.fspath(source)
    if not text:
        raise ModelSourceError("the model source is empty: pass a Hub id, a checkpoint folder or a .gguf file")
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(
                f"{text} is a file, not a model folder (config.json + weights) or a .gguf file: pass its checkpoint "
                "folder, a Hub id, or a .gguf file"
            )
        if gguf_file is not None and gguf_file != path.name:
            raise ModelSourceError(f"{text} is a GGUF file already; --gguf-file {gguf_file} names a different one")
        return ModelSource(str(path.parent), path.name, local=True)
    if path.is_dir():
        found = _gguf_names(path)
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                listing = f"; GGUF files there: {', '.join(found)}" if found else "; the folder has no .gguf file"
                raise ModelSourceNotFound(f"--gguf-file {gguf_file}: no such file in {text}{listing}")
            return ModelSource(str(path), gguf_file, local=True)
        if not (path / "config.json").is_file():
            if found:
                raise ModelSourceError(
                    f"{text} has no config.json but holds GGUF file(s): pass --gguf-file NAME "
                    f"(one of {', '.join(found)}) or the .gguf path itself"
                )
            raise ModelSourceNotFound(
                f"{text} is not a model checkpoint: it has no config.json (a save_pretrained() folder is expected)"
            )
        return ModelSource(str(path), None, local=True)
    if looks_like_local_path(text):
        raise ModelSourceNotFound(f"{text}: no such file or directory (looked in {Path.cwd()})")
    return _hub_source(text, gguf_file)


def _hub_source(repo_id: str, gguf_file: str | None, wanted: str | None = None) -> ModelSource:
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ModelSourceNotFound(
            f"{repo_id}: no such local file or directory, and not a valid Hub id ({err})"
        ) from None
    wanted = wanted or gguf_file or "config.json"
    cached = try_to_load_from_cache(repo_id, wanted)
    if not isinstance(cached, str) and constants.is_offline_mode():
        raise ModelSourceOffline(
            f"{repo_id}: not a local path, and the Hub id's {wanted} is not in the local Hugging Face cache while "
            "offline mode is on (HF_HUB_OFFLINE=1): pass a local checkpoint folder or .gguf file, or download the "
            "model first with network access"
        )
    if not isinstance(cached, str):
        _probe_hub(repo_id, wanted)
    return ModelSource(repo_id, gguf_file, local=False)


#: Hub files already found reachable in this process: (endpoint, repo id, file)
_REACHED: set[tuple[str, str, str]] = set()


def _probe_hub(repo_id: str, filename: str) -> None:
    """One request for `filename` of `repo_id` on the Hub, without retries, before anything is downloaded:
    Transformers' download retries a failed connection with backoff (about 25 s for each file it asks for), so a
    machine without a network, or a mistyped local name that is also a valid Hub id, would wait about a minute for
    the same error. Raises ModelSourceOffline when the Hub cannot be reached, ModelSourceNotFound when it answers
    that the repository does not exist; any other answer (the file missing, a gated repository, a server error) is
    left to the download, which reports it."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    key = (constants.ENDPOINT, repo_id, filename)
    if key in _REACHED:
        return
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except GatedRepoError:
        pass
    except RepositoryNotFoundError:
        raise ModelSourceNotFound(
            f"{repo_id}: no such local file or directory, and no Hub repository of that name (or it is private: "
            "log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except HfHubHTTPError:
        pass
    except Exception as err:  # the transport's own errors: no name resolution, connection refused, timeout
        if not (isinstance(err, OSError) or any(k.__name__ == "TransportError" for k in type(err).__mro__)):
            raise
        raise _unreachable(repo_id, f" ({type(err).__name__}: {err})") from None
    _REACHED.add(key)


def check_model_argument(
    source: str | os.PathLike, what: str = "MODEL", *, gguf_file: str | None = None, model: bool = True
) -> str:
    """The pre-check of a command's model argument, before anything is loaded: `resolve_model_source` with its
    error prefixed by the argument's name `what` (e.g. "SRC", "--tokenizer"). With `model=False` (a tokenizer or
    another side input) a local path need only exist, and a Hub id is asked for its tokenizer_config.json once, as a
    model's config.json is. Returns `source` with ~ expanded where it is local (the Hub id
    unchanged otherwise)."""
    text = os.fspath(source)
    if not text.strip():
        raise ModelSourceError(f"{what}: empty name; pass a Hub id, a checkpoint folder or a .gguf file")
    expanded = os.path.expanduser(text)
    if not model:
        if os.path.exists(expanded):
            return expanded
        if looks_like_local_path(text):
            raise ModelSourceNotFound(f"{what} {text}: no such file or directory (and not a Hub id)")
        try:
            _hub_source(text, None, "tokenizer_config.json")  # a Hub id: one request, as for a model
        except ModelSourceError as err:
            raise type(err)(f"{what}: {err}") from None
        return text
    try:
        resolved = resolve_model_source(text, gguf_file)
    except ModelSourceError as err:
        raise type(err)(f"{what}: {err}") from None
    return expanded if resolved.local else text


def _unreachable(location: str, cause: str = "") -> ModelSourceOffline:
    """The one message for a Hub id that is neither local nor cached while the Hub cannot be reached."""
    return ModelSourceOffline(
        f"{location}: not a local path, not in the local Hugging Face cache, and the Hub cannot be reached{cause}: "
        "pass a local checkpoint folder or .gguf file, or connect and retry"
    )


def _hub_errors(source: ModelSource, err: Exception) -> Exception:
    """A clearer error for the Hub's connection failures; other errors pass unchanged."""
    text = str(err)
    if not source.local and ("couldn't connect" in text.lower() or "offline" in text.lower()):
        return _unreachable(source.location)
    if "GGUF model with architecture" in text:
        return ModelSourceError(f"{source}: {text} (Transformers' GGUF loader cannot build it)")
    if "Unrecognized configuration class" in text or "does not recognize this architecture" in text:
        model_type = _model_type(source)
        return ModelSourceError(
            f"{source}: unsupported architecture{f' {model_type!r}' if model_type else ''}: Transformers has no causal "
            "language model for it (pass --trust-remote-code if the checkpoint ships its own code)"
        )
    return err


def _check_gguf(source: ModelSource) -> None:
    """OSError naming the file unless a local GGUF source is a readable GGUF file (checked once per file version)."""
    if source.gguf_file is None or not source.local:
        return
    path = Path(source.location) / source.gguf_file
    stat = path.stat()
    _gguf_readable(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _gguf_readable(path: str, mtime_ns: int, size: int) -> bool:
    from .shards import read_gguf

    read_gguf(path)
    return True


def _model_type(source: ModelSource) -> str | None:
    if not source.local or source.gguf_file is not None:
        return None
    try:
        return json.loads((Path(source.location) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def load_config_from(source: ModelSource | str, *, trust_remote_code: bool = False):
    """Only the configuration of a model source (for counting on the meta device)."""
    from transformers import AutoConfig

    if not isinstance(source, ModelSource):
        source = resolve_model_source(source)
    try:
        _check_gguf(source)
        if source.gguf_file is not None:
            return AutoConfig.from_pretrained(source.location, gguf_file=source.gguf_file)
        return AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _hub_errors(source, err) from err
    except Exception as err:
        raise invalid_config_error(err, source.location) or err from None


def warn_beyond_context(config, lengths: dict[str, int | None], what: str = "the model") -> list[str]:
    """Warn (one line each, `logging`) for every flag in `lengths` ({flag: tokens}) longer than the context the
    model was made for (`config.max_position_embeddings`): Transformers runs such positions without a word, and a
    perplexity or a sampled text over them describes positions the model never saw. Returns the lines. A length
    past a learned position table, which the model cannot run at all, is refused instead
    (`refuse_beyond_position_table`: ValueError in one line)."""
    refuse_beyond_position_table(config, lengths, what)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 1:
        return []
    lines = [
        f"{flag} {length:,} is longer than {what}'s context (max_position_embeddings {context:,}): positions beyond "
        "it were never trained"
        for flag, length in lengths.items()
        if length is not None and length > context
    ]
    for line in lines:
        logger.warning(line)
    return lines


#: model types whose positions are a learned table (GPT-2's `wpe`): a position past its end has no row at all
LEARNED_POSITION_TYPES = ("gpt2",)


def refuse_beyond_position_table(config, lengths: dict[str, int | None], what: str = "the model") -> None:
    """ValueError in one line for the first flag in `lengths` ({flag: tokens}) longer than a learned position table
    (GPT-2 and its relational conversion, `position_encoding="learned"`): those positions have no embedding, so the
    model cannot run them at all (rotary models only warn, `warn_beyond_context`)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    learned = getattr(text_config, "position_encoding", None) == "learned" or (
        getattr(text_config, "model_type", None) in LEARNED_POSITION_TYPES
    )
    table = getattr(text_config, "max_position_embeddings", None)
    if not learned or not isinstance(table, int):
        return
    for flag, length in lengths.items():
        if length is not None and length > table:
            raise ValueError(
                f"{flag} {length:,} is longer than {what}'s learned position table ({table:,} positions): give "
                f"{flag} {table:,} or less"
            )


def from_pretrained_checked(model_class, location: str, **kwargs):
    """`model_class.from_pretrained(location, **kwargs)` that refuses, in one line naming the tensors, weights that
    do not match the model the checkpoint's config describes (Transformers would fill missing tensors with random
    values and drop extra ones, with only a table on stderr): a local safetensors file that is truncated or corrupt
    (checked from its header before anything loads), a missing tensor, a tensor the model does not have, a tensor
    of another shape. A task head that the checkpoint's own architecture lacks (loading a causal LM for sequence
    classification) may differ, as in Transformers."""
    from .shards import IGNORED_SUFFIXES, CheckpointReader, is_safetensors_checkpoint, listing

    if is_safetensors_checkpoint(location):
        CheckpointReader(location)  # OSError naming the file for a truncated or unreadable safetensors file
    try:
        model, info = model_class.from_pretrained(location, output_loading_info=True, **kwargs)
    except RuntimeError as err:
        if "size mismatch" not in str(err) and "ignore_mismatched_sizes" not in str(err):
            raise
        if is_safetensors_checkpoint(location):  # the one-line shape list the layer-by-layer readers give
            from .shards import open_checkpoint

            open_checkpoint(location, trust_remote_code=kwargs.get("trust_remote_code", False))
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), None)
        raise ValueError(
            f"{location}: the weights do not match the model its config.json describes"
            + (f": {first}" if first else " (tensors of other shapes). Was config.json edited?")
        ) from None
    prefix = getattr(model, "base_model_prefix", "") or ""
    same_architecture = type(model).__name__ in (getattr(model.config, "architectures", None) or [])

    def counts(key: str) -> bool:  # a task head of another architecture may be absent or left over
        return not key.endswith(IGNORED_SUFFIXES) and (same_architecture or key.startswith(f"{prefix}."))

    missing = sorted(k for k in info.get("missing_keys", ()) if counts(k))
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if counts(k))
    mismatched = sorted(str(item[0] if isinstance(item, tuple) else item) for item in info.get("mismatched_keys", ()))
    problems = [
        f"{label} ({len(keys)}): {listing(keys)}"
        for label, keys in (
            ("missing tensors", missing),
            ("unexpected tensors", unexpected),
            ("other shapes", mismatched),
        )
        if keys
    ]
    if problems:
        raise ValueError(
            f"{location}: the weights do not match the model its config.json describes; {'; '.join(problems)}. "
            "Was config.json edited (e.g. num_hidden_layers) or a weights file replaced or cut short?"
        )
    return model


def load_model_from(
    source: ModelSource | str,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    model_class=None,
):
    """Load a model from a `ModelSource` (or anything `resolve_model_source` accepts): a GGUF file is dequantised
    and rebuilt as a plain model, then cast to `dtype`; a checkpoint loads with `from_pretrained`, refusing weights
    that do not match its config (`from_pretrained_checked`: missing, extra or reshaped tensors, a truncated file)."""
    from transformers import AutoModelForCausalLM

    if not isinstance(source, ModelSource):
        source = resolve_model_source(source)
    model_class = model_class or AutoModelForCausalLM
    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ModelSourceError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    try:
        _check_gguf(source)
        if source.gguf_file is not None:
            from .pretrained import plain_model_from_gguf

            model = plain_model_from_gguf(source.location, source.gguf_file, model_class=model_class)
            if torch_dtype != "auto":
                model = model.to(torch_dtype)
        else:
            model = from_pretrained_checked(
                model_class, source.location, dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError) as err:
        raise _hub_errors(source, err) from err
    except Exception as err:
        raise invalid_config_error(err, source.location) or err from None
    check_finite_weights(model, source.location)
    logger.info("loaded %s from %s", type(model).__name__, source)
    return model.eval()


def check_finite_weights(model: torch.nn.Module, where: object) -> None:
    """`ValueError` naming the first weight (parameter) of `model` that holds a NaN or an
    infinity, and how many: every result computed from such weights (a perplexity, a sampled text, a compression)
    would be NaN or fail deep inside torch. Tensors on the meta device are skipped."""
    for name, tensor in model.named_parameters():
        if tensor.is_meta or not tensor.is_floating_point():
            continue
        bad = int((~torch.isfinite(tensor.detach())).sum())
        if bad:
            raise ValueError(
                f"{where}: the weight {name} holds {bad:,} non-finite value{'s' if bad > 1 else ''} (NaN or inf) of "
                f"{tensor.numel():,}; the checkpoint is damaged: use an intact copy (re-download or re-save it)"
            )


#: A text every real tokenizer encodes to some ids (`usable_tokenizer`).
_TOKENIZER_PROBE = "The quick brown fox jumps over the lazy dog."


def usable_tokenizer(tokenizer, where: object):
    """`tokenizer` itself when it encodes text to ids; ValueError naming `where` otherwise.

    For a checkpoint folder with a config but no tokenizer files, Transformers may build an empty tokenizer of the
    model's type (one entry, every text encoded to no ids) instead of failing; a command that copied it would give its
    output a tokenizer that silently encodes nothing, and one that tokenized a text with it would report no tokens."""
    name = type(tokenizer).__name__
    try:
        ids = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    except Exception as err:  # whatever a tokenizer raises, it cannot tokenize the user's text either
        raise ValueError(f"{where}: the {name} found there cannot encode text ({err})") from err
    if len(tokenizer) < 2 or not ids:
        entries = f"{len(tokenizer)} entr{'y' if len(tokenizer) == 1 else 'ies'}"
        raise ValueError(
            f"{where}: the tokenizer files are missing (Transformers built a {name} of {entries} that encodes text to "
            "no tokens)"
        )
    return tokenizer


def load_tokenizer_from(source: ModelSource | str, *, trust_remote_code: bool = False):
    """The tokenizer stored with a model source (a GGUF file's own vocabulary for GGUF sources); ValueError when
    there is none or only an empty one (`usable_tokenizer`)."""
    from transformers import AutoTokenizer

    if not isinstance(source, ModelSource):
        source = resolve_model_source(source)
    try:
        _check_gguf(source)
        if source.gguf_file is not None:
            tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _hub_errors(source, err) from err
    return usable_tokenizer(tokenizer, source.location)


__all__ = [
    "DTYPES",
    "check_finite_weights",
    "ModelSource",
    "ModelSourceError",
    "ModelSourceNotFound",
    "ModelSourceOffline",
    "check_model_argument",
    "from_pretrained_checked",
    "load_config_from",
    "load_model_from",
    "load_tokenizer_from",
    "looks_like_local_path",
    "refuse_beyond_position_table",
    "resolve_model_source",
    "warn_beyond_context",
    "usable_tokenizer",
]
