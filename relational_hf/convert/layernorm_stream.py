"""The ends of a LayerNorm family's checkpoint (GPT-2, GPT-NeoX) read as a layer-streamed compression's source.

`streaming.LlamaCheckpointLayers` converts each decoder layer on the fly (`convert_layer`, which folds LayerNorms as
`convert.layernorm` does); what lies outside the layers is held here, as the conversion writes it
(`layernorm.load_layernorm_ends` in memory, `streaming.stream_to_relational` shard by shard): with a tied head the
token embedding and the position table as they are (the model centres its input, `embedding_centring`) and the final
LayerNorm's gain and bias in front of the head; with an untied head the embedding and the position table centred, the
final gain folded into the head and the bias kept as beta / g. So the compression's dense model is the conversion's
model, and the compressed checkpoint stores these tensors unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..architectures import get_adapter
from ..shards import CheckpointReader, checkpoint_names
from .layernorm import centred_rows, untied_final_bias
from .relational import fold_head


class LayerNormEnds:
    """Embedding, learned positions, final norm and head of the LayerNorm-family checkpoint `reader` (its meta-device
    model `source`, small tensors loaded: `shards.materialize_small`), in the relational model's form (module
    docstring). `config`: the relational config of the conversion."""

    def __init__(self, source: nn.Module, reader: CheckpointReader, config) -> None:
        adapter = get_adapter(source)
        names = checkpoint_names(source, reader)
        params = {id(p): n for n, p in source.named_parameters()}

        def key(param: torch.Tensor) -> str:
            return names[params[id(param)]]

        self.config, self._reader = config, reader
        self._tied = adapter.head_tied()
        self._embed = key(adapter.embedding().weight)
        positions = adapter.embedding_slots()[1:]  # GPT-2's wpe; GPT-NeoX has rotary positions
        self._positions = key(positions[0].param) if positions else None
        final = adapter.final_norm()
        gain, bias = final.weight.detach(), final.bias.detach()
        self._gain = gain.float() if self._tied else gain  # kept in front of a tied head, else folded into it
        self._bias = bias.float() if self._tied else untied_final_bias(gain, bias)
        self._head = None if self._tied else key(adapter.output_head().weight)

    def _rows(self, key: str) -> Iterator[torch.Tensor]:
        """Row blocks of an embedding-like table as the relational model stores it: centred when the head is untied
        (row by row, so a block's rows are its table's)."""
        for block in self._reader.rows(key):
            yield block if self._tied else centred_rows(block)

    def _table(self, key: str, index: torch.Tensor | None = None) -> torch.Tensor:
        rows = self._reader.get([key])[key]
        rows = rows if index is None else rows[index]
        return rows if self._tied else centred_rows(rows)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        from ..compress.streamed import relational_embed

        table = None if self._positions is None else self._table(self._positions)
        return relational_embed(self.config, self._table(self._embed, ids), table)

    def head(self, device=None):
        from ..compress.streamed import relational_head

        eps = self.config.rms_norm_eps
        if self._tied:
            return relational_head(self._gain, self._reader.get([self._embed])[self._embed], eps, self._bias)
        return relational_head(None, fold_head(self._reader.get([self._head])[self._head], self._gain), eps, self._bias)

    def static_tensors(self):
        """(name, shape, row blocks) of the tensors outside the decoder layers, in the relational model's names."""
        yield "model.embed_tokens.weight", self._reader.shape(self._embed), self._rows(self._embed)
        if self._positions is not None:
            yield "model.embed_positions.weight", self._reader.shape(self._positions), self._rows(self._positions)
        if self._tied:
            yield "model.norm.weight", tuple(self._gain.shape), iter([self._gain])
        yield "model.norm.bias", tuple(self._bias.shape), iter([self._bias])
        if not self._tied:
            blocks = (fold_head(b, self._gain) for b in self._reader.rows(self._head))
            yield "lm_head.weight", self._reader.shape(self._head), blocks


__all__ = ["LayerNormEnds"]
