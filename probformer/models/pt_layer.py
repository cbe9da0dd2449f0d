"""PT inference as a layer on another model's hidden states.

``PTLayer`` reads hidden states ``x [B, n, D]`` as the evidence of a CRF over token labels
(``graphs.CRF(embedding_size=D)``: unary potential ``x @ unary``, the usual ternary head
factors on its topology), runs mean field on them and returns the label marginals mapped
back to ``[B, n, D]``. So any encoder can put a few iterations of PT inference where it
would put an attention block::

    x = x + pt_layer(norm(x), mask)      # a residual sub-layer, as in a transformer

The engine is ``inference.MeanField``, the same one the Probabilistic Transformer runs
(fused kernel, μP scales and message weights alike); one-hot hidden states with the PT's
unary table give exactly the PT's posterior.
"""

from __future__ import annotations

import torch
from torch import nn

import graphs
from graphs.device_checks import refuse_non_finite_parameters
from graphs.inputs import check_embeddings
from inference import MeanField

__all__ = ["PTLayer"]


class PTLayer(nn.Module):
    """``[B, n, D]`` hidden states -> ``[B, n, D]``: mean-field label marginals over a CRF
    whose unary potentials are the hidden states, projected back to width ``D``.

    Args:
        hidden_size: D, the width of the hidden states in and out.
        labels, channels, rank, topology, gamma, global_labels: the CRF (``graphs.CRF``).
        iterations, schedule, kernel, weights, mup, dropout: the engine (``inference.MeanField``).
    """

    def __init__(
        self,
        hidden_size: int,
        labels: int = 64,
        channels: int = 4,
        rank: int = 16,
        iterations: int = 2,
        topology="full",
        gamma: int = 3,
        global_labels: int = 0,
        schedule: str = "async",
        kernel: str = "auto",
        weights="reference",
        mup: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.crf = graphs.CRF(
            embedding_size=hidden_size,
            labels=labels,
            channels=channels,
            rank=rank,
            topology=topology,
            gamma=gamma,
            global_labels=global_labels,
        )
        self.mean_field = MeanField(
            self.crf,
            iterations=iterations,
            schedule=schedule,
            kernel=kernel,
            weights=weights,
            mup=mup,
            dropout=dropout,
        )
        self.output = nn.Linear(labels, hidden_size)  # marginals (on the simplex) -> the encoder's width

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [B, n, D]`` (floating) and ``mask [B, n]`` (bool, True for real tokens;
        default all) -> ``[B, n, D]``, zero on padded positions."""
        hidden, mask = self._checked(hidden, mask)
        refuse_non_finite_parameters(self)  # the output map too (the engine checks the CRF's)
        posterior = self.mean_field(embeddings=hidden, mask=mask)
        n = hidden.shape[1]
        marginals = posterior.logits[:, :n].softmax(-1)  # the tokens' labels (virtual nodes dropped)
        return self.output(marginals) * mask[..., None]

    def posterior(self, hidden: torch.Tensor, mask: torch.Tensor | None = None):
        """The engine's ``Posterior`` (label logits, head marginals, ELBO) of these states."""
        return self.mean_field(embeddings=self._checked(hidden, mask)[0], mask=mask)

    def _checked(self, hidden, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own argument checked by its own name (``hidden``: type, shape, finite
        at real tokens once in the CRF's dtype), before the engine reads it as ``embeddings``."""
        dtype, device = self.crf.unary.dtype, self.crf.unary.device
        return check_embeddings(hidden, mask, self.crf.embedding_size, name="hidden", dtype=dtype, device=device)
