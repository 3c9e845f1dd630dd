"""Compression diagnostics (DESIGN.md section 3): the layer-local counterfactual error of a compressed model, split
along the dense update, and a report that ranks compression settings by it.

Counterfactual: run the dense model and record each layer's input h and update delta_dense = layer(h) - h; feed the
compressed layer the same h, delta_compressed = layer~(h) - h; e = delta_compressed - delta_dense. Relative to
delta_dense (not h): e_par = (e.delta_dense / |delta_dense|^2) delta_dense, e_perp = e - e_par.

The compressors compared (quantisation and pruning settings, `COMPRESSION_SETTINGS`) are the weight operations of
`relational_hf.compress.ops`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass

import torch
from scipy.stats import spearmanr
from torch import nn
from tqdm.auto import tqdm

from ..architectures import get_adapter
from ..compress.ops import COMPRESSION_SETTINGS, compressed_view, in_compressed_view
from ..lm.metrics import model_device
from ..modeling.modeling_directional import parallel_component
from .decompose import unpack_batch
from .replay import CleanPass
from .sites import first_input, main_output, replace_first_input
from .statistics import select_tokens
from .tables import finite_or_none, format_number, markdown_table

_TINY = torch.finfo(torch.float32).tiny


# ----------------------------------------------------------------------------------------------------------------
# The layer-local counterfactual error
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class LayerCompressionError:
    """Means over real tokens of |e_par|/|delta_dense|, |e_perp|/|delta_dense| and |e|/|delta_dense| in one layer."""

    layer: int
    count: int
    parallel: float
    perpendicular: float
    total: float

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict."""
        return asdict(self)


class _Counterfactual:
    """Hooks of the two passes of `compression_error`: record each dense layer's input h and output, then feed each
    compressed layer that h and accumulate, per layer, the token count and the sums of |e_par|, |e_perp|, |e| over
    |delta_dense|."""

    def __init__(self, layers: Iterable[int]) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.valid: torch.Tensor | None = None
        self.sums = {i: torch.zeros(4, dtype=torch.float64) for i in layers}

    def record_input(self, i: int):
        def hook(module, args, kwargs):
            self.inputs[i] = first_input(args, kwargs)

        return hook

    def record_output(self, i: int):
        def hook(module, args, output):
            self.outputs[i] = main_output(output)

        return hook

    def feed_dense_input(self, i: int):
        def hook(module, args, kwargs):
            return replace_first_input(args, kwargs, self.inputs[i])

        return hook

    def measure(self, i: int):
        def hook(module, args, output):
            h, dense_out = self.inputs[i], self.outputs[i]
            delta = select_tokens(dense_out - h, self.valid)  # delta_dense (N, d)
            e = select_tokens(main_output(output) - dense_out, self.valid)  # delta_compressed - delta_dense (N, d)
            e_par = parallel_component(e, delta)
            norm = delta.norm(dim=-1).double().clamp_min(_TINY)
            self.sums[i] += torch.stack(
                [
                    torch.tensor(float(e.shape[0]), dtype=torch.float64),
                    (e_par.norm(dim=-1).double() / norm).sum(),
                    ((e - e_par).norm(dim=-1).double() / norm).sum(),
                    (e.norm(dim=-1).double() / norm).sum(),
                ]
            )

        return hook

    def results(self) -> list[LayerCompressionError]:
        out = []
        for i, sums in self.sums.items():
            count, par, perp, total = sums.tolist()
            n = max(count, 1.0)
            out.append(LayerCompressionError(i, int(count), par / n, perp / n, total / n))
        return out


