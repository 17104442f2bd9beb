"""Attention that stays linear in length for packed and padded causal-LM batches: each
document of a row attends causally to itself through SDPA's causal kernel, one call per
document, so no (rows x length x length) mask is ever built.

transformers keeps packed documents apart by building a block-diagonal mask from the restarting
``position_ids`` (and a padding mask from ``attention_mask``): at 16k tokens that mask, and SDPA's
masked path, cost more than the rest of a small model's step. Here the collator states where
each row's documents lie (:func:`document_lengths`, on the host, from the same tensors), the
loss passes them to the model as a keyword argument (``document_lengths``, which transformers'
models hand on to their attention function, as they do FlashAttention's ``cu_seq_lens``), and
:func:`document_attention` runs SDPA per document. The run's estimate calls the same collator,
so it takes the same path at every length.

The model's attention is registered under :data:`ATTENTION` with a mask function that defers
the mask (:class:`DeferredMask`): a call without ``document_lengths`` (generation, a sample)
builds exactly the mask SDPA would have had, when its attention first needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ATTENTION = "effitrain_documents"
"""The attention implementation's name in transformers' registries."""

LENGTHS_KEY = "document_lengths"
"""The batch key, and the model's keyword argument: per row, its documents' lengths in order
(they add up to the row's length; padding is a document of its own, never attended from
outside it)."""


@dataclass(frozen=True)
class DeferredMask:
    """``sdpa_mask``'s arguments, kept rather than made: a 4D mask is (rows x length x length),
    and document attention needs none. :meth:`materialize` makes it once, for a call that
    needs it (no document lengths given)."""

    arguments: dict[str, Any]

    def materialize(self) -> torch.Tensor | None:
        from transformers.masking_utils import sdpa_mask

        cache = self.arguments.setdefault("_made", [])
        if not cache:
            cache.append(sdpa_mask(**{k: v for k, v in self.arguments.items() if k != "_made"}))
        return cache[0]


def _deferred_mask(**arguments: Any) -> DeferredMask:
    return DeferredMask(dict(arguments))


def document_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, run per document where the call gives
    ``document_lengths`` (query, key and value are (rows, heads, length, head_dim); the output
    (rows, length, heads, head_dim), as SDPA's)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    lengths = kwargs.pop(LENGTHS_KEY, None)
    if lengths is None or not _per_document(query, key, lengths, kwargs):
        mask = (
            attention_mask.materialize()
            if isinstance(attention_mask, DeferredMask)
            else attention_mask
        )
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows = []
    for row, row_lengths in enumerate(lengths):
        pieces, start = [], 0
        for length in row_lengths:
            part = slice(start, start + length)
            q, k, v = (t[row : row + 1, :, part] for t in (query, key, value))
            out, _ = sdpa_attention_forward(
                module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs
            )
            pieces.append(out)
            start += length
        rows.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1))
    return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)), None


def _per_document(
    query: torch.Tensor, key: torch.Tensor, lengths: Any, kwargs: dict[str, Any]
) -> bool:
    """Whether the call can run per document: a full causal pass over the rows the lengths
    describe (no cache: as many keys as queries), and nothing that needs a mask's form (a
    sliding window shorter than a document, a position bias, a soft cap)."""
    if query.shape[2] != key.shape[2] or len(lengths) != query.shape[0]:
        return False
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    window = kwargs.get("sliding_window")
    return window is None or max(max(row) for row in lengths) <= window


def use(model: torch.nn.Module) -> bool:
    """Give ``model`` document attention where it runs SDPA through transformers' attention
    interface (the architectures that take a registered attention function); False where it
    keeps its own (the per-document mask then comes from ``position_ids``, as before)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    if not getattr(model, "_supports_attention_backend", False) or config is None:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTENTION):
        return False
    AttentionInterface.register(ATTENTION, document_attention)
    AttentionMaskInterface.register(ATTENTION, _deferred_mask)
    model.set_attn_implementation(ATTENTION)
    return True


def in_use(model: Any) -> bool:
    """Whether ``model`` (or the model a wrapper holds) runs :func:`document_attention`."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTENTION


def document_lengths(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> tuple[tuple[int, ...], ...] | None:
    """Each row's documents' lengths, from a collated batch on the host (None: neither
    tensor): a packed row's documents start where its ``position_ids`` restart (as transformers
    finds them); a padded row is its tokens, then (padded on the left: after) its padding."""
    import torch

    if position_ids is not None:
        starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    elif attention_mask is not None:
        starts = attention_mask[:, 1:] != attention_mask[:, :-1]
    else:
        return None
    length = starts.shape[1] + 1
    rows, columns = torch.nonzero(starts, as_tuple=True)
    cuts: list[list[int]] = [[] for _ in range(starts.shape[0])]
    for row, column in zip(rows.tolist(), (columns + 1).tolist(), strict=True):
        cuts[row].append(column)
    return tuple(_runs(row, length) for row in cuts)


def _runs(starts: list[int], length: int) -> tuple[int, ...]:
    bounds = [0, *starts, length]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


class WithDocumentLengths:
    """A collator whose batches also say where each row's documents lie (:data:`LENGTHS_KEY`,
    host integers, not a tensor: it never leaves the host, and fake tensors keep it)."""

    def __init__(self, collate: Any):
        self.collate = collate

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = dict(self.collate(features))
        lengths = document_lengths(batch.get("position_ids"), batch.get("attention_mask"))
        if lengths is not None:
            batch[LENGTHS_KEY] = lengths
        return batch
