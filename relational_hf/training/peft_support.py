"""PEFT LoRA on relational models.

In a relational model q_proj, o_proj, gate_proj and down_proj are `nn.Linear` and PEFT adapts them as usual. In the
pivot gauge k_proj, v_proj and mlp.up_proj are `GaugeFixedLinear`: they store only the free entries of their weight
W (out x in) and assemble W by scatter. PEFT has no LoRA layer for that type, so this module registers one through
PEFT's custom-module mechanism (`LoraConfig._register_custom_module`):

`GaugeFixedLoraLinear` adds the usual low-rank update to the output, x W^T + s x A^T B^T with A (r x in),
B (out x r), s = lora_alpha / r: a rank-r update dW = s B A of the *full* weight, exactly like LoRA on a Linear
(dropout, rsLoRA, several adapters, `disable_adapter` all work). Adapter checkpoints are ordinary PEFT checkpoints.

Merging. W + dW is generally not in the pivot gauge (dW moves the pivot entries). The layer's own `merge` stores
W + dW exactly by writing both the free entries and the pivot values (`GaugeFixedLinear.set_layout` with the merged
pivot values, then `set_full_weight`): PEFT's `merge_and_unload()` therefore gives the same logits, and the result
is a valid relational checkpoint whose pivot block holds the merged values instead of c I. `merge_and_unload` below
does that and then puts every merged attention / MLP module back into its canonical pivot gauge through the module's
full weights and its `set_full_weights` (which moves the partner factor, W_Q for k_proj, W_O for v_proj, W_down for
up_proj, so G_QK, G_VO and the MLP map are unchanged): same logits, pivot entries c I again.

Loading. The custom layer type is not recorded in adapter_config.json, so pass a config that registers it:
`PeftModel.from_pretrained(model, path, config=lora_config_from_pretrained(path))` (or `load_lora(model, path)`), and
`AutoPeftModelForCausalLM.from_pretrained(path, config=lora_config_from_pretrained(path))`. Without it PEFT raises
"Target module GaugeFixedLinear(...) is not supported" for adapters that target k_proj, v_proj or up_proj.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from ..architectures import get_adapter
from ..modeling import GaugeFixedLinear

#: Every linear map of a relational (or Llama-family) decoder layer, by module name.
RELATIONAL_LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class GaugeFixedLoraLinear(LoraLinear):
    """LoRA for a `GaugeFixedLinear`: y = x W^T + b + s B A x (row vectors), W the assembled full weight.

    Supports vanilla LoRA (any rank, alpha, dropout, rsLoRA, lora_bias, several adapters); LoRA variants (DoRA, ...)
    and initialisations that read the base weight (PiSSA, OLoRA, LoftQ, CorDA, EVA) are refused, since the base
    layer stores only the free entries of W.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, **kwargs: Any) -> None:
        init = config.init_lora_weights
        if not (isinstance(init, bool) or init == "gaussian"):
            raise ValueError(
                f"init_lora_weights={init!r} needs the base weight of a plain Linear; for gauge-fixed layers "
                "(k_proj, v_proj, up_proj of a pivot-gauge relational model) use True, False or 'gaussian'"
            )
        if config.fan_in_fan_out:
            raise ValueError("fan_in_fan_out=True does not apply to a GaugeFixedLinear (it is stored out x in)")
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    @property
    def lora_variants(self) -> dict:
        return {(): None}

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add dW = s B A of each adapter to the full weight W, stored exactly (free entries and pivot values)."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        base = self.get_base_layer()
        for name in adapter_names:
            if name not in self.lora_A:
                continue
            w = base.full_weight().detach()
            merged = w + self.get_delta_weight(name).to(w)
            bias = None
            if self.lora_bias[name]:
                if base.bias is None:
                    raise RuntimeError(
                        "Impossible to merge LoRA with `lora_bias=True` because the base layer has no bias."
                    )
                bias = base.bias.detach() + self.lora_B[name].bias.detach().to(base.bias) * self.scaling[name]
            if safe_merge and not (torch.isfinite(merged).all() and (bias is None or torch.isfinite(bias).all())):
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems to be broken")
            store_full_weight(base, merged)
            if bias is not None:
                with torch.no_grad():
                    base.bias.copy_(bias)
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Subtract the merged adapters' dW again (exactly as stored by `merge`)."""
        base = self.get_base_layer()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name not in self.lora_A:
                continue
            w = base.full_weight().detach()
            store_full_weight(base, w - self.get_delta_weight(name).to(w))
            if self.lora_bias[name]:
                with torch.no_grad():
                    base.bias -= self.lora_B[name].bias.detach().to(base.bias) * self.scaling[name]

    def __repr__(self) -> str:
        return "lora.GaugeFixed" + nn.Module.__repr__(self)


