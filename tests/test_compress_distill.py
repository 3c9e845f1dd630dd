"""Repair by distillation (DESIGN.md 2.2a): the next-token KL, the text the source samples itself, the healing with
the KL loss, and the `compress --heal-steps` options that drive them."""

from __future__ import annotations

import copy
import json
import re
import warnings

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from relational_hf.commands.main import main
from relational_hf.compress.distill import (
    TEACHER_TEXT_NAME,
    generate_teacher_text,
    healing_stream,
    load_teacher_text,
    model_fingerprint,
    save_teacher_text,
    teacher_text,
)
from relational_hf.convert import to_relational
from relational_hf.jobs import compress_model
from relational_hf.lm.metrics import next_token_kl, perplexity, teacher_kl
from relational_hf.training.heal import DEFAULT_HEAL_BATCH_SIZE, DEFAULT_HEAL_LR, heal

CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<assistant>"


def _llama(vocab: int = 64, layers: int = 2, seed: int = 0, init: float = 0.02) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
        initializer_range=init,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _chat_tokenizer():
    from relational_hf.lm.data import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = CHAT
    return tokenizer


def _stored(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- the loss ----------------------------------------------------------------------------------------------------


def test_next_token_kl_is_zero_on_itself_positive_otherwise_and_respects_the_mask():
    """KL(p || p) = 0; KL(p || q) > 0 equals the closed form sum p (log p - log q); padded positions do not count;
    shapes that differ and a non-positive temperature are refused."""
    a, b = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    assert float(next_token_kl(a, a)) == pytest.approx(0.0, abs=1e-7)
    p, log_q = a.log_softmax(-1), b.log_softmax(-1)
    expected = (p.exp() * (p - log_q)).sum(-1).mean()
    torch.testing.assert_close(next_token_kl(b, a), expected)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    changed = b.clone()
    changed[1, 3:] += 100 * torch.randn(2, 11)  # what padded positions hold does not matter
    torch.testing.assert_close(next_token_kl(changed, a, mask), next_token_kl(b, a, mask))
    assert float(next_token_kl(b, a, mask)) != pytest.approx(float(next_token_kl(b, a)))
    with pytest.raises(ValueError, match="shape"):
        next_token_kl(a, a[:, :4])
    with pytest.raises(ValueError, match="temperature"):
        next_token_kl(a, b, temperature=0.0)


# ---- the teacher's own text --------------------------------------------------------------------------------------


def test_hidden_state_distance_is_zero_on_itself_scale_free_and_respects_the_mask():
    """The residual streams' relative distance: 0 for a model against itself, the same when both streams are scaled
    alike, the embedding's output left out, padded positions left out, and streams of another count or shape
    refused."""
    from relational_hf.lm.metrics import hidden_state_distance

    torch.manual_seed(0)
    teacher = [torch.randn(2, 5, 8) for _ in range(4)]
    student = [teacher[0] + 5.0] + [t + 0.1 * torch.randn_like(t) for t in teacher[1:]]
    assert hidden_state_distance(teacher, teacher).item() == 0.0
    d = hidden_state_distance(student, teacher)
    assert 0 < d.item() < 0.1
    assert hidden_state_distance([3 * s for s in student], [3 * t for t in teacher]).item() == pytest.approx(d.item())
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    wild = [s.clone() for s in student]
    for s in wild[1:]:
        s[1, 3:] += 100.0
    assert hidden_state_distance(wild, teacher, mask).item() == pytest.approx(
        hidden_state_distance(student, teacher, mask).item()
    )
    assert hidden_state_distance(wild, teacher).item() > 10 * d.item()
    with pytest.raises(ValueError, match="count"):
        hidden_state_distance(student[:3], teacher)
    with pytest.raises(ValueError, match="shape"):
        hidden_state_distance([s[:, :4] for s in student], teacher)


def test_teacher_text_is_reproducible_in_its_seed():
    """The same seed gives the same ids, another seed other ids; the settings name the source by its fingerprint;
    chat-seeded rows start with a generic prompt in the chat template."""
    tokenizer = _chat_tokenizer()
    model = _llama(vocab=len(tokenizer))
    ids, settings = teacher_text(model, tokenizer, samples=6, length=90, seed=3, batch_size=4, progress=False)
    again = generate_teacher_text(model, tokenizer, samples=6, length=90, seed=3, batch_size=4, progress=False)
    other = generate_teacher_text(model, tokenizer, samples=6, length=90, seed=4, batch_size=4, progress=False)
    assert ids.shape == (6, 90) and ids.dtype == torch.long
    assert torch.equal(ids, again) and not torch.equal(ids, other)
    assert settings["source"] == model_fingerprint(model) != model_fingerprint(_llama(vocab=len(tokenizer), seed=1))
    assert settings["chat_template"] and settings["tokens"] == 540
    assert sum("<user>" in tokenizer.decode(row[:12]) for row in ids) == 3  # chat_share 0.5 of 6 rows
    for name, value in (("samples", 0), ("length", 1), ("batch_size", 0)):
        with pytest.raises(ValueError, match=name):
            generate_teacher_text(model, tokenizer, progress=False, **{name: value})


def test_teacher_text_prompt_sets_seed_their_rows_and_are_named_in_the_settings():
    """Chat-seeded rows start from a request of the prompt set given (default: the generic prompts), never from
    another set's; the calibration sampler uses the calibration prompts, disjoint from the generic ones (the chat text
    the benchmarks evaluate on), and the settings name the set so that a cached text of another set is not reused;
    an empty or non-string prompt set is refused in one line."""
    from relational_hf.compress.calibration import sampled_calibration
    from relational_hf.compress.distill import CALIBRATION_PROMPTS, GENERIC_PROMPTS

    tokenizer = _chat_tokenizer()
    model = _llama(vocab=len(tokenizer))
    assert not set(CALIBRATION_PROMPTS) & set(GENERIC_PROMPTS)
    mine = ("Write a limerick about a cat.", "List three rivers.")
    ids, settings = teacher_text(
        model, tokenizer, samples=8, length=160, seed=2, batch_size=8, chat_share=1.0, progress=False, prompts=mine,
    )  # fmt: skip
    texts = [tokenizer.decode(row) for row in ids]
    assert all(any(f"<user>{p}</user>" in t for p in mine) for t in texts)
    assert settings["prompts"].startswith("custom-")
    _, generic = teacher_text(model, tokenizer, samples=2, length=160, seed=2, chat_share=1.0, progress=False)
    assert generic["prompts"] == "generic"
    own, own_settings = sampled_calibration(model, tokenizer, n=6, window=160, seed=2, progress=False)
    chat_rows = [tokenizer.decode(row) for row in own if "<user>" in tokenizer.decode(row[:12])]
    assert len(chat_rows) == 3 and own_settings["prompts"] == "calibration"
    assert all(any(f"<user>{p}</user>" in t for p in CALIBRATION_PROMPTS) for t in chat_rows)
    for bad in ((), "one string", ("ok", "")):
        with pytest.raises(ValueError, match="prompts"):
            generate_teacher_text(model, tokenizer, samples=2, length=40, progress=False, prompts=bad)


def test_teacher_text_follows_the_model_through_padding_and_cache():
    """With a near-deterministic model (logits x 1000: sampling is greedy decoding) every row, whatever its seed
    length in a left-padded batch, equals the model's own greedy continuation of its seed computed without padding
    or cache: the positions, the mask and the KV cache of the batched sampler are right."""
    tokenizer = _chat_tokenizer()
    model = _llama(vocab=len(tokenizer))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(1000 * model.model.embed_tokens.weight.detach().clone())
    from relational_hf.compress.distill import _chat_prompts

    length = 100
    k = max(len(p) for p in _chat_prompts(tokenizer) if len(p) < length)  # no seed is longer
    ids = generate_teacher_text(model, tokenizer, samples=4, length=length, seed=0, batch_size=4, progress=False)
    assert sum("<user>" in tokenizer.decode(row[:12]) for row in ids) == 2  # 2 chat seeds, 2 one-token seeds
    for row in ids:  # after its seed a row is greedy, so it continues any longer prefix of itself greedily
        seq = row[:k].unsqueeze(0)
        with torch.no_grad():
            while seq.shape[1] < length:
                nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
        assert torch.equal(seq[0], row)


def test_teacher_text_file_round_trip_and_refusals(tmp_path):
    """save_teacher_text / load_teacher_text give back the same ids and settings; the file gets the umask's mode
    (safetensors' own writer leaves 0o600) and leaves no temporary file; a safetensors file that is not teacher
    text, a file that is not safetensors at all, are refused with ValueError."""
    import os
    import stat

    ids = torch.randint(0, 50, (3, 9))
    settings = {"seed": 2, "samples": 3, "length": 9, "source": "abc"}
    save_teacher_text(tmp_path / "t.safetensors", ids, settings)
    back, back_settings = load_teacher_text(tmp_path / "t.safetensors")
    assert torch.equal(back, ids) and back_settings == settings
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "t.safetensors").stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]
    save_file({"input_ids": ids}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a teacher-text file"):
        load_teacher_text(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="teacher-text"):
        load_teacher_text(tmp_path / "junk.safetensors")


# ---- healing with the KL loss ------------------------------------------------------------------------------------


def test_distilling_a_model_from_itself_leaves_it_unchanged():
    """The exact relational conversion distilled from its source stays its source (KL ~ 0, same perplexity), while
    the same LoRA run with the language-model loss on the same text moves it: distillation repairs, it does not
    adapt."""
    source = tiny_model("llama", seed=0, num_key_value_heads=2, vocab_size=48).eval()
    text = generate_teacher_text(source, None, samples=8, length=24, seed=0, progress=False)
    held_out = generate_teacher_text(source, None, samples=4, length=24, seed=1, progress=False)
    student = to_relational(source).eval()
    assert teacher_kl(student, source, held_out) < 1e-6
    kw = dict(steps=12, heal_lr=1e-2, heal_batch_size=4, heal_block_size=16, progress=False)
    kd, report = heal(copy.deepcopy(student), text, loss="kd", teacher=source, **kw)
    lm, _ = heal(copy.deepcopy(student), text, loss="lm", **kw)
    assert report["loss"] == "kd"
    kl_kd, kl_lm = teacher_kl(kd, source, held_out), teacher_kl(lm, source, held_out)
    assert kl_kd < 1e-3 and kl_lm > 10 * kl_kd
    assert perplexity(kd, held_out) == pytest.approx(perplexity(source, held_out), rel=1e-2)


def test_healing_does_not_pass_on_peft_s_deprecation_notices():
    """PEFT reads a property that Transformers v5 renamed; the FutureWarning it raises is PEFT's business, and a user
    healing a model sees none of it."""
    source = tiny_model("llama", seed=0, num_key_value_heads=2, vocab_size=48).eval()
    text = generate_teacher_text(source, None, samples=4, length=24, seed=0, progress=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        heal(to_relational(source), text, steps=1, loss="kd", teacher=source, heal_block_size=16, progress=False)
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)]


