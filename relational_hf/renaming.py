"""The names Transformers gives checkpoint tensors while loading them: one home for its conversion mappings.

Transformers 5 renames some tensors between a checkpoint and the model (GPT-NeoX saves its head as ``embed_out``
and loads it as ``lm_head``; some families split, fuse or stack tensors), and `save_pretrained` writes the
checkpoint's names back. The layer-by-layer readers (`relational_hf.shards`) read tensors by name, so they ask here
which checkpoint name holds each of the model's tensors.
"""

from __future__ import annotations

from torch import nn


def renamed_names(model: nn.Module, reader) -> tuple[dict[str, str], list[str]]:
    """For the checkpoint `reader` (anything with `keys()`) and the (meta-device) `model` its tensors load into:
    (state_dict name -> checkpoint name of every tensor Transformers renames one to one, e.g. "lm_head.weight" ->
    "embed_out.weight"; the checkpoint names of the tensors it converts, split, fused or stacked, which have no
    one-to-one name). Computed once per model and reader (kept on the reader)."""
    cache = reader.__dict__.setdefault("_renamed_names", {})
    if id(model) not in cache or cache[id(model)][0] is not model:  # an id may be reused by a later model
        cache[id(model)] = (model, _by_transformers(model, reader.keys()))
    return cache[id(model)][1]


def _by_transformers(model: nn.Module, keys) -> tuple[dict[str, str], list[str]]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamed: dict[str, str] = {}
    converted: list[str] = []
    if not conversions:
        return renamed, converted
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state, base = model.state_dict(keep_vars=True), getattr(model, "base_model_prefix", "") or None
    for key in keys:
        target, pattern = rename_source_key(key, renamings, converters, base, state)
        if pattern is not None:
            converted.append(key)
        elif target != key and target in state:
            renamed.setdefault(target, key)
    return renamed, converted
