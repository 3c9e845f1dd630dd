"""Streaming canonicalisation (DESIGN.md 2.2): the canonical representative of a checkpoint's orbit, computed and
written one decoder layer at a time from its safetensors shards.

The model lives on the meta device (`relational_hf.shards.meta_model`); the checkpoint is cut into parts: the
embeddings, each decoder layer, and the rest (final norm, head, anything else). A part is read in float64, its
groups are rebuilt (`symmetry_groups` of the meta model with that part real) and moved by `canonicalize_groups`,
the step the in-memory `canonicalize` runs on the whole model, then written in its stored dtype and released.

Every group but the residual rotation acts inside one part (checked before anything is written: a group that
couples parts is refused with `UnsupportedModelError`). The residual rotation couples every part, but its element
is the principal gauge of the token embedding alone (eigenbasis of E^T E, DESIGN 2.2), and nothing that runs
before it in the canonical order touches another part's tensors that the embedding depends on: R is computed once
from the embedding part and each part is moved by R restricted to its own tensors. The result equals the in-memory
`canonicalize` to float rounding.

Memory is one decoder layer in float64. The embedding and the head are moved in row blocks (`ROW_BLOCK_BYTES`)
where every group of their part acts row by row (`_row_parts`: the rotation on rows and bias-free readers, the
final norm gain folded into the head; R then comes from E^T E summed block by block); otherwise (GPT-2's embedding
part: two matrices and a centring translation) the part is read whole.

Relational checkpoints in the pivot gauge are canonicalised like `canonicalize` does: each layer's full factors
move into a free-gauge layer, are canonicalised, and go back into the pivot gauge (`set_full_weights`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ..architectures import UnsupportedModelError, get_adapter
from ..modeling import RelationalConfig
from ..outputs import OutputLock, check_new_output, save_tokenizer, write_output
from ..shards import (
    CheckpointReader,
    ShardWriter,
    check_complete,
    checkpoint_names,
    is_safetensors_checkpoint,
    meta_model,
    open_checkpoint,
    parse_dtype,
    parse_size,
    trim_heap,
)
from .canonical import CanonicalizationReport, _copy_relational_layer, canonicalize_groups
from .groups import NormGain, ResidualReader, ResidualRotation, SymmetryGroup, symmetry_groups

logger = logging.getLogger(__name__)

REPORT_NAME = "canonicalization_report.json"
#: bytes (stored dtype) of the embedding / head rows moved at a time
ROW_BLOCK_BYTES = 16 * 2**20


class _Part:
    """A set of a model's persistent tensors (state_dict names, tied duplicates left out) read, moved and written
    together."""

    def __init__(self, label: str, names: list[str]) -> None:
        self.label, self.names = label, names


def _tensor_names(model: nn.Module) -> dict[str, nn.Parameter | torch.Tensor]:
    """Persistent tensors by state_dict name, each shared (tied) tensor once under its first name, as
    `save_pretrained` writes them."""
    out, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _owners(model: nn.Module, tensor: torch.Tensor) -> list[tuple[nn.Module, str, bool]]:
    """(module, attribute, is_parameter) of every place `tensor` is registered (tied weights: several)."""
    found = []
    for module in model.modules():
        found += [(module, k, True) for k, v in module.named_parameters(recurse=False) if v is tensor]
        found += [(module, k, False) for k, v in module.named_buffers(recurse=False) if v is tensor]
    return found


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    old = _tensor_names(model)[name]
    new = nn.Parameter(value, requires_grad=False) if isinstance(old, nn.Parameter) else value
    for module, attr, _is_param in _owners(model, old):
        setattr(module, attr, new)  # Module.__setattr__ replaces the registered parameter or buffer


def _load(model: nn.Module, reader: CheckpointReader, names: list[str], ckpt: dict[str, str]) -> None:
    """Read the tensors `names` of `model` from the checkpoint, floating ones in float64 (ties kept)."""
    missing = [n for n in names if n not in ckpt]
    if missing:
        raise ValueError(f"{reader.path}: tensor {missing[0]!r} is missing from the checkpoint (incomplete shards?)")
    tensors = reader.get(ckpt[n] for n in names)
    for name in names:
        t = tensors.pop(ckpt[name])
        _assign(model, name, t.double() if t.is_floating_point() else t)


def _unload(model: nn.Module, names: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
    """Put the tensors `names` back on the meta device with their full `shapes` (their memory is freed)."""
    current = _tensor_names(model)
    for name in names:
        _assign(model, name, torch.empty(shapes[name], dtype=current[name].dtype, device="meta"))


def _parts(model: nn.Module) -> list[_Part]:
    """The embeddings, each decoder layer, and the rest (final norm, head, anything else), covering every tensor."""
    adapter = get_adapter(model)
    tensors = _tensor_names(model)
    by_id = {id(t): n for n, t in tensors.items()}
    embedding = [by_id[id(s.param)] for s in adapter.embedding_slots() if id(s.param) in by_id]
    embedding = list(dict.fromkeys(embedding))
    modules = {id(m): n for n, m in model.named_modules()}
    parts = [_Part("embeddings", embedding)]
    taken = set(embedding)
    for roles in adapter.layers():
        prefix = modules[id(roles.block)] + "."
        names = [n for n in tensors if n.startswith(prefix) and n not in taken]
        taken.update(names)
        parts.append(_Part(f"layer {roles.index}", names))
    parts.append(_Part("final norm and head", [n for n in tensors if n not in taken]))
    return parts


def _slot_names(group: SymmetryGroup, by_id: dict[int, str]) -> set[str]:
    return {by_id[id(s.param)] for s in group.slots() if id(s.param) in by_id}


def _assign_groups(model: nn.Module, parts: list[_Part]) -> dict[str, int]:
    """group key -> the part it acts inside; UnsupportedModelError for a group that couples parts (other than the
    residual rotation, whose element comes from the embedding alone)."""
    groups, _ = symmetry_groups(model)
    by_id = {id(t): n for n, t in _tensor_names(model).items()}
    home = {n: i for i, part in enumerate(parts) for n in part.names}
    out = {}
    for g in groups:
        if isinstance(g, ResidualRotation):
            if not g.linear:
                raise UnsupportedModelError(f"cannot stream {g.key}: its action re-gauges the stored factors")
            continue
        where = {home[n] for n in _slot_names(g, by_id)}
        if len(where) != 1:
            labels = ", ".join(parts[i].label for i in sorted(where)) or "no stored tensor"
            raise UnsupportedModelError(
                f"cannot canonicalise {type(model).__name__} one layer at a time: group {g.key} acts on {labels} "
                "together; use the in-memory path (--no-stream)"
            )
        out[g.key] = where.pop()
    return out


def _restricted(rotation: ResidualRotation, names: set[str], by_id: dict[int, str]) -> ResidualRotation | None:
    """The residual rotation acting only on the tensors `names` (one part); None when it touches none of them."""

    def inside(slot) -> bool:
        return slot is not None and by_id.get(id(slot.param)) in names

    rows = [s for s in rotation.rows if inside(s)]
    writers = [s for s in rotation.writers if inside(s)]
    readers = []
    for rd in rotation.readers:
        maps = [(w, c) for w, c in rd.maps if inside(w)]
        if not maps:
            continue
        if len(maps) != len(rd.maps) or any(s is not None and not inside(s) for s in (rd.gain, rd.bias)):
            raise UnsupportedModelError("cannot stream the residual rotation: a norm is read from another part")
        readers.append(ResidualReader(rd.gain, rd.bias, maps, rd.offset))
    if not (rows or writers or readers):
        return None
    return ResidualRotation(rotation.d, rows, writers, readers, rotation.clusters, rotation.centring)


def _row_parts(model: nn.Module, parts: list[_Part], homes: dict[str, int]) -> set[int]:
    """Parts that can be moved in row blocks: outside the decoder layers, one matrix (embedding or head) whose rows
    every group of the part moves independently (the residual rotation on rows / readers without biases, and norm
    gains, read afresh for each block); the embedding part only when nothing moves it before the rotation, whose
    element is then computed from the stored embedding block by block."""
    groups, _ = symmetry_groups(model)
    tensors = _tensor_names(model)
    by_id = {id(t): n for n, t in tensors.items()}
    full = next((g for g in groups if isinstance(g, ResidualRotation)), None)
    kinds: dict[int, set[type]] = {}
    for g in groups:
        if g.key in homes:
            kinds.setdefault(homes[g.key], set()).add(type(g))
    out = set()
    for i, part in enumerate(parts):
        big = [n for n in part.names if tensors[n].ndim >= 2]
        if part.label.startswith("layer") or len(big) != 1:
            continue
        if not kinds.get(i, set()) <= (set() if i == 0 else {NormGain}):
            continue
        if full is not None:
            moved = _restricted(full, set(part.names), by_id)
            if moved is not None and (moved.writers or any(c is not None for r in moved.readers for _, c in r.maps)):
                continue
            if i == 0 and by_id.get(id(full.rows[0].param)) != big[0]:
                continue
        out.add(i)
    return out


@torch.no_grad()
def _write_part(writer: ShardWriter, model: nn.Module, part: _Part, dtypes: dict[str, torch.dtype]) -> None:
    tensors = _tensor_names(model)
    for name in part.names:
        t = tensors[name].detach()
        writer.add(name, t.to(dtypes[name]) if t.is_floating_point() else t)


def _write_metadata(src: Path, config, dtype: torch.dtype, stage: Path, trust_remote_code: bool) -> None:
    """config.json (dtype updated), generation_config.json, code files and the tokenizer of `src`."""
    from ..loading import load_tokenizer_from

    config = copy.deepcopy(config)
    config.dtype = str(dtype).split(".")[1]
    config.save_pretrained(stage)
    for extra in ["generation_config.json", *(p.name for p in src.glob("*.py"))]:
        if (src / extra).is_file():
            shutil.copy2(src / extra, stage / extra)
    try:
        tokenizer = load_tokenizer_from(str(src), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        logger.info("no tokenizer at %s; the canonical checkpoint has none", src)
        return
    save_tokenizer(tokenizer, stage)


def stream_canonicalize(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    trust_remote_code: bool = False,
    progress: bool = True,
    lock: OutputLock | None = None,
) -> CanonicalizationReport:
    """Write the canonical representative of the orbit of the safetensors checkpoint folder `src` (any model the
    adapters know whose groups act inside one layer, the residual rotation aside: Llama / Mistral / Qwen2 / Qwen3,
    relational checkpoints in either gauge) to `out`, one decoder layer at a time (module docstring); equal to
    `canonicalize(model).save_pretrained(out)` to float rounding. Returns the CanonicalizationReport (also written to
    out/canonicalization_report.json).

    Tensors are written in `dtype` (None: each in its stored dtype), in shards of at most `max_shard_size` named and
    indexed like `save_pretrained`, with config, generation config, code files and tokenizer beside. The output is
    written through `relational_hf.outputs.write_output` (`lock`: the caller's lock on `out`): `out` must be new or
    empty unless `overwrite` (then only the files relational-hf wrote there are replaced, in one swap, and every
    other file is kept); a failed run leaves `out` as it was."""
    from tqdm.auto import tqdm

    src, out = Path(src), Path(out)
    out_dtype = parse_dtype(dtype)
    max_shard_bytes = parse_size(max_shard_size)
    if not is_safetensors_checkpoint(src):
        raise FileNotFoundError(f"{src}: not a local checkpoint folder with config.json and safetensors weights")
    check_new_output(out, "OUT", source=src, overwrite=overwrite)
    reader, config, stored = open_checkpoint(src, trust_remote_code=trust_remote_code, check=False)  # layout on disk
    pivot = isinstance(config, RelationalConfig) and config.gauge == "pivot"
    get_adapter(stored)  # "unsupported: <class>" before anything else
    check_complete(stored, reader)
    if pivot:
        free_config = copy.deepcopy(config)
        free_config.gauge = "free"
        model = meta_model(free_config, trust_remote_code=trust_remote_code)  # where the groups act
    else:
        model = stored
    ckpt = checkpoint_names(stored, reader)
    small = [n for n, t in _tensor_names(stored).items() if t.ndim <= 1 and n in ckpt]
    resident = {n for n in small if n in _tensor_names(model)}  # gains: clusters, QK-norm pairs; kept all along
    _load(model, reader, sorted(resident), ckpt)
    parts = _parts(model)
    stored_parts = _parts(stored) if pivot else parts
    stored_shapes = {n: tuple(t.shape) for n, t in _tensor_names(stored).items()}
    homes = _assign_groups(model, parts)
    dtypes = {
        n: out_dtype or (reader.dtype(ckpt[n]) if n in ckpt else t.dtype) for n, t in _tensor_names(stored).items()
    }
    write_dtype = out_dtype or reader.dtype(ckpt[parts[0].names[0]])
    header_reserve = 4096 + 2 * sum(len(k) + 160 for k in dtypes)
    total = sum(t.numel() for t in _tensor_names(stored).values())
    shapes = {n: tuple(t.shape) for n, t in _tensor_names(model).items()}
    row_parts = _row_parts(model, parts, homes)
    first_rotation = next((g for g in symmetry_groups(model)[0] if isinstance(g, ResidualRotation)), None)
    report = CanonicalizationReport()
    principal: list = []

    def rotation() -> tuple[torch.Tensor, list]:
        if not principal:
            raise UnsupportedModelError("cannot stream the residual rotation: the embedding part does not hold it")
        return principal[0]

    def groups_of(i: int, part: _Part) -> list[SymmetryGroup]:
        """The groups acting inside part i, rebuilt on its live tensors, with the rotation restricted to them."""
        groups, _ = symmetry_groups(model)
        by_id = {id(t): n for n, t in _tensor_names(model).items()}
        chosen = [g for g in groups if homes.get(g.key) == i]
        full = next((g for g in groups if isinstance(g, ResidualRotation)), None)
        if full is not None:
            if i == 0 and not principal:
                _principal_after(chosen, full, principal, report)
            moved = _restricted(full, set(part.names), by_id)
            if moved is not None:
                chosen.append(moved)
        return chosen

    def in_rows(writer: ShardWriter, i: int, part: _Part) -> None:
        """Part i in row blocks of its one matrix (`_row_parts`); its small tensors read afresh for each block."""
        big = next(n for n in part.names if len(shapes[n]) >= 2)
        small = [n for n in part.names if n != big]
        _load(model, reader, small, ckpt)
        originals = {n: _tensor_names(model)[n].detach().clone() for n in small}

        def blocks():
            return (b.double() for b in reader.rows(ckpt[big], ROW_BLOCK_BYTES))

        if i == 0 and first_rotation is not None:
            principal.append(first_rotation.principal_gauge(blocks))
        writer.begin(big, shapes[big], dtypes[big])
        for block in blocks():
            _assign(model, big, block)
            for n in small:
                _assign(model, n, originals[n].clone())
            canonicalize_groups(groups_of(i, part), report, principal=rotation)
            writer.write(_tensor_names(model)[big].detach().to(dtypes[big]))
        _write_part(writer, model, _Part(part.label, small), dtypes)

    def write(stage: Path) -> None:
        writer = ShardWriter(stage, max_shard_bytes, header_reserve)
        for i, part in enumerate(tqdm(parts, desc="canonicalize", disable=not progress)):
            stored_part = stored_parts[i]
            layer = part.label.startswith("layer")
            if i in row_parts:
                in_rows(writer, i, part)
            else:
                if pivot and layer:
                    _load(stored, reader, stored_part.names, ckpt)
                    _copy_layer(stored, model, int(part.label.split()[1]), into_free=True)
                else:
                    _load(model, reader, part.names, ckpt)
                canonicalize_groups(groups_of(i, part), report, principal=rotation)
                if pivot and layer:
                    _copy_layer(model, stored, int(part.label.split()[1]), into_free=False, dtype=write_dtype)
                    _write_part(writer, stored, stored_part, dtypes)
                    _unload(stored, stored_part.names, stored_shapes)
                else:
                    _write_part(writer, model, part, dtypes)
            _unload(model, part.names, shapes)
            # the part's gains read again as stored: the later parts' rotation must commute with every gain in front
            # of the stream (Gemma 3's sandwich norms sit in the layers), not with gains gone to the meta device
            _load(model, reader, [n for n in part.names if n in resident], ckpt)
            trim_heap()
        writer.finish(total)
        _write_metadata(src, config, write_dtype, stage, trust_remote_code)
        (stage / REPORT_NAME).write_text(json.dumps(report_dict(report), indent=2))

    write_output(out, write, command="canonicalize", kind="full", overwrite=overwrite, lock=lock)
    logger.info("canonicalised %s into %s: %s", src, out, str(report).splitlines()[0])
    return report


def _principal_after(
    chosen: list[SymmetryGroup], full: ResidualRotation, principal: list, report: CanonicalizationReport
) -> None:
    """Compute R from the embedding part: first the groups ordered before the rotation that act on it (e.g. its
    centring translation), then the principal gauge of the embedding as they left it."""
    from .canonical import _ordered

    before = []
    for g in _ordered([*chosen, full]):
        if g is full:
            break
        before.append(g)
    canonicalize_groups(before, report)
    for g in before:
        chosen.remove(g)
    principal.append(full.principal_gauge(full.rows[0].get()))


def _copy_layer(
    src: nn.Module, dst: nn.Module, index: int, *, into_free: bool, dtype: torch.dtype = torch.float64
) -> None:
    """Layer `index` of relational `src` into relational `dst` (other gauge) through its full factors: into the
    free-gauge model in float64 (its tensors made real), or back into the stored pivot layer (in place)."""
    src_roles, dst_roles = get_adapter(src).layers()[index], get_adapter(dst).layers()[index]
    if into_free:
        dst_roles.block.to_empty(device="cpu").double()
    else:  # the pivot layer in its stored dtype, as `canonicalize` regauges into the model's own dtype
        dst_roles.block.to(dtype)
    _copy_relational_layer(src_roles, dst_roles)


def report_dict(report: CanonicalizationReport) -> dict:
    return {
        "groups": report.groups,
        "degeneracies": [
            {"group": key, "head": dg.head, "indices": list(dg.indices), "value": dg.value}
            for key, dg in report.degeneracies
        ],
    }


__all__ = ["REPORT_NAME", "report_dict", "stream_canonicalize"]