@torch.no_grad()
def compression_error(
    dense_model: nn.Module,
    compressed_model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    clean: CleanPass | None = None,
    progress: bool = False,
) -> list[LayerCompressionError]:
    """Per layer, the error of the compressed layer fed the dense layer's input h (layer-local counterfactual):
    e = delta_compressed - delta_dense (= layer~(h) - layer(h)), split along delta_dense; returns the means over
    real tokens of |e_par|/|delta_dense|, |e_perp|/|delta_dense| and |e|/|delta_dense|. input_ids (N, T),
    attention_mask (N, T) with 0 at padding; both models run in eval mode (training flags restored). `clean`: a
    `CleanPass` of dense_model on the same inputs and batch_size, whose recorded layer inputs and outputs replace the
    dense pass. Only the decoder stacks run (no output head). One model may be passed as both, running compressed
    (inside `compress.ops.compressed_view`), with the dense record in `clean`."""
    if compressed_model is dense_model and clean is None and in_compressed_view(dense_model):
        raise ValueError(
            "dense_model is compressed_model inside a compressed_view: pass `clean`, a CleanPass recorded before the "
            "view was opened, for the dense layers' inputs and outputs"
        )
    dense_layers, compressed_layers = get_adapter(dense_model).layers(), get_adapter(compressed_model).layers()
    if len(dense_layers) != len(compressed_layers):
        raise ValueError(f"the models have {len(dense_layers)} and {len(compressed_layers)} layers")
    widths = [get_adapter(m).embedding().weight.shape[-1] for m in (dense_model, compressed_model)]
    if widths[0] != widths[1]:
        raise ValueError(
            f"the models' hidden sizes differ (dense {widths[0]}, compressed {widths[1]}): compression_error feeds each "
            "compressed layer the dense layer's input h, which needs the same residual width. A sliced model works "
            "in a rotated, truncated basis (h Q_s) that this measure does not apply; pass a compressed model of the "
            "same width (quantisation, pruning, per-head rank reduction) or compare sliced models by perplexity"
        )
    if clean is not None:
        clean.matches(dense_model, input_ids, attention_mask, batch_size)
        if not clean.keep_layers:
            raise ValueError("`clean` was recorded with keep_layers=False: it has no layer inputs to compare")
    state = _Counterfactual(roles.index for roles in dense_layers)
    flags = (dense_model.training, compressed_model.training)
    dense_model.eval()
    compressed_model.eval()
    dense_base, compressed_base = get_adapter(dense_model).base_model(), get_adapter(compressed_model).base_model()
    starts = range(0, input_ids.shape[0], batch_size)
    try:
        for batch, start in enumerate(tqdm(starts, desc="layer errors", disable=not progress, leave=False)):
            mask = None if attention_mask is None else attention_mask[start : start + batch_size]
            ids = input_ids[start : start + batch_size]
            state.valid = None if mask is None else mask.bool()
            if clean is not None:
                for roles in dense_layers:
                    state.inputs[roles.index] = clean.block_input(batch, roles.index)
                    state.outputs[roles.index] = clean.block_output(batch, roles.index)
            else:
                with ExitStack() as stack:  # pass 1: the dense layers' inputs and outputs
                    for roles in dense_layers:
                        pre = roles.block.register_forward_pre_hook(state.record_input(roles.index), with_kwargs=True)
                        stack.callback(pre.remove)
                        stack.callback(roles.block.register_forward_hook(state.record_output(roles.index)).remove)
                    dense_ids, dense_mask = unpack_batch(
                        {"input_ids": ids, "attention_mask": mask}, model_device(dense_model)
                    )
                    dense_base(input_ids=dense_ids, attention_mask=dense_mask, use_cache=False)
            with ExitStack() as stack:  # pass 2: each compressed layer fed the dense input
                for roles in compressed_layers:
                    pre = roles.block.register_forward_pre_hook(state.feed_dense_input(roles.index), with_kwargs=True)
                    stack.callback(pre.remove)
                    stack.callback(roles.block.register_forward_hook(state.measure(roles.index)).remove)
                ids, mask = unpack_batch({"input_ids": ids, "attention_mask": mask}, model_device(compressed_model))
                compressed_base(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        dense_model.train(flags[0])
        compressed_model.train(flags[1])
    return state.results()


# ----------------------------------------------------------------------------------------------------------------
# Report: rank settings by error, correlate with perplexity
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class CompressionResult:
    """One compression setting: its per-layer errors and the compressed model's perplexity."""

    setting: str
    layers: list[LayerCompressionError]
    perplexity: float

    def mean(self, kind: str) -> float:
        """Mean over layers of the per-layer error `kind` ("parallel", "perpendicular" or "total")."""
        return sum(getattr(layer, kind) for layer in self.layers) / max(len(self.layers), 1)

    def to_dict(self) -> dict:
        """Setting, perplexity, the layer-mean errors and the per-layer errors (JSON-ready)."""
        return {
            "setting": self.setting,
            "perplexity": finite_or_none(self.perplexity),
            **{kind: self.mean(kind) for kind in ("parallel", "perpendicular", "total")},
            "layers": [layer.to_dict() for layer in self.layers],
        }


@dataclass
class CompressionReport:
    """Compression settings with their errors, the dense perplexity, rankings and Spearman correlations."""

    dense_perplexity: float
    results: list[CompressionResult]

    def ranking(self, by: str = "perpendicular") -> list[str]:
        """Settings from the smallest to the largest mean error `by` ("perpendicular" or "total")."""
        return [r.setting for r in sorted(self.results, key=lambda r: r.mean(by))]

    def spearman(self, by: str = "perpendicular") -> tuple[float, float]:
        """(rho, p-value) of scipy.stats.spearmanr between the mean error `by` and the perplexity over settings
        (nan where fewer than 3 settings or a constant column make it undefined)."""
        if len(self.results) < 3:
            return math.nan, math.nan
        result = spearmanr([r.mean(by) for r in self.results], [r.perplexity for r in self.results])
        return float(result.statistic), float(result.pvalue)

    def to_dict(self) -> dict:
        """Dense perplexity, the settings, both rankings and both Spearman correlations (JSON-ready, nan -> None)."""
        out = {"dense_perplexity": self.dense_perplexity, "settings": [r.to_dict() for r in self.results]}
        for by in ("perpendicular", "total"):
            rho, p = self.spearman(by)
            out[f"ranking_{by}"] = self.ranking(by)
            out[f"spearman_{by}"] = {"rho": finite_or_none(rho), "p_value": finite_or_none(p)}
        return out

    def to_markdown(self) -> str:
        """Settings ranked by perpendicular error, then the dense perplexity and the two Spearman correlations."""
        header = ["setting", "mean |e_par|/|delta|", "mean |e_perp|/|delta|", "mean |e|/|delta|", "perplexity"]
        by_name = {r.setting: r for r in self.results}
        rows = [
            [
                name,
                *(format_number(by_name[name].mean(k)) for k in ("parallel", "perpendicular", "total")),
                format_number(by_name[name].perplexity),
            ]
            for name in self.ranking("perpendicular")
        ]
        lines = [markdown_table(header, rows), f"\ndense perplexity {format_number(self.dense_perplexity)}"]
        for by in ("perpendicular", "total"):
            rho, p = self.spearman(by)
            lines.append(f"Spearman(mean {by} error, perplexity) = {rho:.3f} (p = {p:.3g})")
        return "\n".join(lines)


def _perplexity(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, batch_size: int) -> float:
    return CleanPass(model, ids, mask, batch_size, keep_layers=False, progress=False).baseline


def compression_report(
    model: nn.Module,
    input_ids: torch.Tensor,
    settings: Sequence[str] = COMPRESSION_SETTINGS,
    calibration_ids: torch.Tensor | None = None,
    eval_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    group_size: int = 128,
    batch_size: int = 8,
    progress: bool = True,
    clean: CleanPass | None = None,
) -> CompressionReport:
    """For each setting: compress (Wanda calibrates on `calibration_ids`, default input_ids), measure
    `compression_error` on input_ids and the compressed perplexity on `eval_ids` (default input_ids, with
    attention_mask only when eval_ids is not given). `clean`: a `CleanPass` of `model` on input_ids (same
    attention_mask and batch_size) that replaces the dense passes and gives the dense perplexity (recorded here when
    not given).

    The model computes each setting through `compress.ops.compressed_view`, not a copy: memory holds one compressed
    copy of the decoder weights at most, and none for layers a device map offloads to disk (each is compressed as it
    comes in), so a model loaded with `lm.offload.load_offloaded` is analysed layer by layer."""
    calibration_ids = input_ids if calibration_ids is None else calibration_ids
    same_eval = eval_ids is None
    eval_mask = attention_mask if same_eval else None
    eval_ids = input_ids if same_eval else eval_ids
    if clean is None:  # the dense layers' inputs and outputs, recorded before any weight is swapped
        clean = CleanPass(model, input_ids, attention_mask, batch_size, progress=False)
    else:
        clean.matches(model, input_ids, attention_mask, batch_size)
    results = []
    for setting in tqdm(list(settings), desc="compression", disable=not progress, leave=False):
        with compressed_view(model, setting, calibration_ids, group_size):
            errors = compression_error(model, model, input_ids, attention_mask, batch_size, clean)
            results.append(CompressionResult(setting, errors, _perplexity(model, eval_ids, eval_mask, batch_size)))
    dense = clean.baseline if same_eval else _perplexity(model, eval_ids, eval_mask, batch_size)
    return CompressionReport(dense, results)