def test_healing_without_progress_prints_nothing_and_still_logs_to_callbacks(capsys):
    """progress=False is quiet: no progress bar and no log lines on stdout or stderr (the Trainer prints each log
    dict when its bar is off), while a user's callback still receives the logged losses."""
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        seen: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs or {}))

    source = tiny_model("llama", seed=0, num_key_value_heads=2, vocab_size=48).eval()
    text = generate_teacher_text(source, None, samples=4, length=24, seed=0, progress=False)
    capsys.readouterr()
    heal(to_relational(source), text, steps=5, loss="kd", teacher=source, heal_block_size=16, progress=False,
         callbacks=[Logs()])  # fmt: skip
    out, err = capsys.readouterr()
    assert out == "" and "loss" not in err, (out, err)
    assert any("loss" in logs for logs in Logs.seen)


def _compressed_with_texts(source):
    """(the source compressed by 25% on 4 windows it sampled, 16 rows of its own text to heal on, 6 held-out rows)."""
    calibration = generate_teacher_text(source, None, samples=4, length=32, seed=5, progress=False)
    compressed, _ = compress_model(source, remove=0.25, calibration=calibration, progress=False, plan_windows=2)
    text = generate_teacher_text(source, None, samples=16, length=32, seed=0, progress=False)
    held_out = generate_teacher_text(source, None, samples=6, length=32, seed=1, progress=False)
    return compressed, text, held_out


