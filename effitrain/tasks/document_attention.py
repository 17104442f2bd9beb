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

Rows of up to :data:`MASKED_UP_TO` tokens keep transformers' mask (faster there). The model's
attention is registered under ``models.DOCUMENT_ATTENTION`` with a mask function that builds no
mask for longer rows inside :func:`documents_given` (the loss's forward) and SDPA's own mask
elsewhere (generating a sample), so a call without document lengths is SDPA's.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from effitrain.models import DOCUMENT_ATTENTION as ATTENTION
from effitrain.models import DOCUMENT_LENGTHS as LENGTHS_KEY

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

MASKED_UP_TO = 1024
"""Rows of up to this many tokens keep transformers' block-diagonal mask: one kernel call for
the batch, where a call per document would cost more time (the demo's 512-token blocks hold
about 15 documents: 2.4x slower per step) than the mask costs memory (4 bytes a token pair and
layer, 4 MiB a row at 1,024 tokens). Longer rows run per document."""

_GIVEN = contextvars.ContextVar("document_lengths_given", default=False)


@contextmanager
def documents_given() -> Iterator[None]:
    """Around a forward whose call gives ``document_lengths``: the model builds no mask."""
    token = _GIVEN.set(True)
    try:
        yield
    finally:
        _GIVEN.reset(token)


def _mask(**arguments: Any) -> torch.Tensor | None:
    from transformers.masking_utils import sdpa_mask

    per_document = _GIVEN.get() and arguments["q_length"] > MASKED_UP_TO
    return None if per_document else sdpa_mask(**arguments)


def document_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
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
    if lengths is not None and query.shape[2] <= MASKED_UP_TO:
        lengths = None  # short rows: the mask (block-diagonal, padding) transformers built
    elif lengths is not None and all(len(row) == 1 for row in lengths):
        lengths = None  # whole rows: no mask was built, SDPA's causal kernel over the batch
    if lengths is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[2] != key.shape[2] or len(lengths) != query.shape[0]:
        raise ValueError(  # a caller's mistake, never the run's: its batches come from one collator
            f"document lengths for {len(lengths)} rows given to attention over "
            f"{tuple(query.shape)} queries and {tuple(key.shape)} keys"
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
        # A new tensor for the output layer (SDPA keeps each piece for backward): a row of
        # several documents holds one (length x hidden) more per layer than a whole row.
        rows.append(torch.cat(pieces, dim=1))
    return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)), None


def use(model: torch.nn.Module) -> bool:
    """Give ``model`` document attention where it runs SDPA through transformers' attention
    interface over full causal layers (no sliding window, no soft-capped logits: per-document
    SDPA has neither); False where it keeps its own (packed documents are then kept apart by
    the mask transformers builds from ``position_ids``, as before)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    if not getattr(model, "_supports_attention_backend", False) or config is None:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTENTION):
        return False
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if set(layer_types) != {"full_attention"} or getattr(config, "attn_logit_softcapping", None):
        return False
    AttentionInterface.register(ATTENTION, document_attention)
    AttentionMaskInterface.register(ATTENTION, _mask)
    cast("PreTrainedModel", model).set_attn_implementation(ATTENTION)
    return True


def in_use(model: Any) -> bool:
    """Whether ``model`` (or the model a wrapper holds) runs :func:`document_attention`."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTENTION


def document_lengths(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> tuple[tuple[int, ...], ...] | None:
    """Each row's documents' lengths, from a collated batch on the host (None: neither
    tensor): a packed row's documents are those transformers finds from its ``position_ids``
    (``find_packed_sequence_indices``: a new one wherever they do not go up by one); a padded
    row is its tokens, then (padded on the left: after) its padding."""
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    if position_ids is not None:
        documents = find_packed_sequence_indices(position_ids)
        if documents is None:  # one document a row
            documents = torch.zeros_like(position_ids)
    elif attention_mask is not None:
        changes = (attention_mask[:, 1:] != attention_mask[:, :-1]).cumsum(-1)
        documents = torch.cat([torch.zeros_like(changes[:, :1]), changes], dim=1)
    else:
        return None
    return tuple(
        tuple(torch.unique_consecutive(row, return_counts=True)[1].tolist()) for row in documents
    )


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
