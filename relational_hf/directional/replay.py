"""The unedited forward pass, kept so that edits need not recompute it (the sweeps of DESIGN.md section 3).

`CleanPass` runs a causal LM once over (N, T) token ids and keeps, per batch, the output of every decoder block
(= the input h_{l+1} of the next one) and the clean next-token NLL of every row. `nll(start_layer=l)` then reruns only
blocks l..L-1, the final norm and the head: the blocks before l hand back their recorded outputs without computing.
An edit confined to layers >= l (e.g. `scale_components(..., layers=[l])`) changes nothing before l, so this is the
edited model's loss exactly, at (L - l)/L of the block cost. The same record gives the dense layer inputs and
outputs that `compression_error` compares against.

The NLL comes from the base model's last hidden state and the output head applied in chunks of tokens, so the
(B, T, V) logits are never materialised; on the first batch it is checked against the model's own logits and the
full model is used instead where the two differ (e.g. an architecture that post-processes its logits).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..architectures import get_adapter
from ..lm.metrics import model_device
from .sites import first_input, main_output, replace_main_output

#: tokens per chunk of the output head (bounds the logits held at once to HEAD_CHUNK x V floats)
HEAD_CHUNK = 1024


def _slice_rows(output, rows: int | None):
    """A recorded block output restricted to its first `rows` batch rows (None: all)."""
    return output if rows is None else replace_main_output(output, main_output(output)[:rows])


@contextmanager
def replay_blocks(blocks: list[nn.Module], outputs: list, rows: int | None = None) -> Iterator[None]:
    """While open, block j of `blocks` returns `outputs[j]` (its first `rows` rows) without computing; the blocks'
    own `forward` is restored on exit, also on error. Hooks registered on a block still run around the replay."""
    saved: list[tuple[nn.Module, object]] = []
    try:
        for block, output in zip(blocks, outputs):
            saved.append((block, block.__dict__.get("forward")))
            value = _slice_rows(output, rows)
            block.forward = lambda *args, _value=value, **kwargs: _value
        yield
    finally:
        for block, previous in reversed(saved):
            if previous is None:
                del block.__dict__["forward"]
            else:
                block.forward = previous


def _check_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, batch_size: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty (N, T) tensor of token ids, got {shape}")
    if input_ids.shape[1] < 2:
        raise ValueError(f"rows need at least 2 tokens (a token and its target), got T = {input_ids.shape[1]}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected {tuple(input_ids.shape)} like input_ids"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


class CleanPass:
    """One unedited forward pass of `model` over input_ids (N, T) (attention_mask (N, T), 0 at padding) in batches of
    `batch_size` rows, kept for replays.

    Attributes: `row_nll` (N,) summed clean NLL per row (float64) and `row_count` (N,) its predicted tokens (a target
    counts when it and the token before it are real); `baseline` = exp(sum row_nll / sum row_count). With
    keep_layers=False only the NLL is kept (a fast perplexity evaluation). The model runs in eval mode under no_grad;
    its training flag is restored.
    """

    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        batch_size: int = 8,
        keep_layers: bool = True,
        progress: bool = True,
        desc: str = "clean pass",
    ) -> None:
        _check_ids(input_ids, attention_mask, batch_size)
        self.model = model
        self.adapter = get_adapter(model)
        self.blocks = [roles.block for roles in self.adapter.layers()]
        self.device = model_device(model)
        self.input_ids, self.attention_mask, self.batch_size = input_ids, attention_mask, batch_size
        self.keep_layers = keep_layers
        #: per batch, the input of block 0 and the output object of every block
        self.first_inputs: list[torch.Tensor] = []
        self.outputs: list[list] = []
        #: True when every block's input is the previous block's output (what replays rely on)
        self.chained = True
        self._fast_head: bool | None = None
        sums, counts = [], []
        with self._eval(), ExitStack() as stack:
            recorded: dict = {}
            if keep_layers:
                self._record_hooks(stack, recorded)
            for ids, mask in tqdm(list(self._batches()), desc=desc, disable=not progress, leave=False, unit="batch"):
                recorded.clear()
                total, count = self._row_nll(ids, mask)
                sums.append(total)
                counts.append(count)
                if keep_layers:
                    self.first_inputs.append(recorded["input"])
                    self.outputs.append([recorded[i] for i in range(len(self.blocks))])
        self.row_nll = torch.cat(sums)
        self.row_count = torch.cat(counts)
        if int(self.row_count.sum()) == 0:
            raise ValueError("no target token to evaluate (every row has fewer than 2 real tokens)")
        self.baseline = self.perplexity_of(self.row_nll.sum().item(), int(self.row_count.sum()))

    # --- recording -----------------------------------------------------------------------------------------------
    def _record_hooks(self, stack: ExitStack, recorded: dict) -> None:
        def pre_hook(i: int):
            def hook(module, args, kwargs):
                h = first_input(args, kwargs)
                if i == 0:
                    recorded["input"] = h
                elif h is not main_output(recorded[i - 1]) and not torch.equal(h, main_output(recorded[i - 1])):
                    self.chained = False

            return hook

        def hook(i: int):
            def record(module, args, output):
                recorded[i] = output

            return record

        for i, block in enumerate(self.blocks):
            stack.callback(block.register_forward_pre_hook(pre_hook(i), with_kwargs=True).remove)
            stack.callback(block.register_forward_hook(hook(i)).remove)

    @contextmanager
    def _eval(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _batches(self, rows: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        n = self.input_ids.shape[0] if rows is None else min(rows, self.input_ids.shape[0])
        for start in range(0, n, self.batch_size):
            stop = min(start + self.batch_size, n)
            mask = None if self.attention_mask is None else self.attention_mask[start:stop].to(self.device)
            yield self.input_ids[start:stop].to(self.device), mask

    # --- the loss ------------------------------------------------------------------------------------------------
    def _model_nll(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Per-token NLL (B, T-1) from the full model's logits."""
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        flat = logits.reshape(-1, logits.shape[-1]).float()
        return F.cross_entropy(flat, ids[:, 1:].reshape(-1), reduction="none").view(ids.shape[0], -1)

    def _head_nll(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Per-token NLL (B, T-1) from the base model's last hidden state and the output head, chunk by chunk."""
        output = self.adapter.base_model()(input_ids=ids, attention_mask=mask, use_cache=False)
        hidden = output[0][:, :-1]
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1)
        head = self.adapter.output_head()
        nll = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        for start in range(0, flat.shape[0], HEAD_CHUNK):
            stop = start + HEAD_CHUNK
            nll[start:stop] = F.cross_entropy(head(flat[start:stop]).float(), targets[start:stop], reduction="none")
        return nll.view(ids.shape[0], -1)

    def _token_nll(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self._fast_head is None:  # decide once, on the first row of the first batch
            self._fast_head = False
            if self.adapter.output_head() is not None:
                probe_ids = ids[:1, : min(ids.shape[1], 32)]
                probe_mask = None if mask is None else mask[:1, : probe_ids.shape[1]]
                fast, slow = self._head_nll(probe_ids, probe_mask), self._model_nll(probe_ids, probe_mask)
                self._fast_head = bool(torch.allclose(fast, slow, rtol=1e-4, atol=1e-4))
        return self._head_nll(ids, mask) if self._fast_head else self._model_nll(ids, mask)

    def _row_nll(self, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed NLL per row (B,) float64, predicted tokens per row (B,)) on the CPU."""
        nll = self._token_nll(ids, mask)
        valid = torch.ones_like(nll, dtype=torch.bool) if mask is None else (mask[:, 1:] * mask[:, :-1]).bool()
        return nll.masked_fill(~valid, 0.0).double().sum(1).cpu(), valid.sum(1).cpu()

    @staticmethod
    def perplexity_of(total: float, count: int) -> float:
        """exp(total / count), inf where that overflows."""
        mean = total / count
        return math.exp(mean) if mean < 700 else math.inf

    # --- replays -------------------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def baseline_of(self, rows: int | None = None) -> float:
        """The clean perplexity of the first `rows` rows (None: all)."""
        n = self.num_rows if rows is None else rows
        return self.perplexity_of(self.row_nll[:n].sum().item(), int(self.row_count[:n].sum()))

    def nll(
        self, start_layer: int = 0, rows: int | None = None, progress: bool = False, desc: str = "evaluating"
    ) -> tuple[float, int]:
        """(summed NLL, predicted tokens) of the model as it computes now (e.g. inside an edit context) over the first
        `rows` rows (None: all), with blocks 0..start_layer-1 replayed from the clean record. Correct for any edit
        that leaves those blocks unchanged; start_layer = 0 recomputes everything."""
        if rows is not None and not 1 <= rows <= self.num_rows:
            raise ValueError(f"rows must be in [1, {self.num_rows}], got {rows}")
        if not 0 <= start_layer <= len(self.blocks):
            raise ValueError(f"start_layer must be in [0, {len(self.blocks)}], got {start_layer}")
        if start_layer and not (self.keep_layers and self.chained):
            start_layer = 0  # nothing (reliable) to replay from: recompute
        total, count = 0.0, 0
        with self._eval():
            batches = list(self._batches(rows))
            for b, (ids, mask) in enumerate(tqdm(batches, desc=desc, disable=not progress, leave=False)):
                replayed = self.outputs[b][:start_layer] if start_layer else []
                with replay_blocks(self.blocks[:start_layer], replayed, ids.shape[0]):
                    sums, counts = self._row_nll(ids, mask)
                total += sums.sum().item()
                count += int(counts.sum())
        return total, count

    def perplexity(
        self, start_layer: int = 0, rows: int | None = None, progress: bool = False, desc: str = "evaluating"
    ) -> float:
        """exp(mean NLL) of `nll(start_layer, rows)`."""
        return self.perplexity_of(*self.nll(start_layer, rows, progress, desc))

    def block_input(self, batch: int, layer: int) -> torch.Tensor:
        """The clean input h_l of block `layer` in batch `batch`."""
        return self.first_inputs[batch] if layer == 0 else main_output(self.outputs[batch][layer - 1])

    def block_output(self, batch: int, layer: int) -> torch.Tensor:
        """The clean output of block `layer` in batch `batch`."""
        return main_output(self.outputs[batch][layer])

    def matches(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, batch_size: int):
        """ValueError unless this pass recorded `model` on exactly these inputs in batches of `batch_size`."""
        same_mask = (self.attention_mask is None and attention_mask is None) or (
            self.attention_mask is not None
            and attention_mask is not None
            and torch.equal(self.attention_mask, attention_mask)
        )
        if (
            model is not self.model
            or batch_size != self.batch_size
            or not (input_ids is self.input_ids or torch.equal(input_ids, self.input_ids))
            or not same_mask
        ):
            raise ValueError("`clean` was recorded for another model, other inputs or another batch_size")