def test_distillation_lowers_the_kl_to_the_source_on_held_out_teacher_text():
    """A compressed model distilled from its source on the source's own text comes closer to the source on other
    text the source wrote (another seed), keeping its compressed shapes and stored size."""
    source = _llama(layers=2, seed=2, init=0.2)  # a wide init: peaked next-token distributions to lose and regain
    compressed, text, held_out = _compressed_with_texts(source)
    before = teacher_kl(compressed, source, held_out)
    stored = _stored(compressed)
    healed, report = heal(
        compressed, text, steps=60, loss="kd", teacher=source, heal_lr=5e-3, heal_batch_size=4, heal_block_size=24,
        progress=False,
    )  # fmt: skip
    assert _stored(healed) == stored
    assert teacher_kl(healed, source, held_out) < 0.85 * before


def test_full_healing_trains_the_stored_map_entries_alone_and_keeps_the_gauge():
    """adapter="full" trains the decoder maps' stored entries themselves: the KL to the source on held-out text falls,
    the shapes, stored count and gauge layouts (pivots) stay, embeddings and norm gains are untouched, every parameter
    is trainable again afterwards, and a missing learning rate or an unknown adapter is refused in one line."""
    source = _llama(layers=2, seed=2, init=0.2)
    compressed, text, held_out = _compressed_with_texts(source)
    before_kl = teacher_kl(compressed, source, held_out)
    before = {k: v.clone() for k, v in compressed.state_dict().items()}
    with pytest.raises(ValueError, match="heal_lr.*required"):
        heal(compressed, text, steps=1, loss="kd", teacher=source, adapter="full", progress=False)
    with pytest.raises(ValueError, match="adapter.*one of"):
        heal(compressed, text, steps=1, loss="kd", teacher=source, adapter="dora", heal_lr=1e-3, progress=False)
    healed, report = heal(
        compressed, text, steps=60, loss="kd", teacher=source, heal_lr=2e-3, heal_batch_size=4, heal_block_size=24,
        adapter="full", progress=False,
    )  # fmt: skip
    after = healed.state_dict()
    assert report["adapter"] == "full" and report["lora_rank"] is None
    assert after.keys() == before.keys() and all(after[k].shape == before[k].shape for k in before)
    changed = {k for k in before if not torch.equal(after[k], before[k])}
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj") for k in changed), sorted(changed)  # fmt: skip
    assert not any(k.endswith("pivots") for k in changed)
    assert report["trainable_parameters"] == sum(before[k].numel() for k in before if k.endswith("proj.weight"))
    assert all(p.requires_grad for p in healed.parameters())
    assert teacher_kl(healed, source, held_out) < 0.85 * before_kl


