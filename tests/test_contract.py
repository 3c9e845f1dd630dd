"""The generic Transformers model contract on the relational classes, for the pivot, free, value-removal and
thin-keys + GQA configurations: tuple outputs, inputs_embeds, attention / hidden-state outputs, gradient
checkpointing, sdpa = eager, beam search, assisted decoding, static-cache generation, resized embeddings, Trainer
label smoothing (without the plugin: tests/test_modeling.py's trust_remote_code test), and
torch.compile(fullgraph=True). Initialisation and loading (meta device, init_weights, loading reports, device maps,
tied weights): tests/test_contract_loading.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CONTRACT_BASE as BASE
from tiny_models import CONTRACT_CONFIGS as CONFIGS
from tiny_models import CONTRACT_VOCAB as VOCAB
from transformers import Trainer, TrainingArguments

from relational_hf import RelationalConfig, RelationalForCausalLM
from relational_hf.modeling import GaugeFixedLinear


def build(name: str, seed: int = 0, **overrides) -> RelationalForCausalLM:
    torch.manual_seed(seed)
    model = RelationalForCausalLM(RelationalConfig(**{**BASE, **CONFIGS[name], **overrides}))
    with torch.no_grad():  # move away from the symmetric initialisation so that differences show
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def ids(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(CONFIGS))
def name(request) -> str:
    return request.param


def test_return_dict_false_gives_the_tuple_of_the_output_fields(name):
    model = build(name)
    x = ids()
    out = model(x, labels=x)
    tup = model(x, labels=x, return_dict=False, use_cache=False)
    assert isinstance(tup, tuple)
    torch.testing.assert_close(tup[0], out.loss, rtol=0, atol=0)
    torch.testing.assert_close(tup[1], out.logits, rtol=0, atol=0)
    base = model.model(x, return_dict=False)
    assert isinstance(base, tuple)
    torch.testing.assert_close(base[0], model.model(x).last_hidden_state, rtol=0, atol=0)


def test_inputs_embeds_equal_input_ids(name):
    model = build(name)
    x = ids()
    embeds = model.get_input_embeddings()(x)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(x).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=x, inputs_embeds=embeds)


def test_attention_and_hidden_state_outputs(name):
    model = build(name)
    model.set_attn_implementation("eager")
    x = ids(length=7)
    out = model(x, output_attentions=True, output_hidden_states=True)
    c = model.config
    assert len(out.attentions) == c.num_hidden_layers and len(out.hidden_states) == c.num_hidden_layers + 1
    for a in out.attentions:
        assert a.shape == (2, c.num_attention_heads, 7, 7)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, c.num_attention_heads, 7))  # softmax rows
        assert torch.all(a.triu(1) == 0)  # causal
    torch.testing.assert_close(out.hidden_states[0], model.get_input_embeddings()(x), rtol=0, atol=0)


def test_sdpa_equals_eager(name):
    model = build(name)
    x = ids(batch=3, length=11)
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    model.set_attn_implementation("eager")
    eager = model(x, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    sdpa = model(x, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(sdpa[keep], eager[keep], rtol=0, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(name):
    model = build(name).train()
    x = ids()
    model(input_ids=x, labels=x).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    model(input_ids=x, labels=x).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-6, msg=n)


def test_beam_search_keeps_the_best_greedy_continuation_in_its_beams(name):
    model = build(name)
    x = ids(batch=1, length=5)
    kw = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=None, do_sample=False)
    beams = model.generate(
        x, num_beams=3, num_return_sequences=3, output_scores=True, return_dict_in_generate=True, **kw
    )
    assert beams.sequences.shape == (3, 11)
    # the returned beams are ranked by their sequence score, and each score is the mean log-probability under the model
    scores = beams.sequences_scores
    assert torch.all(scores[:-1] >= scores[1:] - 1e-6)
    for seq, score in zip(beams.sequences, scores):
        logp = torch.log_softmax(model(seq[None]).logits[0, 4:-1], -1).gather(-1, seq[5:, None]).sum()
        torch.testing.assert_close(logp / 6, score, rtol=1e-4, atol=1e-4)


def test_assisted_decoding_matches_greedy(name):
    model = build(name)
    assistant = build(name, seed=3, num_hidden_layers=1)
    x = ids(batch=1, length=6)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    greedy = model.generate(x, **kw)
    assisted = model.generate(x, assistant_model=assistant, **kw)
    assert torch.equal(assisted, greedy)


def test_static_cache_generation_matches_dynamic(name):
    model = build(name)
    x = ids(batch=2, length=6)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(model.generate(x, cache_implementation="static", **kw), model.generate(x, **kw))


def test_thin_keys_are_exposed_as_the_key_width_and_sized_so_in_the_cache():
    model = build("thin_keys_gqa")
    c = model.config
    assert (c.qk_head_dim, c.v_head_dim) == (4, 8)
    out = model(ids(length=5), use_cache=True)
    layer = out.cache.layers[0]
    assert layer.keys.shape == (2, c.num_key_value_heads, 5, c.qk_head_dim)
    assert layer.values.shape == (2, c.num_key_value_heads, 5, c.v_head_dim)
    assert model._get_static_cache_init_shape() is None  # the cache sizes keys and values from the tensors


def test_resized_embeddings_accept_exactly_the_new_vocabulary(name):
    model = build(name)
    model.resize_token_embeddings(VOCAB + 10, mean_resizing=False)
    assert model.config.vocab_size == VOCAB + 10
    assert model(torch.tensor([[VOCAB + 9, 5]])).logits.shape == (1, 2, VOCAB + 10)
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 10}, outside the vocabulary \[0, {VOCAB + 10}\)"):
        model(torch.tensor([[VOCAB + 10]]))
    model.resize_token_embeddings(VOCAB - 20)
    with pytest.raises(ValueError, match=rf"token id {VOCAB - 20}, outside the vocabulary \[0, {VOCAB - 20}\)"):
        model(torch.tensor([[VOCAB - 20]]))
    x = torch.randint(3, VOCAB - 20, (1, 6))
    assert model(x, labels=x).logits.shape == (1, 6, VOCAB - 20)


def _trainer_loss(model, tmp_path, x):
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    return Trainer(model=model, args=args).compute_loss(model, {"input_ids": x, "labels": x})


def test_trainer_label_smoothing_uses_shifted_labels(name, tmp_path):
    model = build(name)
    x = ids()
    loss = _trainer_loss(model, tmp_path, x)
    logits = model(x).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1), label_smoothing=0.1)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_inference_cache_sees_edits_made_through_data():
    """Edits through `.data` bypass the version counters; every forward outside generate() sees them anyway."""
    model = build("pivot")
    x = ids()
    with torch.no_grad():
        before = model(x).logits
        model.model.layers[0].self_attn.k_proj.weight.data.mul_(3.0)
        model.model.layers[1].mlp.up_proj.weight.data.add_(0.1)
        after = model(x).logits
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, model(x).logits.detach(), rtol=0, atol=0)  # = the autograd (uncached) path


@pytest.mark.slow
def test_compiled_fullgraph_forward_and_static_cache_generation_match_eager():
    """torch.compile(fullgraph=True) (CPU inductor) of a thin-keys + GQA pivot model: the per-step logits of a
    static-cache generation equal eager generation's, and so do the tokens."""
    model = build("thin_keys_gqa", num_hidden_layers=1)
    assert model._can_compile_fullgraph
    x = ids(batch=2, length=6)
    kw = dict(
        max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    eager = model.generate(x, **kw)
    model.forward = torch.compile(model.forward, fullgraph=True)
    compiled = model.generate(x, cache_implementation="static", **kw)
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert any(isinstance(m, GaugeFixedLinear) for m in model.modules())