@torch.no_grad()
def store_full_weight(module: GaugeFixedLinear, w: torch.Tensor) -> None:
    """Make `module` compute with the full weight w (out x in) exactly, keeping its pivot positions: the pivot values
    become w's entries there (`set_layout`), the free entries w's others (`set_full_weight`)."""
    pivot_values = torch.gather(w, 1, module.fixed_index)
    module.set_layout(module.fixed_index.clone(), pivot_values)
    module.set_full_weight(w)


def register_gauge_fixed_lora(config: LoraConfig) -> LoraConfig:
    """Register `GaugeFixedLoraLinear` for `GaugeFixedLinear` targets on `config` (in place); returns it."""
    # PEFT's documented way to give LoRA a custom layer type; it has no public name yet (a leading underscore)
    config._register_custom_module({GaugeFixedLinear: GaugeFixedLoraLinear})
    return config


def relational_lora_config(
    target_modules: str | Sequence[str] | None = RELATIONAL_LORA_TARGETS, **kwargs: Any
) -> LoraConfig:
    """A `peft.LoraConfig` (task_type CAUSAL_LM unless given) that can adapt relational models in either gauge.

    target_modules defaults to every linear map of a decoder layer (`RELATIONAL_LORA_TARGETS`); other keyword
    arguments are LoraConfig's (r, lora_alpha, lora_dropout, ...)."""
    kwargs.setdefault("task_type", "CAUSAL_LM")
    if target_modules is not None and not isinstance(target_modules, str):
        target_modules = list(target_modules)
    return register_gauge_fixed_lora(LoraConfig(target_modules=target_modules, **kwargs))


def lora_config_from_pretrained(adapter_path: str | os.PathLike, **kwargs: Any) -> LoraConfig:
    """The LoraConfig saved with an adapter (local folder or Hub id), with the gauge-fixed LoRA layer registered: pass
    it as `config=` to `PeftModel.from_pretrained` or `AutoPeftModelForCausalLM.from_pretrained`."""
    return register_gauge_fixed_lora(LoraConfig.from_pretrained(str(adapter_path), **kwargs))


def load_lora(
    model: nn.Module,
    adapter_path: str | os.PathLike,
    adapter_name: str = "default",
    is_trainable: bool = False,
    **kwargs,
) -> PeftModel:
    """`PeftModel.from_pretrained(model, adapter_path)` for adapters that may target gauge-fixed layers."""
    config = lora_config_from_pretrained(adapter_path)
    return PeftModel.from_pretrained(
        model, str(adapter_path), adapter_name=adapter_name, is_trainable=is_trainable, config=config, **kwargs
    )


@torch.no_grad()
def restore_pivot_gauge(model: nn.Module, modules: Sequence[nn.Module] | None = None) -> int:
    """Move attention and MLP modules back into their canonical pivot gauge with the same function: each module is
    reloaded from its own full weights with `set_full_weights(full_weights())` (default: every module of the model
    that holds a GaugeFixedLinear). Returns the number of modules re-gauged."""
    count = 0
    for roles in get_adapter(model).layers():
        for module in (roles.attention, roles.mlp):
            if modules is not None and not any(module is m for m in modules):
                continue
            if not any(isinstance(child, GaugeFixedLinear) for child in module.children()):
                continue
            module.set_full_weights({key: w.detach().clone() for key, w in module.full_weights().items()})
            count += 1
    return count


def merge_and_unload(model: PeftModel, safe_merge: bool = False, adapter_names: list[str] | None = None) -> nn.Module:
    """`model.merge_and_unload()`, then every attention / MLP module whose gauge-fixed layer took a LoRA delta is put
    back into its canonical pivot gauge (`restore_pivot_gauge`). Returns the base model; its logits equal the adapter
    model's (to float rounding)."""
    parents = []
    for name, module in model.named_modules():
        if isinstance(module, GaugeFixedLoraLinear):
            parents.append(model.get_submodule(name.rsplit(".", 1)[0]))
    merged = model.merge_and_unload(safe_merge=safe_merge, adapter_names=adapter_names)
    if parents:
        restore_pivot_gauge(merged, parents)
    return merged


__all__ = [
    "GaugeFixedLoraLinear",
    "RELATIONAL_LORA_TARGETS",
    "load_lora",
    "lora_config_from_pretrained",
    "merge_and_unload",
    "register_gauge_fixed_lora",
    "relational_lora_config",
    "restore_pivot_gauge",
    "store_full_weight",
]