def test_full_healing_of_a_family_with_biases_trains_the_maps_biases_and_keeps_the_rest():
    """On a Qwen2 source (q/k/v biases) adapter="full" trains each map's stored entries, its bias included, and
    nothing else (embeddings and norm gains untouched), keeps every shape, and brings the compressed model nearer
    the source on held-out text."""
    source = tiny_model("qwen2", seed=2, num_key_value_heads=2, hidden_size=48, intermediate_size=96,
                        initializer_range=0.2, vocab_size=64).eval()  # fmt: skip
    compressed, text, held_out = _compressed_with_texts(source)
    before_kl = teacher_kl(compressed, source, held_out)
    before = {k: v.clone() for k, v in compressed.state_dict().items()}
    healed, _ = heal(compressed, text, steps=40, loss="kd", teacher=source, heal_lr=2e-3, heal_batch_size=4,
                     heal_block_size=24, adapter="full", progress=False)  # fmt: skip
    after = healed.state_dict()
    assert all(after[k].shape == before[k].shape for k in before)
    changed = {k for k in before if not torch.equal(after[k], before[k])}
    assert {k for k in changed if k.endswith("bias")} == {k for k in before if k.endswith(("q_proj.bias", "k_proj.bias",
                                                                                            "v_proj.bias"))}  # fmt: skip
    assert all(k.rsplit(".", 2)[-2].endswith("_proj") for k in changed), sorted(changed)
    assert teacher_kl(healed, source, held_out) < 0.9 * before_kl


