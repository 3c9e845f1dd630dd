"""llama.cpp itself, through its C library, for checking and measuring exported GGUF files.

The `gguf` extra installs `llama-cpp-python`, which pip builds from its source distribution with the machine's
compiler (once; pip caches the wheel) and which declares llama.cpp's C API with ctypes. This module is the one
place that talks to that library: load a GGUF file, tokenize and detokenize with the file's own
vocabulary, decode a sequence with the logits of every position, time prefill and decode, and quantise a file with
llama.cpp's own quantiser (`llama_model_quantize`, the code behind its `llama-quantize` tool).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from pathlib import Path

import numpy as np

INSTALL_HINT = "pip install 'relational-hf[gguf]' (builds llama-cpp-python from source once, a few minutes)"

#: llama.cpp's file types (enum llama_ftype) by the names its `llama-quantize` tool takes.
FILE_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K_S": 11,
    "Q3_K_M": 12,
    "Q3_K_L": 13,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "IQ4_NL": 25,
    "BF16": 32,
}

#: The row length (elements along a weight's input dimension) a file type's main block needs: K-quants 256,
#: the legacy and IQ4_NL blocks 32, floats 1.
BLOCK_SIZES = {name: (256 if "_K" in name else 1 if name in ("F32", "F16", "BF16") else 32) for name in FILE_TYPES}


def available() -> bool:
    """Whether llama.cpp's library can be imported (the `gguf` extra)."""
    return importlib.util.find_spec("llama_cpp") is not None


_STATE: dict = {}


def _binding():
    """llama.cpp's C API (llama_cpp.llama_cpp), its log lines routed to nowhere unless RELATIONAL_HF_LLAMA_LOG=1."""
    if not available():
        raise ImportError(f"llama.cpp is not installed: {INSTALL_HINT}")
    import llama_cpp

    lib = llama_cpp.llama_cpp
    if not _STATE:
        if os.environ.get("RELATIONAL_HF_LLAMA_LOG") != "1":
            callback = lib.llama_log_callback(lambda level, text, data: None)
            _STATE["callback"] = callback  # kept alive as long as the library may call it
            lib.llama_log_set(callback, ctypes.c_void_p(0))
        lib.llama_backend_init()
        _STATE["ready"] = True
    return lib


def version() -> str:
    """The llama-cpp-python release that carries llama.cpp here, e.g. "0.3.36"."""
    if not available():
        return "not installed"
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "unknown"))


