"""Per-layer attention types of the relational transformer (`RelationalConfig.layer_types`: Gemma 3's full and
sliding-window layers), imported by `modeling_relational.py` and travelling to the Hub with it (``trust_remote_code``).
Imports only transformers and the configuration file.

Each layer type gets Transformers' own mask (`create_causal_mask`, `create_sliding_window_causal_mask`, which read
`config.sliding_window`) and its own rotary table (`sliding_rope_parameters` for the sliding layers); the cache that
`DynamicCache(config=...)` builds from `layer_types` keeps the last `sliding_window` positions of each sliding layer,
as Gemma's does. A model without `layer_types` gets the one causal mask for every layer, as before."""

from __future__ import annotations

from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.masking_utils import create_masks_for_generate as _masks_by_layer_type

from .configuration_relational import RelationalConfig


def layer_masks(config: RelationalConfig, attention_mask, **mask_kwargs) -> list:
    """The attention mask of every layer, in order. `attention_mask`: the user's (2D padding mask, a prepared 4D
    mask, or None), or the dict by layer type that `generate` prepares for a static cache
    (`create_masks_for_generate`); `mask_kwargs`: inputs_embeds, cache, position_ids."""
    if isinstance(attention_mask, dict):
        masks = attention_mask
    else:
        masks = {"full_attention": create_causal_mask(config=config, attention_mask=attention_mask, **mask_kwargs)}
        if config.sliding_window is not None:
            masks["sliding_attention"] = create_sliding_window_causal_mask(
                config=config, attention_mask=attention_mask, **mask_kwargs
            )
    layers = range(config.num_hidden_layers)
    return [masks["sliding_attention" if config.layer_sliding(i) else "full_attention"] for i in layers]


def create_masks_for_generate(config: RelationalConfig, **kwargs):
    """What `generate` prepares for a static cache: a dict of masks by layer type with `layer_types`, else the one
    causal mask (Transformers' generic function reads any `layer_types` attribute, even None, as per-layer types)."""
    if config.layer_types is not None:
        return _masks_by_layer_type(config, **kwargs)
    keys = ("inputs_embeds", "attention_mask", "cache", "position_ids", "or_mask_function", "and_mask_function")
    return create_causal_mask(config=config, block_sequence_ids=kwargs.get("block_sequence_ids"), **{
        k: kwargs.get(k) for k in keys
    })


__all__ = ["create_masks_for_generate", "layer_masks"]