def test_distilling_the_residual_streams_brings_them_closer_to_the_source_s():
    """hidden_weight > 0 adds the residual streams' distance to the KL: the same LoRA healing with it ends nearer the
    source's streams on held-out text than without it; it is refused with the language-model loss and when negative."""
    from relational_hf.lm.metrics import hidden_state_distance

    source = _llama(layers=2, seed=2, init=0.2)
    compressed, text, held_out = _compressed_with_texts(source)

    def distance(model):
        with torch.no_grad():
            a = model(held_out, output_hidden_states=True).hidden_states
            b = source(held_out, output_hidden_states=True).hidden_states
        return hidden_state_distance(a, b).item()

    kw = dict(steps=40, loss="kd", teacher=source, heal_lr=5e-3, heal_batch_size=4, heal_block_size=24, progress=False)
    plain, _ = heal(copy.deepcopy(compressed), text, **kw)
    streams, report = heal(copy.deepcopy(compressed), text, hidden_weight=10.0, **kw)
    assert report["hidden_weight"] == 10.0
    assert distance(streams) < 0.9 * distance(plain)
    with pytest.raises(ValueError, match="hidden_weight"):
        heal(compressed, text, steps=1, loss="lm", hidden_weight=1.0, progress=False)
    with pytest.raises(ValueError, match="hidden_weight"):
        heal(compressed, text, steps=1, loss="kd", teacher=source, hidden_weight=-1.0, progress=False)


def test_compress_model_distils_by_default_and_refuses_bad_heal_options():
    """compress_model(heal_steps=N) distils from the source on text the source generates (its settings in the
    report; the held-out perplexity it starts from, that of the same compression unhealed); heal options that do not apply, an unknown loss and a teacher sharing the student's weights are
    refused with ValueError."""
    source = _llama(layers=1, seed=3)
    ids = torch.randint(0, 64, (4, 16))
    held_out = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    out, report = compress_model(
        source, remove=0.2, calibration=ids, progress=False, plan_windows=2, heal_steps=2, heal_samples=4,
        heal_length=16, heal_block_size=8, evaluation=held_out,
    )  # fmt: skip
    unhealed, _ = compress_model(source, remove=0.2, calibration=ids, progress=False, plan_windows=2)
    assert report["eval_perplexity_compressed"] == pytest.approx(perplexity(unhealed, held_out), rel=1e-5)
    assert report["eval_perplexity_compressed"] != pytest.approx(perplexity(out, held_out), rel=1e-5)  # healed
    assert report["heal"]["loss"] == "kd"
    assert report["heal"]["text"]["samples"] == 4 and report["heal"]["text"]["source"] == model_fingerprint(source)
    for kwargs, word in (
        (dict(heal_loss="mse"), "heal_loss"),
        (dict(heal_loss="lm", heal_samples=4), "heal_samples"),
        (dict(heal_data=ids, heal_length=8), "heal_length"),
    ):
        with pytest.raises(ValueError, match=word):
            compress_model(source, remove=0.2, calibration=ids, progress=False, heal_steps=1, **kwargs)
    with pytest.raises(ValueError, match="teacher"):
        heal(out, ids, steps=1, loss="kd", progress=False)
    with pytest.raises(ValueError, match="heal_lr"):
        heal(out, ids, steps=1, loss="lm", heal_lr=1.5, progress=False)
    with pytest.raises(ValueError, match="shares parameters"):
        heal(out, ids, steps=1, loss="kd", teacher=out, progress=False)
    with pytest.raises(ValueError, match="loss"):
        heal(out, ids, steps=1, loss="ce", progress=False)


