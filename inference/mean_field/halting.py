"""Per-token halting inside unrolled mean field.

    act   adaptive computation time (Graves 2016, as in the Universal Transformer): after
          each iteration t a token halts with probability p_t; it stops at the first N with
          p_1 + ... + p_N >= 1 - epsilon (or at the last iteration), its output is
          sum_t w_t logits_t with w_t = p_t before N and the remainder R = 1 - sum_{t<N} p_t
          at N, and its ponder cost is N + R.
    exit  confidence-based exit (the depth-adaptive transformer): at inference a token
          stops once its output distribution is confident enough; its output is its
          state at that iteration.

A halted token's label logits are frozen (its neighbours keep reading them). Every
iteration runs for every token and halting is a mask, so the forward pass has no
data-dependent Python control flow: it compiles and exports.
"""

from __future__ import annotations

import torch

from graphs.device_checks import refuse_non_finite

__all__ = ["HALTING", "HALTING_SOURCES", "ACT", "ConfidenceExit", "checked_confidence"]

HALTING = ("none", "act", "exit")
HALTING_SOURCES = ("posterior", "delta")


class ACT:
    """Bookkeeping of adaptive computation time over ``nodes [B, N]``."""

    def __init__(self, nodes: torch.Tensor, epsilon: float, dtype: torch.dtype):
        self.epsilon = epsilon
        self.running = nodes.clone()
        zeros = torch.zeros(nodes.shape, dtype=dtype, device=nodes.device)
        self.cumulative, self.remainder, self.updates = zeros, zeros.clone(), zeros.clone()
        self.weights: list[torch.Tensor] = []
        self.output = None

    def step(self, logits: torch.Tensor, probability: torch.Tensor, last: bool) -> None:
        """Account for one iteration: ``logits [B, N, d]`` the (frozen where halted)
        state after it, ``probability [B, N]`` the halting probability p_t."""
        running = self.running
        self.updates = self.updates + running.to(self.updates.dtype)
        halts = running & ((self.cumulative + probability >= 1 - self.epsilon) | last)
        weight = torch.where(halts, 1 - self.cumulative, torch.where(running, probability, 0.0))
        self.remainder = torch.where(halts, 1 - self.cumulative, self.remainder)
        self.cumulative = self.cumulative + weight
        self.weights.append(weight)
        contribution = weight[..., None] * logits
        self.output = contribution if self.output is None else self.output + contribution
        self.running = running & ~halts

    def summary(self) -> dict:
        """``weights [T, B, N]`` (sum to 1 per node), ``remainder``, ``updates`` (N(t)) and
        ``ponder`` = N(t) + R(t), each ``[B, N]`` (0 on padding)."""
        return {
            "weights": torch.stack(self.weights),
            "remainder": self.remainder,
            "updates": self.updates,
            "ponder": self.updates + self.remainder,
        }


def checked_confidence(halting: str, training: bool, confidence):
    """``forward``'s ``confidence``: None, False (run every iteration: None is returned) or a
    function of the label logits; under ``halting="exit"`` at inference it is required."""
    if halting == "exit" and not training and confidence is None:
        # without it no token could exit: the engine would silently run as halting="none"
        raise ValueError(
            "halting='exit' at inference needs confidence=, a function of the label logits "
            "[B, N, d] -> [B, N] (e.g. lambda logits: logits.softmax(-1).amax(-1)); "
            "confidence=False runs every iteration"
        )
    if confidence is not None and confidence is not False and not callable(confidence):
        raise TypeError(
            "confidence must be a function of the label logits [B, N, d] -> [B, N], False or None, "
            f"got {type(confidence).__name__}"
        )
    return None if confidence is False else confidence


class ConfidenceExit:
    """A node stops once ``confidence >= threshold``; ``updates`` counts its iterations."""

    def __init__(self, nodes: torch.Tensor, threshold: float, dtype: torch.dtype):
        self.threshold = threshold
        self.nodes = nodes
        self.running = nodes.clone()
        self.updates = torch.zeros(nodes.shape, dtype=dtype, device=nodes.device)

    def step(self, confidence: torch.Tensor) -> None:
        # what the caller's function returned: a NaN compares False with the threshold and ended its token
        if not isinstance(confidence, torch.Tensor) or not confidence.is_floating_point():
            found = getattr(confidence, "dtype", type(confidence).__name__)
            raise TypeError(f"confidence(logits) must return a floating tensor [B, N], got {found}")
        if confidence.shape != self.running.shape:
            raise ValueError(
                f"confidence(logits) must return a tensor [B, N] = {tuple(self.running.shape)}, "
                f"got {tuple(confidence.shape)}"
            )
        refuse_non_finite("confidence(logits)", confidence, where=self.nodes)
        self.updates = self.updates + self.running.to(self.updates.dtype)
        self.running = self.running & (confidence < self.threshold)

    def summary(self) -> dict:
        return {"updates": self.updates}
