"""Compression measurements: stored-parameter counts (each stored tensor once), text windows, perplexity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_llama, tiny_relational
from torch import nn

from relational_hf.compress.eval import (
    PARAMETER_KINDS,
    parameter_kind,
    perplexity_on_windows,
    shared_windows,
    stored_parameters,
    text_windows,
)
from relational_hf.params import relational_parameter_count


class CharTokenizer:
    """One token per character (code point mod 97), the call signature of a Transformers tokenizer."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [ord(c) % 97 for c in text]}


def test_counts_equal_the_sum_of_numel_for_an_untied_llama():
    model = tiny_llama()
    assert not model.config.tie_word_embeddings
    counts = stored_parameters(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert sum(counts["by_kind"].values()) == counts["total"]
    assert set(counts["by_kind"]) == set(PARAMETER_KINDS)
    v, d = model.config.vocab_size, model.config.hidden_size
    assert counts["by_kind"]["embedding"] == counts["by_kind"]["head"] == v * d
    assert len(counts["by_layer"]) == model.config.num_hidden_layers
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert counts["by_layer"] == [layer] * model.config.num_hidden_layers
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert counts["by_kind"]["norms"] == norms


def test_a_tied_head_counts_once_and_matches_the_closed_form():
    tied = tiny_relational(tie_word_embeddings=True)
    untied = tiny_relational(tie_word_embeddings=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    ct, cu = stored_parameters(tied), stored_parameters(untied)
    assert ct["by_kind"]["head"] == 0
    assert ct["total"] == relational_parameter_count(tied.config)
    assert cu["total"] == relational_parameter_count(untied.config)
    v, d = tied.config.vocab_size, tied.config.hidden_size
    assert cu["total"] - ct["total"] == v * d - (d if tied.config.final_norm_gain else 0)


def test_gauge_constants_and_index_buffers_are_not_stored_parameters():
    model = tiny_relational(gauge="pivot")
    counts = stored_parameters(model)
    assert counts["total"] == relational_parameter_count(model.config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert any(not b.is_floating_point() for b in model.buffers())  # the index buffers exist and are skipped


def test_persistent_float_buffers_count_and_non_persistent_ones_do_not():
    model = tiny_llama()
    base = stored_parameters(model)["total"]
    model.model.layers[0].register_buffer("attn_shortcut", torch.ones(5, 5))
    model.model.layers[0].register_buffer("scratch", torch.ones(7), persistent=False)
    model.model.layers[0].register_buffer("positions", torch.arange(11))
    counts = stored_parameters(model)
    assert counts["total"] == base + 25
    assert counts["by_kind"]["other"] == 25
    assert counts["by_layer"][0] == stored_parameters(tiny_llama())["by_layer"][0] + 25


def test_nonzero_counts_pruned_entries():
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[:, :3] = 0
    counts = stored_parameters(model)
    rows = model.model.layers[0].mlp.up_proj.weight.shape[0]
    assert counts["total"] - counts["nonzero"] == 3 * rows


def test_parameter_kinds_from_names():
    assert parameter_kind("model.embed_tokens.weight") == "embedding"
    assert parameter_kind("lm_head.weight") == "head"
    assert parameter_kind("model.layers.3.self_attn.k_proj.weight") == "attention_qk"
    assert parameter_kind("model.layers.3.self_attn.o_proj.weight") == "attention_vo"
    assert parameter_kind("model.layers.3.mlp.down_proj.weight") == "mlp"
    assert parameter_kind("model.layers.3.input_layernorm.weight") == "norms"
    assert parameter_kind("model.layers.3.mlp_shortcut") == "other"


def test_text_windows_are_non_overlapping_prefix_windows():
    text = "".join(f" = Title {i} = \n \n Body of document {i} with some words . \n" for i in range(40))
    tok = CharTokenizer()
    ids = tok(text)["input_ids"]
    windows = text_windows(text, tok, window=16)
    assert windows.shape == (len(ids) // 16, 16) and windows.dtype == torch.long
    assert windows.flatten().tolist() == ids[: windows.numel()]
    assert text_windows(text, tok, window=16, n=3).shape == (3, 16)


def test_text_windows_spread_evenly_over_the_text():
    """With spread, the n windows are whole windows of the text, in order, distinct, the first and the last of them
    included, and evenly spaced; asking for every window (or more) gives the prefix windows."""
    g = torch.Generator().manual_seed(0)
    text = "".join(chr(33 + int(c)) for c in torch.randint(0, 90, (2000,), generator=g))  # no repeated window
    tok = CharTokenizer()
    every = text_windows(text, tok, window=16)
    spread = text_windows(text, tok, window=16, n=5, spread=True)
    rows = [next(i for i in range(len(every)) if torch.equal(every[i], w)) for w in spread]
    assert rows[0] == 0 and rows[-1] == len(every) - 1 and rows == sorted(set(rows))
    gaps = [b - a for a, b in zip(rows, rows[1:])]
    assert max(gaps) - min(gaps) <= 1
    assert torch.equal(text_windows(text, tok, window=16, n=10**6, spread=True), every)


def test_text_windows_first_and_last_are_disjoint_whole_documents(tmp_path):
    text = "".join(f" = Title {i} = \n \n Body of document {i} . \n" for i in range(20))
    path = tmp_path / "valid.txt"
    path.write_text(text, encoding="utf-8")
    tok = CharTokenizer()
    first, last = text_windows(path, tok, window=8, split="first"), text_windows(path, tok, window=8, split="last")
    held_out = text[text.index(" = Title 18 = ") :]
    assert last.flatten().tolist() == tok(held_out)["input_ids"][: last.numel()]
    assert first.flatten().tolist() == tok(text)["input_ids"][: first.numel()]
    assert first.numel() <= len(text) - len(held_out)


def test_text_windows_reject_bad_arguments():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="split"):
        text_windows("some text\nmore", tok, window=4, split="middle")
    with pytest.raises(ValueError, match="fewer than one window"):
        text_windows("short\n", tok, window=512)
    with pytest.raises(ValueError, match="window"):
        text_windows("some text\nmore", tok, window=1)


def test_perplexity_on_windows_is_exp_mean_token_nll():
    model = tiny_llama().eval()
    windows = torch.randint(0, model.config.vocab_size, (3, 10))
    with torch.no_grad():
        logits = model(windows).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert perplexity_on_windows(model, windows, batch_size=2) == pytest.approx(math.exp(nll.item()), rel=1e-5)


def test_perplexity_of_uniform_predictions_is_the_vocabulary_size():
    class Uniform(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, **_):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 13) + self.w})()

    assert perplexity_on_windows(Uniform(), torch.randint(0, 13, (2, 9))) == pytest.approx(13.0)
    with pytest.raises(ValueError, match="LongTensor"):
        perplexity_on_windows(Uniform(), torch.zeros(2, 9))


def test_shared_windows_counts_rows_present_in_the_other_set():
    g = torch.Generator().manual_seed(0)
    calibration = torch.randint(0, 50, (6, 8), generator=g)
    fresh = torch.randint(50, 100, (3, 8), generator=g)  # ids the calibration never holds
    assert shared_windows(fresh, calibration) == 0
    assert shared_windows(calibration[:4], calibration) == 4
    mixed = torch.cat([fresh, calibration[[1, 5]], calibration[1:2]])
    assert shared_windows(mixed, calibration) == 3  # every shared row counts, repeats included
    assert shared_windows(calibration[:, :4], calibration) == 0  # other window lengths: nothing to compare
