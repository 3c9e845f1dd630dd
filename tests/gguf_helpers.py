"""Tiny relational models of every configuration the GGUF export takes, and a reference forward pass computed from a
GGUF file alone, by llama.cpp's conventions (tests/test_gguf_export.py, tests/test_gguf_llama_cpp.py).

The reference reads nothing of the plugin: the hyperparameters from the file's metadata, the weights from its
tensors, and computes what llama.cpp's `llama` / `deci` graphs compute: RMSNorm times the norm weight, query/key
rows rotated in adjacent pairs (2i, 2i + 1) by theta_i = pos * freq_base^(-2i / rope.dimension_count), scores
scaled by 1/sqrt(key_length), each key/value head shared by head_count / head_count_kv query heads (per layer for
`deci`), SwiGLU silu(x W_gate) * (x W_up) W_down, the head `output` or, without it, `token_embd`. `qwen3` also
RMS-normalises each query/key head times its `attn_q_norm` / `attn_k_norm` gains before the rotation, which pairs i
with i + D/2 (NEOX); `smollm3` rotates in no layer il with (il + 1) % 4 == 0. `gemma3` (src/models/gemma3.cpp):
the embedded input times sqrt(embedding_length) in f32, QK-norm and NEOX rope as qwen3, the sliding layers
(`attention.sliding_window_pattern`) masking keys at or beyond `attention.sliding_window` positions back and turning at
`rope.freq_base_swa`, the full layers' frequencies divided by a linear `rope.scaling.factor`, queries scaled by
1/sqrt(key_length) (1/sqrt(embedding_length / head_count) at 62 layers), `post_attention_norm` / `post_ffw_norm` on
the sublayers' outputs, the gated MLP gelu_tanh(x W_gate) * (x W_up) W_down, and final logit soft-capping when the
file has it. `gelu_f16=True` computes the GELU as llama.cpp's CPU backend does (`GGML_GELU_FP16`: the input rounded
to f16, the value looked up in a table of f16 results; exact outside (-10, 10)).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relational_hf.convert import gguf_runtime
from relational_hf.modeling import RelationalConfig, RelationalForCausalLM

#: marks a test that runs llama.cpp itself: skipped, naming the extra that installs it, where it cannot be imported
needs_llama_cpp = pytest.mark.skipif(
    not gguf_runtime.available(), reason=f"llama.cpp checks need the gguf extra: {gguf_runtime.INSTALL_HINT}"
)

#: the byte-level tokenizer's vocabulary (3 special tokens + 256 bytes), so that every model carries a tokenizer
VOCAB = 259

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

#: name -> config overrides: both gauges, GQA and full MHA, thin keys (QK rank below the head width, RoPE pairs
#: embedded in a wider head), biases, tied and untied heads, hand-made per-layer widths (architecture deci)
CASES = {
    "pivot-gqa-tied": dict(gauge="pivot"),
    "free-untied": dict(gauge="free", tie_word_embeddings=False),
    "pivot-thin-keys-biases-untied": dict(
        gauge="pivot", qk_rank=4, attention_bias=True, attention_output_bias=True, tie_word_embeddings=False
    ),
    "free-mha-thin-keys-6-of-8": dict(gauge="free", num_key_value_heads=4, qk_rank=6),
    "pivot-per-layer-widths": dict(
        gauge="pivot", layer_qk_ranks=[8, 4], layer_value_ranks=[8, 5], layer_intermediate_sizes=[40, 24]
    ),
}


@torch.no_grad()
def spread(model: RelationalForCausalLM) -> RelationalForCausalLM:
    """`model` with weights wide enough for clearly separated logits (x6), biases N(0, 0.2) and every gain (norms,
    QK-norms) uniform in [0.5, 1.5]: never the unit or zero gains that hide a folding mistake. In place."""
    for pname, p in model.named_parameters():
        if "bias" in pname:
            p.normal_(0.0, 0.2)
        elif p.ndim == 1:
            p.uniform_(0.5, 1.5)
        else:
            p.mul_(6.0)
    return model


def export_f32(model, path, **kwargs):
    """`export_gguf` of `model` to `path` in f32 with the byte-level tokenizer."""
    from relational_hf.convert.gguf_export import export_gguf
    from relational_hf.lm.data import byte_level_tokenizer

    return export_gguf(model, path, outtype="f32", tokenizer=byte_level_tokenizer(), **kwargs)


def assert_llama_cpp_agrees(model, path, ids: torch.Tensor, new_tokens: int, tolerance: float) -> tuple:
    """llama.cpp (f32 key/value cache) gives the GGUF file `path` the plugin's logits of `ids` to `tolerance` of their
    scale and its greedy continuation of `new_tokens` tokens (a token at a time with its cache). Returns
    (llama.cpp's logits, its greedy tokens, the difference)."""
    prompt = ids.tolist()
    with gguf_runtime.LlamaCpp(path, n_ctx=64, threads=2, f32_cache=True) as llm:
        logits = torch.from_numpy(llm.logits(prompt)).double()
        greedy = llm.greedy(prompt, new_tokens)
    reference = plugin_logits(model, ids)
    assert logits.shape == reference.shape
    difference = relative_difference(logits, reference)
    assert difference < tolerance, difference
    with torch.no_grad():
        out = model.generate(ids[None], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert greedy == out[0, len(prompt) :].tolist()
    return logits, greedy, difference


def assert_refused_in_one_line(model, field: str, tmp_path, capsys, also: str = "") -> None:
    """`model` is refused naming `field`: by `export_gguf` (GGUFExportError) and by `relational-hf export --to gguf`
    on its saved checkpoint (one line on stderr, which names `also` too, exit status non-zero), with no file written
    either way."""
    from relational_hf.commands.main import main
    from relational_hf.convert.gguf_layout import GGUFExportError

    def nothing_written():
        assert [p.name for p in tmp_path.iterdir() if p.name != "src"] == []

    with pytest.raises(GGUFExportError, match=field):
        export_f32(model, tmp_path / "out.gguf")
    nothing_written()
    model.save_pretrained(tmp_path / "src")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out.gguf"), "--to", "gguf"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and also in err[0], err
    nothing_written()


def export_padded_from_the_command(model, ids: torch.Tensor, tmp_path, capsys) -> tuple:
    """`relational-hf export SRC OUT.gguf --to gguf --outtype f32 --pad-mlp` of `model`'s checkpoint saved at
    tmp_path/src (as `assert_refused_in_one_line` leaves it; streamed, a layer at a time): the file is written with
    every layer at the widest SwiGLU width, the report names the zero units it added, and the file's own forward pass
    gives the plugin's logits of `ids` to 1e-4 of their scale. Returns (path, the file's feed_forward_length)."""
    import gguf

    from relational_hf.commands.main import main

    widths = [model.config.layer_intermediate_size(i) for i in range(model.config.num_hidden_layers)]
    path = tmp_path / "padded.gguf"
    capsys.readouterr()
    args = ["export", str(tmp_path / "src"), str(path), "--to", "gguf", "--outtype", "f32", "--pad-mlp"]
    assert main(args) == 0, capsys.readouterr().err
    units = sum(max(widths) - w for w in widths)
    assert f"padded with {units:,} zero SwiGLU units to the width {max(widths)}" in capsys.readouterr().out
    meta = fields(gguf.GGUFReader(str(path)))
    arch = meta["general.architecture"]
    assert relative_difference(reference_logits(path, ids), plugin_logits(model, ids)) < 1e-4
    return path, meta[f"{arch}.feed_forward_length"]


def tiny_case(name: str, seed: int = 0) -> RelationalForCausalLM:
    """The model of CASES[name], with weights wide enough for clearly separated logits, non-trivial biases and
    final gain, and (per-layer widths) key heads that keep different rotary pairs."""
    torch.manual_seed(seed)
    model = spread(RelationalForCausalLM(RelationalConfig(**(BASE | CASES[name]))).eval())
    for layer in model.model.layers:
        pairs = getattr(layer.self_attn, "rope_pair_index", None)
        if pairs is not None and pairs.shape[1] < model.config.qk_rank // 2:
            pairs.copy_(torch.tensor([[3, 1], [0, 2]])[:, : pairs.shape[1]])
    return model


def compressed_model() -> RelationalForCausalLM:
    """A tiny relational model compressed by `compress_model` on random weights (per-layer QK, value and SwiGLU
    widths, key heads keeping their own rotary pairs): one layer's MLP and another's attention made heavier so that
    the plan gives the two layers different widths (architecture deci)."""
    from relational_hf.jobs import compress_model

    torch.manual_seed(0)
    model = RelationalForCausalLM(RelationalConfig(**{**BASE, "intermediate_size": 64, "gauge": "free"})).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(8)
        model.model.layers[0].self_attn.o_proj.weight.mul_(8)
    calibration = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    out, _ = compress_model(model, remove=0.3, calibration=calibration, progress=False, plan_windows=2, mlp_step=8)
    return out.eval()


def fields(reader) -> dict:
    """Every metadata key of a `gguf.GGUFReader` with its value (arrays as lists)."""
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def dequantized(reader) -> dict[str, torch.Tensor]:
    """Every tensor of the file as float64 (Linear layout: rows = outputs)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        data = np.array(t.data)
        if t.tensor_type not in (T.F32, T.F16):
            data = dequantize(data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        out[t.name] = torch.from_numpy(np.asarray(data, dtype=np.float64).reshape(shape))
    return out


def gelu_tanh(x: torch.Tensor, f16: bool = False) -> torch.Tensor:
    """GELU, tanh approximation, in float64; `f16`: as llama.cpp's CPU table computes it (module docstring)."""
    if not f16:
        return torch.nn.functional.gelu(x, approximate="tanh")
    h = x.half().float()  # ggml_gelu_f32 of the f16 input, in f32 and in its order, rounded to f16
    c, a = torch.tensor(0.79788456080286535587989211986876, dtype=torch.float32), torch.tensor(0.044715)
    table = (0.5 * h * (1.0 + torch.tanh(c * h * (1.0 + a * h * h)))).half().double()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))


