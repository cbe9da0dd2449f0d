"""Checks of what a CRF reads: a batch of token ids or of embeddings with its mask, and a
full assignment of its variables. Bad input gets an exception naming the argument and what
it must be; value checks (ids in range, no empty row) are device-side asserts
(``graphs.device_checks``) that read nothing back to the host unless they fail, and are
skipped while compiling or exporting."""

from __future__ import annotations

import torch

from graphs.device_checks import refuse_non_finite, refuse_unless

__all__ = [
    "check_token_types",
    "check_device",
    "check_tokens",
    "check_embeddings",
    "check_assignment",
    "refuse_empty_rows",
]


def check_token_types(tokens, mask, device: torch.device | None = None) -> torch.Tensor:
    """The type and shape checks of a batch of token ids (every model, engine and exported
    model's wrapper makes these, with these messages): ``tokens`` a ``torch.Tensor`` of an
    integer dtype ``[B, n]``, non-empty, on ``device`` (the model's, when given); ``mask``
    None or a bool tensor of the same shape on the same device. Numpy arrays and lists are
    refused (``TypeError``): ``torch.as_tensor`` converts them. Returns the mask (all True
    when None)."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(
            f"tokens must be a torch.Tensor of integer ids [batch, length], got {type(tokens).__name__} "
            "(convert arrays with torch.as_tensor)"
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape [batch, length], got {tuple(tokens.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
    check_device("tokens", tokens, device)
    if mask is None:
        return torch.ones_like(tokens, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a torch.bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.shape != tokens.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal tokens shape {tuple(tokens.shape)}")
    check_device("mask", mask, tokens.device, "the tokens'")
    return mask


def check_device(name: str, value: torch.Tensor, device: torch.device | None, whose: str = "the model's") -> None:
    """``value`` on ``device`` (none given: any): a tensor elsewhere failed inside the first
    operation that met the two, with torch's words."""
    if device is not None and value.device != device:
        raise ValueError(
            f"{name} must be on {whose} device {device}, got {value.device} (move it with .to('{device}'))"
        )


def check_tokens(
    tokens, mask, vocab_size: int, device=None, empty_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, n] long, mask [B, n] bool)`` of token ids in ``[0, vocab_size)`` on
    ``device`` when given; padded positions (mask False) may hold any id and read as 0.
    ``empty_rows``: a row of padding only is allowed (a table of it is zeros)."""
    mask = check_token_types(tokens, mask, device)
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # value checks: eager only
        return tokens.long().masked_fill(~mask, 0), mask
    if not empty_rows:
        refuse_empty_rows(mask)
    legal = ((tokens >= 0) & (tokens < vocab_size)) | ~mask
    refuse_unless(
        legal.all(),
        f"token ids must lie in [0, {vocab_size}) (vocab_size)",
        lambda: f"token ids must lie in [0, {vocab_size}) (vocab_size); found {tokens[~legal][0].item()}",
    )
    # Padded positions may hold any id (e.g. -100); index them safely.
    return tokens.long().masked_fill(~mask, 0), mask


def check_embeddings(
    embeddings,
    mask,
    embedding_size: int,
    name: str = "embeddings",
    dtype: torch.dtype | None = None,
    device=None,
    empty_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [B, n, D], mask [B, n] bool)`` of floating, finite embeddings, D = ``embedding_size``;
    padded positions read as 0 (and may hold anything, NaN included). ``name``: the
    argument's name in messages (a layer calls its input ``hidden``). ``dtype``: cast x to it
    (a CRF's dtype); a finite value too large for it is refused as an overflow. ``device``: the
    model's, where x and its mask must be. ``empty_rows``: a row of padding only is allowed."""
    if not isinstance(embeddings, torch.Tensor) or not embeddings.dtype.is_floating_point:
        found = getattr(embeddings, "dtype", type(embeddings).__name__)
        raise TypeError(f"{name} must be a floating torch.Tensor [B, n, D], got {found}")
    if embeddings.dim() != 3 or embeddings.shape[-1] != embedding_size or 0 in embeddings.shape[:2]:
        raise ValueError(
            f"{name} must have shape [batch, length, {embedding_size}] (embedding_size), non-empty, "
            f"got {tuple(embeddings.shape)}"
        )
    check_device(name, embeddings, device)
    lengths_only = torch.zeros(embeddings.shape[:2], dtype=torch.long, device=embeddings.device)
    if mask is None:
        mask = torch.ones_like(lengths_only, dtype=torch.bool)
    else:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a torch.bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        if mask.shape != lengths_only.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} must equal {name}' [B, n] {tuple(lengths_only.shape)}")
        check_device("mask", mask, embeddings.device, f"the {name}'")
    given = embeddings
    embeddings = embeddings if dtype is None else embeddings.to(dtype)
    if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        if not empty_rows:
            refuse_empty_rows(mask)
        # after the cast (a finite float64 1e39 is inf in float32): NaN at a real token poisons its row
        refuse_non_finite(name, embeddings, where=mask, given=given)
    return embeddings.masked_fill(~mask[..., None], 0.0), mask


def check_assignment(name: str, value, shape: tuple[int, ...], size: int) -> torch.Tensor:
    """An integer tensor ``value`` of ``shape`` with values in ``[0, size)``, as long."""
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of shape {shape}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    if value.numel() and (value.min() < 0 or value.max() >= size):
        raise ValueError(f"{name} values must lie in [0, {size})")
    return value.long()


def refuse_empty_rows(mask: torch.Tensor) -> None:
    """Every row needs a real token (no host read unless one has none)."""
    refuse_unless(
        mask.any(dim=1).all(),
        "mask leaves a row with no tokens; every row needs >= 1 token",
        lambda: (
            f"mask leaves rows {(~mask.any(dim=1)).nonzero().flatten().tolist()} with no tokens; "
            "every row needs >= 1 token"
        ),
    )
