"""Mean-field messages and expected log-potentials of a CRF's extra templates.

For a factor phi over the labels and a factorised q(Z) = prod_i q_i, E_q[log phi] is
multilinear in the rows q_i, so its gradient with respect to q_i does not depend on q_i:
it is the mean-field message of phi to Z_i (the coordinate-ascent update adds it to the
label logits). ``Pairwise`` has the closed form (``Pairwise.message``); a user factor's
message is the gradient of its ``expected_log_potential``, by autograd. Their
expectations enter the ELBO. Messages enter the label logits with weight 1 (no μP factor).

Torch alone (the numerical core): built per batch by ``MeanField.forward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FactorTerms"]


class FactorTerms:
    """The extra templates of ``crf`` on one batch (``tokens [B, n]``, ``mask [B, n]``)."""

    def __init__(self, factors, tokens: torch.Tensor, mask: torch.Tensor, num_nodes: int):
        self.factors, self.tokens, self.mask, self.num_nodes = list(factors), tokens, mask, num_nodes

    def message(self, q: torch.Tensor) -> torch.Tensor:
        """``[B, N, d]`` the sum of every extra factor's message to the labels, given ``q [B, N, d]``."""
        from graphs.factors import Pairwise

        total = torch.zeros_like(q)
        for factor in self.factors:
            if isinstance(factor, Pairwise):
                message = factor.message(q, self.tokens, self.mask)
                total = total + F.pad(message, (0, 0, 0, self.num_nodes - message.shape[1]))
            else:
                total = total + self._gradient(factor, q)
        return total

    def expected(self, q: torch.Tensor) -> torch.Tensor:
        """``[B]`` the sum of every extra factor's expected log-potential under ``q``."""
        value = q.new_zeros(q.shape[0])
        for factor in self.factors:
            value = value + factor.expected_log_potential(q, self.tokens, self.mask)
        return value

    def _gradient(self, factor, q: torch.Tensor) -> torch.Tensor:
        """d E_q[log phi] / d q by autograd; differentiable (in q and the factor's
        parameters) when gradients are being recorded. Zero for a factor that does not
        read the labels (its expectation is a constant the ELBO gains)."""
        outer_grad = torch.is_grad_enabled()
        with torch.enable_grad():
            source = q if q.requires_grad else q.detach().requires_grad_(True)
            value = factor.expected_log_potential(source, self.tokens, self.mask)
            if not isinstance(value, torch.Tensor) or value.shape != (q.shape[0],):
                raise ValueError(
                    f"{factor.template}.expected_log_potential must return a tensor of shape [B] = [{q.shape[0]}], "
                    f"got {getattr(value, 'shape', type(value).__name__)}"
                )
            if not value.requires_grad:  # a constant in q and in every parameter: no message
                return torch.zeros_like(q)
            # allow_unused: a potential that reads no label (w * length) depends on parameters alone
            (gradient,) = torch.autograd.grad(
                value.sum(), source, create_graph=outer_grad and q.requires_grad, allow_unused=True
            )
        return torch.zeros_like(q) if gradient is None else gradient
