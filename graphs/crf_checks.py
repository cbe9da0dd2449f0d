"""Checks of what the CRF's table methods read (``unary_table``, ``embedding_table``,
``node_mask``, ``memory_scores``): engines call them with inputs checked before, and a
direct call gets the same refusals by name. Value checks are device-side
(``graphs.device_checks``) and skipped while compiling or exporting."""

from __future__ import annotations

import torch

from graphs.device_checks import refuse_non_finite
from graphs.inputs import check_device, check_embeddings, check_tokens

__all__ = ["check_reads", "table_tokens", "table_embeddings", "checked_mask", "product_key_query"]


def check_reads(crf, source: str) -> None:
    """``source`` ("token ids" or "embeddings") is what ``crf`` reads."""
    reads = "token ids" if crf.embedding_size is None else "embeddings"
    if source != reads:
        fix = "embeddings=x [B, n, D] (MeanField, Exact)" if reads == "embeddings" else "token ids"
        raise ValueError(
            f"this CRF reads {reads} (vocab_size={crf.vocab_size}, embedding_size={crf.embedding_size}), "
            f"not {source}: pass {fix}"
        )


def table_tokens(crf, tokens, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, n] long, mask [B, n] bool)`` as ``graphs.inputs.check_tokens`` (ids in
    ``[0, vocab_size)`` at real tokens), a row of padding only allowed."""
    check_reads(crf, "token ids")
    return check_tokens(tokens, mask, crf.vocab_size, crf.unary.device, empty_rows=True)


def table_embeddings(crf, embeddings, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [B, n, D], mask [B, n] bool)`` as ``graphs.inputs.check_embeddings``, a row of
    padding only allowed."""
    check_reads(crf, "embeddings")
    return check_embeddings(
        embeddings, mask, crf.embedding_size, dtype=crf.unary.dtype, device=crf.unary.device, empty_rows=True
    )


def checked_mask(mask) -> torch.Tensor:
    """A bool tensor ``[B, n]``."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        found = f"shape {tuple(mask.shape)}, {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"mask must be a torch.bool tensor [batch, length], got {found}")
    return mask


def product_key_query(crf, query) -> torch.Tensor:
    """A finite query ``[..., d]`` in the CRF's dtype and on its device, for a product-key memory."""
    if crf.global_memory != "product_key":
        raise ValueError(
            f"memory_scores needs a product-key memory (global_memory='product_key'), "
            f"this CRF has global_memory={crf.global_memory!r}"
        )
    dtype, d = crf.unary.dtype, crf.labels
    if not isinstance(query, torch.Tensor) or not query.dtype.is_floating_point:
        found = getattr(query, "dtype", type(query).__name__)
        raise TypeError(f"query must be a floating torch.Tensor [..., {d}] (labels), got {found}")
    if query.dtype != dtype and not torch.is_autocast_enabled(query.device.type):
        raise TypeError(f"query must have the CRF's dtype {dtype} (outside autocast), got {query.dtype}")
    if query.dim() < 1 or query.shape[-1] != d:
        raise ValueError(f"query must have shape [..., {d}] (labels), got {tuple(query.shape)}")
    check_device("query", query, crf.unary.device)
    refuse_non_finite("query", query)
    return query