# ---- the command -------------------------------------------------------------------------------------------------


def _source(tmp_path):
    from relational_hf.lm.data import byte_level_tokenizer

    src = tmp_path / "src"
    _llama(vocab=259, layers=2, seed=4).save_pretrained(src)
    byte_level_tokenizer().save_pretrained(src)
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return src, text


def _compress(src, out, text, *extra) -> int:
    return main([
        "compress", str(src), str(out), "--remove", "0.1", "--calibration", str(text), "--window", "32",
        "--calibration-windows", "4", *extra,
    ])  # fmt: skip


def test_cli_caches_the_generated_text_and_reuses_it(tmp_path, capsys):
    """`--heal-steps N` writes the text SRC generated into OUT with its settings; a second run given that file as
    --heal-text reuses it and, with the same seed, heals to the same weights; the default seed regenerates the same
    text."""
    src, text = _source(tmp_path)
    heal_flags = ["--heal-steps", "2", "--heal-samples", "4", "--heal-length", "24"]
    assert _compress(src, tmp_path / "a", text, *heal_flags) == 0, capsys.readouterr().err
    ids, settings = load_teacher_text(tmp_path / "a" / TEACHER_TEXT_NAME)
    report = json.loads((tmp_path / "a" / "compression_report.json").read_text())
    assert ids.shape == (4, 24) and report["heal"]["loss"] == "kd" and report["heal"]["text"]["seed"] == 0
    assert settings["source"] == report["heal"]["text"]["source"]
    reuse = ["--heal-steps", "2", "--heal-text", str(tmp_path / "a" / TEACHER_TEXT_NAME)]
    assert _compress(src, tmp_path / "b", text, *reuse) == 0, capsys.readouterr().err
    assert torch.equal(load_teacher_text(tmp_path / "b" / TEACHER_TEXT_NAME)[0], ids)
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in ("a", "b"))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, msg=name)
    assert _compress(src, tmp_path / "c", text, *heal_flags, "--heal-seed", "0") == 0
    assert torch.equal(load_teacher_text(tmp_path / "c" / TEACHER_TEXT_NAME)[0], ids)


