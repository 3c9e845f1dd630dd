"""Where updates are read and edited: the sites of DESIGN.md section 3 and the hooks that reach them.

Residual sites are reached with PyTorch forward hooks on the modules an architecture adapter names
(`LayerRoles.block`, `.attention`, `.mlp` and their pre-norms). Value sites live inside the attention kernel, so the
model's attention implementation is switched, for the duration of a context, to `directional_attention_forward`
(registered with Transformers' `AttentionInterface` under `ATTENTION_IMPLEMENTATION`): the same eager mathematics,
softmax(q k^T * scaling + mask) v, with per-module hooks that see the weights A, the values and o_t = sum_s A_ts v_s.
Every context removes what it installed and restores the implementation exactly, also when an exception escapes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface

from ..architectures import LayerRoles, get_adapter
from ..modeling.modeling_relational import eager_attention_parts

#: Sites whose updates `decompose` measures (DESIGN.md section 3).
SITES: tuple[str, ...] = ("residual_attention", "residual_mlp", "block", "value", "value_exclude_self")
#: Sites inside the attention kernel (per head, before W_O).
VALUE_SITES: tuple[str, ...] = ("value", "value_exclude_self")
#: Sites `scale_components` edits: the measured sites plus the diagonal-removal control.
EDIT_SITES: tuple[str, ...] = (*SITES, "diagonal")
#: Name under which `directional_attention_forward` is registered with Transformers.
ATTENTION_IMPLEMENTATION = "relational_hf_directional"

#: fn(site, layer, y, z) -> replacement for y, or None to leave it. Residual sites: y, z (B, T, d); value sites:
#: (B, H, T, d_h) with z = v_t and y = o_t ("value") or c_t = o_t - A_tt v_t ("value_exclude_self").
UpdateFn = Callable[[str, int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def check_sites(sites: str | Iterable[str], allowed: Sequence[str] = SITES) -> tuple[str, ...]:
    """The requested site names as a tuple; ValueError naming the allowed values for anything else."""
    requested = (sites,) if isinstance(sites, str) else tuple(sites)
    for site in requested:
        if site not in allowed:
            raise ValueError(f"unknown site {site!r}; allowed sites: {', '.join(allowed)}")
    if not requested:
        raise ValueError(f"no site given; allowed sites: {', '.join(allowed)}")
    return requested


def select_layers(model: nn.Module, layers: Iterable[int] | None) -> list[LayerRoles]:
    """The adapter's layer roles of `model`, restricted to `layers` (indices, negative from the end; None: all).
    Raises UnsupportedModelError for a model no adapter knows and ValueError for an index out of range."""
    roles = get_adapter(model).layers()
    if layers is None:
        return roles
    chosen = []
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, int) or not -len(roles) <= index < len(roles):
            raise ValueError(f"layer index {index!r} out of range for a model with {len(roles)} layers")
        if roles[index] not in chosen:
            chosen.append(roles[index])
    return chosen


# ----------------------------------------------------------------------------------------------------------------
# Value space: the attention kernel
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class AttentionState:
    """One call of one attention module inside `directional_attention_forward`.

    weights: A (B, H, T, S); values: v_s repeated over the query heads of each key/value group (B, H, S, d_h);
    output: o_t (B, H, T, d_h). With a key/value cache the T queries are the last T of the S key positions.
    """

    weights: torch.Tensor
    values: torch.Tensor
    output: torch.Tensor

    @property
    def own_values(self) -> torch.Tensor:
        """v_t, each query token's own value (B, H, T, d_h)."""
        t = self.output.shape[-2]
        return self.values[..., self.values.shape[-2] - t :, :]

    @property
    def self_weights(self) -> torch.Tensor:
        """A_tt, the weight each query puts on its own key position (B, H, T, 1)."""
        t, s = self.weights.shape[-2], self.weights.shape[-1]
        return torch.diagonal(self.weights[..., s - t :], dim1=-2, dim2=-1).unsqueeze(-1)


#: A hook sees the state of one attention call and returns a replacement state (or None to keep it).
AttentionHook = Callable[[AttentionState], "AttentionState | None"]

_ATTENTION_HOOKS: weakref.WeakKeyDictionary[nn.Module, list[AttentionHook]] = weakref.WeakKeyDictionary()


def directional_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention o_t = sum_s A_ts v_s, A = softmax(q k^T * scaling + mask), with the hooks of `module` applied.

    query (B, H, T, r), key (B, H_kv, S, r), value (B, H_kv, S, d_h); returns (output (B, T, H, d_h), A).
    The kernel is the model's own eager attention (`modeling_relational.eager_attention_parts`: the same operations
    in the same order as Transformers' eager kernels), so without hooks the result is bit-identical.
    """
    weights, values, output = eager_attention_parts(
        query, key, value, attention_mask, scaling, dropout, module.training
    )
    state = AttentionState(weights, values, output)  # output (B, H, T, d_h)
    for hook in list(_ATTENTION_HOOKS.get(module, ())):
        state = hook(state) or state
    return state.output.transpose(1, 2).contiguous(), state.weights


def _register_attention_implementation() -> None:
    """Make `ATTENTION_IMPLEMENTATION` a valid attention implementation (eager-style additive masks); registering
    again replaces the entry with the same functions."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, directional_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, eager_mask)


