"""Ready for attention backends of serving engines (vLLM's and SGLang's Transformers backends register their own
attention function and call the model with their own keyword arguments): an attention function registered through
`transformers.AttentionInterface` is what a relational model calls, once per layer, with the layer's module, its
scaling and every keyword argument given to the model's forward, from the causal LM or from the base model.

The function registered here ("recording") records what it receives and computes plain softmax attention itself
(its own code, causal where it gets no mask, as the engines' kernels are); the logits must be the eager
implementation's, for an exact conversion of a Llama and for a compressed model with per-layer QK, value and SwiGLU
widths (tests/client_models.py)."""

from __future__ import annotations

import pytest
import torch
from client_models import VOCAB, per_layer_widths, tiny_compressed, tiny_llama
from transformers import AttentionInterface, AutoModel, AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from relational_hf.convert import to_relational

NAME = "recording"
CALLS: list[dict] = []


def recording_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """softmax(q k^T * scaling + mask) v, the key/value heads shared by groups of query heads; without a mask the
    causal mask (offset by the cached positions) is applied here. Records the call."""
    CALLS.append(
        dict(
            module=module, query=tuple(query.shape), key=tuple(key.shape), value=tuple(value.shape),
            scaling=scaling, dropout=dropout, kwargs=dict(kwargs), masked=attention_mask is not None,
        )
    )  # fmt: skip
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling  # (B, H, T, S)
    t, s = scores.shape[-2:]
    low = torch.finfo(scores.dtype).min  # finite: a fully masked (padding) row stays finite, as in eager attention
    if attention_mask is not None:
        mask = attention_mask[..., :s]
        scores = scores.masked_fill(~mask, low) if mask.dtype == torch.bool else scores + mask
    else:
        assert module.is_causal
        future = torch.ones(t, s, dtype=torch.bool).triu(s - t + 1)
        scores = scores.masked_fill(future, low)
    weights = scores.softmax(-1)
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights  # (B, T, H, d_v)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An exact conversion of a tiny Llama and its compression, saved (the models load by attention name)."""
    folder = tmp_path_factory.mktemp("attention")
    exact = to_relational(tiny_llama()).eval()
    compressed = tiny_compressed(exact)
    widths = per_layer_widths(compressed)
    assert len(set(widths)) == len(widths) and any(qk != v for qk, v, _ in widths), widths
    for name, model in (("exact", exact), ("compressed", compressed)):
        model.save_pretrained(folder / name)
    return {"exact": folder / "exact", "compressed": folder / "compressed"}


@pytest.fixture
def recording():
    """The attention function registered under NAME for the test (and removed after); no mask function is
    registered for NAME unless the test does, so the model passes no mask, as for an engine's kernel."""
    AttentionInterface.register(NAME, recording_attention)
    CALLS.clear()
    yield CALLS
    AttentionInterface._global_mapping.pop(NAME, None)
    AttentionMaskInterface._global_mapping.pop(NAME, None)
    CALLS.clear()


def load(path, implementation: str, auto=AutoModelForCausalLM):
    return auto.from_pretrained(path, attn_implementation=implementation).eval()


def check_calls(calls, model, batch: int, length: int, kv_length: int, probe) -> None:
    """One call per layer, in order, each with the layer's attention module, its scaling r^-1/2 (r its QK width),
    one head width for q, k and v (the QK width where it equals the value width, else the wider of the two, zeros
    appended), dropout 0 in eval mode and the forward's extra keyword argument."""
    config = model.config
    attention = [layer.self_attn for layer in model.model.layers] if hasattr(model, "model") else None
    assert len(calls) == config.num_hidden_layers
    for i, call in enumerate(calls):
        qk, dv = config.layer_qk_rank(i), config.layer_value_rank(i)
        width = max(qk, dv)
        if attention is not None:
            assert call["module"] is attention[i]
        assert call["module"].layer_idx == i
        assert call["scaling"] == pytest.approx(qk**-0.5, rel=1e-12)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        assert call["query"] == (batch, heads, length, width)
        assert call["key"] == (batch, kv_heads, kv_length, width)
        assert call["value"] == (batch, kv_heads, kv_length, width)
        assert call["dropout"] == 0.0
        assert call["kwargs"].get("engine_probe") is probe, sorted(call["kwargs"])


@pytest.mark.parametrize("kind", ["exact", "compressed"])
def test_attention_function_gets_the_forward_kwargs_and_gives_eager_logits(checkpoints, recording, kind):
    """From the causal LM's forward: logits equal eager's (prefill and a cached decoding step), the extra keyword
    argument reaches the attention function of every layer, with the layer's scaling and shapes."""
    model, eager = load(checkpoints[kind], NAME), load(checkpoints[kind], "eager")
    assert model.config._attn_implementation == NAME
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    probe = object()  # what an engine passes through (its metadata): the very object must arrive
    with torch.no_grad():
        out = model(ids, engine_probe=probe, use_cache=True)
        ref = eager(ids, use_cache=True)
        scale = ref.logits.abs().max().item()
        assert (out.logits - ref.logits).abs().max().item() <= 1e-5 * scale
        check_calls(recording, model, 2, 9, 9, probe)
        recording.clear()
        nxt = ref.logits[:, -1:].argmax(-1)
        step = model(nxt, cache=out.cache, engine_probe=probe, use_cache=True)
        ref_step = eager(nxt, cache=ref.cache, use_cache=True)
        assert (step.logits - ref_step.logits).abs().max().item() <= 1e-5 * scale
        check_calls(recording, model, 2, 1, 10, probe)


@pytest.mark.parametrize("kind", ["exact", "compressed"])
def test_base_model_threads_kwargs_like_an_engine_calls_it(checkpoints, recording, kind):
    """As vLLM's Transformers backend calls it: the base model (AutoModel) with position ids, no cache and an extra
    keyword argument; the last hidden states equal eager's and every layer's call gets the argument."""
    model, eager = load(checkpoints[kind], NAME, AutoModel), load(checkpoints[kind], "eager", AutoModel)
    ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11)[None]
    probe = {"attention_instances": "engine metadata"}
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions, use_cache=False, engine_probe=probe).last_hidden_state
        ref = eager(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert len(recording) == model.config.num_hidden_layers
    for i, call in enumerate(recording):
        assert call["module"] is model.layers[i].self_attn
        assert call["kwargs"]["engine_probe"] is probe
        assert not call["masked"]  # no mask function registered: the kernel is causal by itself


def test_a_registered_mask_function_gets_the_padding_mask(checkpoints, recording):
    """With a mask function registered for the same name (AttentionMaskInterface), left-padded rows get their
    padding mask and give eager's logits on the real tokens, in the compressed model."""
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model, eager = load(checkpoints["compressed"], NAME), load(checkpoints["compressed"], "eager")
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        got = model(ids, attention_mask=mask, engine_probe=1).logits
        ref = eager(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert all(call["masked"] and call["kwargs"]["engine_probe"] == 1 for call in recording)
    assert len(recording) == model.config.num_hidden_layers