def test_each_loss_heals_at_its_own_default_learning_rate_and_heal_lr_reaches_the_optimiser(tmp_path, capsys):
    """Without --heal-lr, distillation and the language-model loss train at their own defaults
    (`DEFAULT_HEAL_LR`, distillation's the smaller: the measured rate that leaves a model with nothing to repair
    where it is), written in the report; with --heal-lr the given rate is used and the healed weights differ; with
    --heal-batch-size the steps take that many blocks (the report says so) and heal to other weights. The help quotes
    the defaults the run uses."""
    assert DEFAULT_HEAL_LR["kd"] < DEFAULT_HEAL_LR["lm"]
    from relational_hf.commands.compress import CompressOptions

    fields = CompressOptions.__dataclass_fields__
    assert f"default: {DEFAULT_HEAL_BATCH_SIZE})" in fields["heal_batch_size"].metadata["help"]
    assert f"{DEFAULT_HEAL_LR['kd']:g} for kd" in fields["heal_lr"].metadata["help"]
    src, text = _source(tmp_path)
    heal_flags = ["--heal-steps", "2", "--heal-samples", "4", "--heal-length", "24"]
    runs = {
        "kd": heal_flags,
        "lm": ["--heal-steps", "2", "--heal-loss", "lm"],
        "kd_lr": [*heal_flags, "--heal-lr", "0.05"],
        "kd_batch": [*heal_flags, "--heal-batch-size", "3"],
    }
    reports = {}
    for name, flags in runs.items():
        assert _compress(src, tmp_path / name, text, *flags) == 0, capsys.readouterr().err
        reports[name] = json.loads((tmp_path / name / "compression_report.json").read_text())["heal"]
    assert reports["kd"]["learning_rate"] == DEFAULT_HEAL_LR["kd"]
    assert reports["lm"]["learning_rate"] == DEFAULT_HEAL_LR["lm"]
    assert reports["kd_lr"]["learning_rate"] == 0.05
    assert reports["kd"]["batch_size"] == DEFAULT_HEAL_BATCH_SIZE != 3 and reports["kd_batch"]["batch_size"] == 3
    kd = AutoModelForCausalLM.from_pretrained(tmp_path / "kd").state_dict()
    for other in ("kd_lr", "kd_batch"):
        b = AutoModelForCausalLM.from_pretrained(tmp_path / other).state_dict()
        assert any(not torch.allclose(kd[k], b[k]) for k in kd), other


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--heal-loss", "lm"], ["--heal-loss", "--heal-steps"]),
        (["--heal-lr", "0.001"], ["--heal-lr", "--heal-steps"]),
        (["--heal-batch-size", "4"], ["--heal-batch-size", "--heal-steps"]),
        (["--heal-steps", "1", "--heal-batch-size", "0"], ["--heal-batch-size", ">= 1"]),
        (["--heal-steps", "1", "--heal-lr", "1.5"], ["--heal-lr", "(0, 1)"]),
        (["--heal-samples", "4"], ["--heal-samples", "--heal-steps"]),
        (["--heal-steps", "1", "--heal-loss", "lm", "--heal-length", "8"], ["--heal-length", "lm"]),
        (["--heal-steps", "1", "--heal-text", "{text}", "--heal-seed", "1"], ["--heal-seed", "--heal-text"]),
        (["--heal-steps", "1", "--heal-text", "{plain}"], ["--heal-text", "not a teacher-text file"]),
        (["--heal-steps", "1", "--heal-text", "{foreign}"], ["--heal-text", "another model"]),
        (["--heal-steps", "1", "--heal-loss", "ce"], ["--heal-loss", "invalid choice"]),
        (["--heal-calibration-share", "0.5"], ["--heal-calibration-share", "--heal-steps"]),
        (["--heal-steps", "1", "--heal-calibration-share", "1.5"], ["--heal-calibration-share", "1"]),
        (["--heal-steps", "1", "--heal-loss", "lm", "--heal-calibration-share", "0.5"], ["--heal-calibration-share", "lm"]),
        (["--heal-steps", "1", "--heal-calibration-share", "1", "--heal-samples", "4"], ["--heal-samples", "share 1"]),
    ],
)
def test_cli_refuses_heal_options_that_do_not_apply(tmp_path, capsys, no_training, flags, words):
    """Each inapplicable combination is a one-line error naming the flag; OUT is not created."""
    src, text = _source(tmp_path)
    save_file({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, str(tmp_path / "plain.safetensors"))
    save_teacher_text(tmp_path / "foreign.safetensors", torch.zeros(2, 4, dtype=torch.long), {"source": "elsewhere"})
    paths = {"text": str(text), "plain": str(tmp_path / "plain.safetensors"), "foreign": str(tmp_path / "foreign.safetensors")}
    flags = [f.format(**paths) for f in flags]
    out = tmp_path / "o"
    assert _compress(src, out, text, *flags) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not out.exists()


@pytest.mark.parametrize(("n_text", "n_calib", "share"), [(96, 64, 0.5), (30, 200, 0.5), (50, 7, 0.25), (11, 40, 0.8)])
def test_healing_stream_holds_each_side_in_its_share_and_drops_nothing(n_text, n_calib, share):
    """The stream holds the calibration tokens in the asked share (to a token), every token of both sides at least
    once, and only theirs; share 0 and 1 give each side alone."""
    text = torch.randint(0, 100, (n_text,))
    calib = torch.randint(100, 200, (n_calib,)).view(1, -1)
    ids, settings = healing_stream(text, calib, share)
    assert ids.dim() == 2 and ids.shape[0] == 1
    from_calib = int((ids >= 100).sum())
    assert abs(from_calib - share * ids.numel()) <= 1
    assert ids.numel() >= n_text + n_calib
    assert torch.equal(ids[ids < 100][:n_text], text) and torch.equal(ids[ids >= 100][:n_calib], calib.view(-1))
    assert settings == {"calibration_share": share, "text_tokens": n_text, "calibration_tokens": n_calib}
    assert torch.equal(healing_stream(text, calib, 0.0)[0].view(-1), text)
    assert torch.equal(healing_stream(None, calib, 1.0)[0].view(-1), calib.view(-1))


@pytest.mark.parametrize(
    ("text", "share", "words"),
    [("ids", 1.5, "[0, 1]"), ("ids", -0.1, "[0, 1]"), ("ids", True, "[0, 1]"), (None, 0.5, "source's text"),
     ("floats", 0.5, "LongTensor")],
)  # fmt: skip
def test_healing_stream_refuses_bad_input(text, share, words):
    """A share outside [0, 1], a missing text below share 1, and ids that are not token ids are clear errors."""
    given = {"ids": torch.arange(10), "floats": torch.rand(10), None: None}[text]
    with pytest.raises(ValueError, match=re.escape(words)):
        healing_stream(given, torch.arange(8).view(1, -1), share)


def test_compress_model_refuses_a_calibration_share_with_the_lm_loss():
    """heal_calibration_share mixes text for distillation; with heal_loss="lm" it is refused before any work."""
    with pytest.raises(ValueError, match="heal_loss='kd'"):
        compress_model(
            _llama(), remove=0.1, calibration=torch.randint(0, 64, (2, 16)), heal_steps=1, heal_loss="lm",
            heal_calibration_share=0.5,
        )  # fmt: skip


def test_cli_distils_on_the_calibration_windows_in_the_share_asked(tmp_path, capsys):
    """By default half of the distillation's blocks come from the calibration windows, the report says so with each
    side's tokens, and the mix reaches the training (weights differ from the text alone); share 1 generates no text
    and writes none; a text file given to heal on is used alone unless a share is asked."""
    src, text = _source(tmp_path)
    gen = ["--heal-samples", "4", "--heal-length", "24"]
    runs = {
        "mixed": ["--heal-steps", "2", *gen],
        "alone": ["--heal-steps", "2", *gen, "--heal-calibration-share", "0"],
        "calib": ["--heal-steps", "2", "--heal-calibration-share", "1"],
        "file": ["--heal-steps", "2", "--heal-text", str(text)],
        "file_mixed": ["--heal-steps", "2", "--heal-text", str(text), "--heal-calibration-share", "0.25"],
    }
    reports, calibration = {}, {}
    for name, flags in runs.items():
        assert _compress(src, tmp_path / name, text, *flags) == 0, capsys.readouterr().err
        full = json.loads((tmp_path / name / "compression_report.json").read_text())
        reports[name], calibration[name] = full["heal"]["text"], full["calibration_windows"]
    assert reports["mixed"]["calibration_share"] == 0.5 and reports["mixed"]["seed"] == 0
    # every calibration window (the text's and those SRC sampled itself) is distillation text too
    n, t = calibration["mixed"]
    assert reports["mixed"]["text_tokens"] == 4 * 24 and reports["mixed"]["calibration_tokens"] == n * t and n > 4
    assert reports["alone"]["calibration_share"] == 0.0
    assert reports["calib"]["calibration_share"] == 1.0 and reports["calib"]["text_tokens"] == 0
    assert not (tmp_path / "calib" / TEACHER_TEXT_NAME).exists()
    assert reports["file"]["calibration_share"] == 0.0 and reports["file"]["file"] == "cal.txt"
    assert reports["file_mixed"]["calibration_share"] == 0.25
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in ("mixed", "alone"))
    assert any(not torch.allclose(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
