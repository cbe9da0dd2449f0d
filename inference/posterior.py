"""What every engine returns: marginals of the CRF's variables (and, for
variational engines, the bound they reached)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Posterior"]


class Posterior:
    """Marginals over the nodes of a batch (N = tokens + virtual nodes).

    The contract every engine keeps: the same fields, every tensor in the CRF's parameter
    dtype (a wider accumulation is cast back), zero rows at padding, and a sentence's fields
    independent of its padding and batch. Which fields each engine fills and which carry
    gradients: the table in docs/api.md ("The Posterior contract").

    z: ``[B, N, d]`` label marginals (rows of padded nodes are zero).
    h: ``[B, C, N, N]`` head marginals, ``h[b, c, i, j] = q(H_i^c = j)``; a row is zero
       where node i has no legal head (padding, or e.g. ``causal`` at i = 0).
    g: ``[B, n, g]`` global-variable marginals, or None.
    log_partition: ``[B]`` exact log Z (exact engines) or None.
    elbo: ``[B]`` evidence lower bound (variational engines) or None.
    logits: ``[B, N, d]`` final unnormalised label logits (variational engines) or None.
    trace: per-iteration diagnostics (variational engines), a dict of tensors.

    history: the label logits ``[B, N, d]`` after each iteration (variational engines).
    halting: per-node halting bookkeeping (``inference.mean_field.halting``) or None.
    ``h``, ``elbo`` and ``trace`` may be given as zero-argument callables: they are
    then computed on first access (an engine that never materialises the ``n x n``
    head marginals builds them only when asked).
    """

    def __init__(
        self,
        z: torch.Tensor,
        h: torch.Tensor | Callable[[], torch.Tensor] | None = None,
        g: torch.Tensor | None = None,
        log_partition: torch.Tensor | None = None,
        elbo: torch.Tensor | Callable[[], torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
        trace: dict | Callable[[], dict] | None = None,
        history: list[torch.Tensor] | None = None,
        halting: dict | None = None,
    ):
        self.z, self.g, self.log_partition, self.logits = z, g, log_partition, logits
        self.history, self.halting = history, halting
        self._lazy = {"h": h, "elbo": elbo, "trace": trace if trace is not None else {}}

    def _get(self, name):
        value = self._lazy[name]
        if callable(value):
            value = self._lazy[name] = value()
        return value

    h = property(lambda self: self._get("h"), doc="head marginals [B, C, N, N] (computed on first access)")
    elbo = property(lambda self: self._get("elbo"), doc="ELBO [B] (computed on first access)")
    trace = property(lambda self: self._get("trace"), doc="per-iteration diagnostics (computed on first access)")

    def __repr__(self) -> str:
        shown = {"z": self.z, "g": self.g, "logits": self.logits, "log_partition": self.log_partition}
        parts = [f"{k}={tuple(v.shape)}" for k, v in shown.items() if isinstance(v, torch.Tensor)]
        return f"Posterior({', '.join(parts)})"