class LlamaCpp:
    """One GGUF file loaded in llama.cpp on the CPU with one sequence of up to `n_ctx` tokens.

    >>> with LlamaCpp("model.gguf", n_ctx=512, threads=2) as llm:   # doctest: +SKIP
    ...     ids = llm.tokenize("Hello")
    ...     logits = llm.logits(ids)                                 # (len(ids), vocab) float32
    """

    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int = 512,
        threads: int = 2,
        n_batch: int | None = None,
        f32_cache: bool = False,
    ):
        """`f32_cache`: keys and values cached in f32 and flash attention off (llama.cpp's defaults are an f16 cache
        and flash attention where it pays: what a user runs, about 1e-3 of the logit scale from an f32 forward)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        self._lib = lib = _binding()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path} (RELATIONAL_HF_LLAMA_LOG=1 shows its log)")
        params = lib.llama_context_default_params()
        self.n_ctx = int(n_ctx)
        self.n_batch = int(n_batch or n_ctx)
        params.n_ctx = self.n_ctx
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_threads = int(threads)
        params.n_threads_batch = int(threads)
        params.n_seq_max = 1
        if f32_cache:
            params.type_k = params.type_v = lib.GGML_TYPE_F32
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not make a context of {n_ctx} tokens for {path}")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.n_past = 0

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_ctx", None) is not None:
            self._lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None) is not None:
            self._lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- text --------------------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        room = len(data) + 16
        for _ in range(2):
            out = (self._lib.llama_token * room)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), out, room, add_special, parse_special)
            if n >= 0:
                return [int(out[i]) for i in range(n)]
            room = -n
        raise RuntimeError("llama_tokenize failed")

    def detokenize(self, ids: list[int]) -> str:
        if not ids:
            return ""
        tokens = (self._lib.llama_token * len(ids))(*[int(i) for i in ids])
        room = 16 * len(ids) + 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(room)
            n = self._lib.llama_detokenize(self._vocab, tokens, len(ids), buf, room, False, True)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            room = -n
        raise RuntimeError("llama_detokenize failed")

    # -- decoding ----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence (the key/value cache)."""
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)
        self.n_past = 0

    def _decode(self, ids: list[int], want_logits: bool) -> np.ndarray | None:
        if self.n_past + len(ids) > self.n_ctx:
            raise ValueError(f"{self.n_past + len(ids)} tokens do not fit the context of {self.n_ctx}")
        rows = []
        lib = self._lib
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            batch = lib.llama_batch_init(len(chunk), 0, 1)
            try:
                batch.n_tokens = len(chunk)
                for i, token in enumerate(chunk):
                    batch.token[i] = int(token)
                    batch.pos[i] = self.n_past + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1 if (want_logits or i == len(chunk) - 1) else 0
                code = lib.llama_decode(self._ctx, batch)
                if code != 0:
                    raise RuntimeError(f"llama_decode failed with code {code}")
            finally:
                lib.llama_batch_free(batch)
            if want_logits:
                rows.append(self._logit_rows(len(chunk)))
            self.n_past += len(chunk)
        return np.concatenate(rows) if want_logits else None

    def _logit_rows(self, n: int) -> np.ndarray:
        out = np.empty((n, self.n_vocab), dtype=np.float32)
        for i in range(n):
            row = self._lib.llama_get_logits_ith(self._ctx, i)
            out[i] = np.ctypeslib.as_array(row, shape=(self.n_vocab,))
        return out

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits of every position of `ids` as one fresh sequence: (len(ids), vocab), float32."""
        self.reset()
        return self._decode(list(ids), want_logits=True)

    def _logit_rows_last(self) -> np.ndarray:
        row = self._lib.llama_get_logits_ith(self._ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy()

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        """`steps` greedy tokens after `prompt`, decoded one at a time with the cache (as a chat client would)."""
        self.reset()
        self._decode(list(prompt), want_logits=False)
        out = []
        for _ in range(steps):
            token = int(np.argmax(self._logit_rows_last()))
            out.append(token)
            self._decode([token], want_logits=False)
        return out

    def time_prefill_and_decode(self, prompt: list[int], steps: int) -> tuple[float, float]:
        """Seconds to prefill `prompt` and seconds to decode `steps` greedy tokens one at a time after it."""
        self.reset()
        start = time.perf_counter()
        self._decode(list(prompt), want_logits=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(steps):
            token = int(np.argmax(self._logit_rows_last()))
            self._decode([token], want_logits=False)
        return prefill, time.perf_counter() - start

    def perplexity(self, windows: list[list[int]]) -> float:
        """exp of the mean next-token negative log-likelihood over `windows` (each scored as a fresh sequence,
        every position after the first), the same rule as the plugin's `compress.eval`."""
        total, count = 0.0, 0
        for window in windows:
            logits = self.logits(window).astype(np.float64)
            targets = np.asarray(window[1:])
            shifted = logits[:-1]
            top = shifted.max(axis=1, keepdims=True)
            log_norm = np.log(np.exp(shifted - top).sum(axis=1)) + top[:, 0]
            total += float((log_norm - shifted[np.arange(len(targets)), targets]).sum())
            count += len(targets)
        return float(np.exp(total / count))


def quantize(src: str | Path, dst: str | Path, file_type: str, *, threads: int = 2) -> None:
    """Quantise the GGUF file `src` into `dst` with llama.cpp's quantiser (`file_type` as in FILE_TYPES).

    llama.cpp keeps a tensor whose rows do not fit the type's block in a fallback type of its own choice."""
    name = file_type.upper()
    if name not in FILE_TYPES:
        raise ValueError(f"unknown llama.cpp type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    lib = _binding()
    params = lib.llama_model_quantize_default_params()
    params.nthread = int(threads)
    params.ftype = FILE_TYPES[name]
    code = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if code != 0:
        raise ValueError(f"llama.cpp could not quantise {src} to {name} (code {code})")