@contextmanager
def attention_hooks(model: nn.Module, hooks: Iterable[tuple[nn.Module, AttentionHook]]) -> Iterator[None]:
    """Run the attention of `model` through `directional_attention_forward` with `hooks` ((attention module, hook)
    pairs; a module's hooks run in the order given, after those of enclosing contexts).

    Every attention layer uses the eager mathematics while the context is open (layers without a hook compute the
    plain result); on exit the hooks are removed and each config's attention implementation is restored exactly.
    """
    _register_attention_implementation()
    get_adapter(model)  # a model no adapter knows is refused before anything changes
    # no public getter exists: the config property every Transformers attention layer reads to pick its kernel
    saved = model.config._attn_implementation
    installed: list[tuple[nn.Module, AttentionHook]] = []
    try:
        for module, hook in hooks:
            _ATTENTION_HOOKS.setdefault(module, []).append(hook)
            installed.append((module, hook))
        model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
        yield
    finally:
        if model.config._attn_implementation != saved:
            model.set_attn_implementation(saved)
        for module, hook in reversed(installed):  # remove our own entries only (the same hook may be nested)
            registered = _ATTENTION_HOOKS[module]
            del registered[len(registered) - 1 - registered[::-1].index(hook)]
            if not registered:
                del _ATTENTION_HOOKS[module]


def _value_site_hook(site: str, layer: int, fn: UpdateFn) -> AttentionHook:
    """The attention hook that hands a value site's (y, z) to fn and applies the y it returns."""

    def hook(state: AttentionState) -> AttentionState | None:
        own = state.own_values  # z = v_t (B, H, T, d_h)
        if site == "value":
            new = fn(site, layer, state.output, own)
            return None if new is None else AttentionState(state.weights, state.values, new)
        direct = state.self_weights * own  # d_t = A_tt v_t
        new = fn(site, layer, state.output - direct, own)  # c_t = o_t - d_t
        return None if new is None else AttentionState(state.weights, state.values, direct + new)

    return hook


# ----------------------------------------------------------------------------------------------------------------
# Residual stream: forward hooks on the adapter's roles
# ----------------------------------------------------------------------------------------------------------------


def first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a module was called with (first positional tensor, else `hidden_states=`)."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def replace_first_input(args: tuple, kwargs: dict, value: torch.Tensor) -> tuple[tuple, dict]:
    """(args, kwargs) with the hidden states replaced by `value` (see `first_input`)."""
    if args and isinstance(args[0], torch.Tensor):
        return (value, *args[1:]), kwargs
    key = (
        "hidden_states"
        if isinstance(kwargs.get("hidden_states"), torch.Tensor)
        else next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    )
    return args, {**kwargs, key: value}


def main_output(output) -> torch.Tensor:
    """The update tensor of a module output (a tensor, or the first item of a tuple such as (y, attn_weights))."""
    return output[0] if isinstance(output, (tuple, list)) else output


def replace_main_output(output, value: torch.Tensor):
    """`output` with its update tensor replaced by `value`."""
    return (value, *output[1:]) if isinstance(output, (tuple, list)) else value


def _residual_hooks(stack: ExitStack, roles: LayerRoles, sites: Sequence[str], fn: UpdateFn) -> None:
    """Install forward hooks reading (and, where fn returns a tensor, replacing) the residual updates of one layer."""
    layer = roles.index
    reference: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def pre_hook(module, args, kwargs):
            reference[name] = first_input(args, kwargs)

        return pre_hook

    def sublayer(site: str, name: str):
        def hook(module, args, output):
            new = fn(site, layer, main_output(output), reference.pop(name))
            return None if new is None else replace_main_output(output, new)

        return hook

    def block_hook(module, args, kwargs, output):
        h = reference.pop("block")
        new = fn("block", layer, main_output(output) - h, h)  # y = layer output - layer input, z = layer input
        return None if new is None else replace_main_output(output, h + new)

    # z = the residual entering the sublayer: the input of its pre-norm (the sublayer's own input without one)
    # y = what enters the stream: the sublayer's output, or that of its post-norm (sandwich norms)
    pairs = (
        ("residual_attention", roles.attention_norm or roles.attention, roles.attention_post_norm or roles.attention),
        ("residual_mlp", roles.mlp_norm or roles.mlp, roles.mlp_post_norm or roles.mlp),
    )
    for site, reader, writer in pairs:
        if site in sites:
            stack.callback(reader.register_forward_pre_hook(keep(site), with_kwargs=True).remove)
            stack.callback(writer.register_forward_hook(sublayer(site, site)).remove)
    if "block" in sites:
        stack.callback(roles.block.register_forward_pre_hook(keep("block"), with_kwargs=True).remove)
        stack.callback(roles.block.register_forward_hook(block_hook, with_kwargs=True).remove)


@contextmanager
def tap_sites(
    model: nn.Module, sites: str | Iterable[str], fn: UpdateFn, layers: Iterable[int] | None = None
) -> Iterator[None]:
    """Call fn(site, layer, y, z) on every update y with reference z at `sites` during forward passes of `model`.

    A tensor returned by fn replaces y in the forward pass (the edit); None leaves the model's computation
    untouched. Residual sites use forward hooks; value sites switch the attention kernel (see `attention_hooks`).
    Everything is removed on exit, also on error.
    """
    sites = check_sites(sites, SITES)
    chosen = select_layers(model, layers)
    with ExitStack() as stack:
        for roles in chosen:
            _residual_hooks(stack, roles, sites, fn)
        value_hooks = [
            (roles.attention, _value_site_hook(site, roles.index, fn))
            for site in sites
            if site in VALUE_SITES
            for roles in chosen
        ]
        if value_hooks:
            stack.enter_context(attention_hooks(model, value_hooks))
        yield
