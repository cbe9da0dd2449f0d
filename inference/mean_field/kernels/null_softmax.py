"""The head distribution of the materialised (naive) head kernel: a row softmax over the
head logits ``[B, C, N, N]`` with a null column (logit 0 on the rows that have no legal head,
never materialised) and its log-normaliser, with the backward pass written out.

Why written out: at n = 512 every fresh ``[B, C, N, N]`` tensor costs more in page faults
than the arithmetic on it (blocks that large go back to the system when freed and are
faulted in again on the next use, several times the cost of filling a reused buffer;
docs/benchmarks.md has the measurements). Autograd through the plain operators made several such tensors
per iteration and the concatenated null column a strided copy of P; ``softmax_with_null``
makes one, in its backward. (The shared ternary form goes further, one sentence at a time:
``inference.mean_field.kernels.shared_heads``.)

Gradients: with P = softmax and l the log-normaliser of logits x per row,
dx = P * (dP - sum_j(dP * P) + dl).
"""

from __future__ import annotations

import torch

__all__ = ["softmax_with_null"]


def _softmax(logits: torch.Tensor, no_head: torch.Tensor):
    """``(P, l)``: one max, one exp, one sum and one division, in place on one new tensor."""
    # the shift: the row maximum, counting the null logit 0 where there is one
    shift = logits.amax(-1, keepdim=True)
    shift = torch.where(no_head, shift.clamp_min(0.0), shift)
    unnormalised = torch.sub(logits, shift).exp_()
    total = unnormalised.sum(-1, keepdim=True) + torch.where(no_head, shift.neg().exp(), 0.0)
    return unnormalised.div_(total), (shift + total.log()).squeeze(-1)


def _logits_gradient(grad_probs, probs, grad_lse):
    """dx = P * (dP - sum_j(dP * P) + dl), in one new tensor (``grad_probs`` is autograd's
    buffer: not overwritten)."""
    # the row sums as batched dot products: no [B, C, N, N] product
    inner = torch.einsum("...j,...j->...", grad_probs, probs).unsqueeze(-1)
    if grad_lse is not None:
        inner = inner - grad_lse.unsqueeze(-1)
    return torch.sub(grad_probs, inner).mul_(probs)


class _SoftmaxWithNull(torch.autograd.Function):
    @staticmethod
    def forward(logits, no_head):
        return _softmax(logits, no_head)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[0])
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not zeros

    @staticmethod
    def backward(ctx, grad_probs, grad_lse):
        (probs,) = ctx.saved_tensors
        if grad_probs is None:
            return probs * grad_lse.unsqueeze(-1), None
        return _logits_gradient(grad_probs, probs, grad_lse), None


def _needs_graph(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def softmax_with_null(logits: torch.Tensor, has_head: torch.Tensor):
    """``(P [B, C, N, N], l [B, C, N])``: the row softmax and log-normaliser of ``logits``
    with a null column of logit 0 on the rows where ``has_head [B, N]`` is False."""
    no_head = ~has_head[:, None, :, None]  # [B, 1, N, 1]
    if _needs_graph(logits):
        return _SoftmaxWithNull.apply(logits, no_head)
    return _softmax(logits, no_head)