def reference_logits(path, ids: torch.Tensor, gelu_f16: bool = False) -> torch.Tensor:
    """Logits (T, vocab) of the token ids `ids` (T,) by llama.cpp's conventions, from the GGUF file alone (module
    docstring), in float64."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = fields(reader)
    w = dequantized(reader)
    arch = meta["general.architecture"]
    heads, kv = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    width, rot = meta[f"{arch}.attention.key_length"], meta[f"{arch}.rope.dimension_count"]
    assert meta[f"{arch}.attention.value_length"] == width == rot
    base, eps = meta[f"{arch}.rope.freq_base"], meta[f"{arch}.attention.layer_norm_rms_epsilon"]
    n = ids.shape[0]
    pos = torch.arange(n, dtype=torch.float64)
    gemma3 = arch == "gemma3"
    swa = meta.get(f"{arch}.attention.sliding_window_pattern", [False] * meta[f"{arch}.block_count"])
    window = meta.get(f"{arch}.attention.sliding_window")

    def angles(layer):  # (cos, sin) of shape (T, 1, D/2) for this layer's rotary base and scale
        theta = meta[f"{arch}.rope.freq_base_swa"] if swa[layer] else base
        scale = 1.0 if swa[layer] else 1.0 / meta.get(f"{arch}.rope.scaling.factor", 1.0)
        angle = scale * pos[:, None] * theta ** (-2 * torch.arange(rot // 2, dtype=torch.float64) / rot)
        return angle.cos()[:, None, :], angle.sin()[:, None, :]

    q_scale = 1 / width**0.5
    if gemma3 and meta[f"{arch}.block_count"] == 62:  # llama.cpp's "27B" rule
        q_scale = 1 / (meta[f"{arch}.embedding_length"] / heads) ** 0.5

    def norm(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def rotate(x, cos, sin):  # (T, heads, D): pairs (2i, 2i + 1); qwen3, gemma3 (NEOX): pairs (i, i + D/2)
        if arch in ("qwen3", "gemma3"):
            first, second = x[..., : rot // 2], x[..., rot // 2 :]
            return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def linear(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    causal = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), 1)
    behind = pos[:, None] - pos[None, :]  # query position minus key position
    x = w["token_embd.weight"][ids]
    if gemma3:
        x = x * float(np.float32(np.sqrt(np.float32(meta[f"{arch}.embedding_length"]))))
    for i in range(meta[f"{arch}.block_count"]):
        b = f"blk.{i}."
        h_kv = kv[i] if isinstance(kv, list) else kv
        mask = causal.masked_fill(behind >= window, float("-inf")) if swa[i] else causal
        h = norm(x, w[b + "attn_norm.weight"])
        q, k = linear(h, b + "attn_q").view(n, heads, width), linear(h, b + "attn_k").view(n, h_kv, width)
        if b + "attn_q_norm.weight" in w:
            q, k = norm(q, w[b + "attn_q_norm.weight"]), norm(k, w[b + "attn_k_norm.weight"])
        if not (arch == "smollm3" and (i + 1) % 4 == 0):
            cos, sin = angles(i)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k = k.repeat_interleave(heads // h_kv, dim=1)
        v = linear(h, b + "attn_v").view(n, h_kv, width).repeat_interleave(heads // h_kv, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * q_scale + mask
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, heads * width)
        o = linear(o, b + "attn_output")
        x = x + (norm(o, w[b + "post_attention_norm.weight"]) if gemma3 else o)
        h = norm(x, w[b + "ffn_norm.weight"])
        gate = linear(h, b + "ffn_gate")
        act = gelu_tanh(gate, gelu_f16) if gemma3 else torch.nn.functional.silu(gate)
        m = linear(act * linear(h, b + "ffn_up"), b + "ffn_down")
        x = x + (norm(m, w[b + "post_ffw_norm.weight"]) if gemma3 else m)
    head = w.get("output.weight", w["token_embd.weight"])
    logits = norm(x, w["output_norm.weight"]) @ head.T
    cap = meta.get(f"{arch}.final_logit_softcapping")
    return logits if not cap else cap * torch.tanh(logits / cap)


@torch.no_grad()
def plugin_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0].double()


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the logit scale max |b|."""
    return float((a - b).abs().max() / b.abs().max())
