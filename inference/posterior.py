"""What every engine returns: marginals of the CRF's variables (and, for
variational engines, the bound they reached)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Posterior"]


@dataclass
class Posterior:
    """Marginals over the nodes of a batch (N = tokens + virtual nodes).

    z: ``[B, N, d]`` label marginals (rows of padded nodes are zero).
    h: ``[B, C, N, N]`` head marginals, ``h[b, c, i, j] = q(H_i^c = j)``; a row is zero
       where node i has no legal head (padding, or a topology such as ``causal`` at i = 0).
    g: ``[B, n, g]`` global-variable marginals, or None.
    log_partition: ``[B]`` exact log Z (exact engines) or None.
    elbo: ``[B]`` evidence lower bound (variational engines) or None.
    logits: ``[B, N, d]`` final unnormalised label logits (variational engines) or None.
    trace: per-iteration diagnostics (variational engines).
    """

    z: torch.Tensor
    h: torch.Tensor | None = None
    g: torch.Tensor | None = None
    log_partition: torch.Tensor | None = None
    elbo: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    trace: dict = field(default_factory=dict)
