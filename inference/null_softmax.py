"""The head distribution of the materialised (naive) head kernel: a row softmax over the
head logits ``[B, C, N, N]`` with a null column (logit 0 on the rows that have no legal head,
never materialised), its log-normaliser, and the two head messages read from it, with their
backward passes written out.

Why written out: at n = 512 every fresh ``[B, C, N, N]`` tensor costs more in page faults
than the arithmetic on it (blocks that large go back to the system when freed and are
faulted in again on the next use: 28 ms to allocate and fill 67 MB against 5 ms to fill a
reused buffer, one thread). Autograd through the plain operators made six such tensors per
iteration and the concatenated null column a strided copy of P; ``softmax_with_null`` makes
one in its backward, ``probs_and_messages`` (the shared ternary form: one projection for
every distance group) one for the softmax and both messages together, accumulating the
messages' gradients into it in place.

Gradients: with P = softmax and l the log-normaliser of logits x per row,
dx = P * (dP - sum_j(dP * P) + dl), where dP collects every use of P (its own, and the
messages P V and (V_rev^T P)^T).
"""

from __future__ import annotations

import torch

__all__ = ["softmax_with_null", "probs_and_messages"]


def _softmax(logits: torch.Tensor, no_head: torch.Tensor, overwrite: bool = False):
    """``(P, l)``: one max, one exp, one sum and one division, in place on one new tensor
    (``overwrite``: on ``logits`` itself)."""
    # the shift: the row maximum, counting the null logit 0 where there is one
    shift = logits.amax(-1, keepdim=True)
    shift = torch.where(no_head, shift.clamp_min(0.0), shift)
    unnormalised = (logits.sub_(shift) if overwrite else torch.sub(logits, shift)).exp_()
    total = unnormalised.sum(-1, keepdim=True) + torch.where(no_head, shift.neg().exp(), 0.0)
    return unnormalised.div_(total), (shift + total.log()).squeeze(-1)


def _logits_gradient(grad_probs, probs, grad_lse, into: torch.Tensor | None = None):
    """dx = P * (dP - sum_j(dP * P) + dl), written into ``into`` if given (e.g. ``grad_probs``
    itself, when the caller owns it), else into one new tensor."""
    # the row sums as batched dot products: no [B, C, N, N] product
    inner = torch.einsum("...j,...j->...", grad_probs, probs).unsqueeze(-1)
    if grad_lse is not None:
        inner = inner - grad_lse.unsqueeze(-1)
    return torch.sub(grad_probs, inner, out=into).mul_(probs)


def _probs_and_messages(logits, no_head, value, value_rev, overwrite: bool):
    probs, lse = _softmax(logits, no_head, overwrite)
    # (V_rev^T P)^T, not P^T V_rev: the same products, and P's gradient from it row-major
    return probs, lse, probs @ value, (value_rev.mT @ probs).mT


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
        return _logits_gradient(grad_probs, probs, grad_lse), None  # autograd's buffer: not overwritten


class _ProbsAndMessages(torch.autograd.Function):
    @staticmethod
    def forward(logits, no_head, value, value_rev, overwrite):
        return _probs_and_messages(logits, no_head, value, value_rev, overwrite)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, _, value, value_rev, overwrite = inputs
        if overwrite:
            ctx.mark_dirty(logits)
        ctx.save_for_backward(output[0], value, value_rev)
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not zeros

    @staticmethod
    def backward(ctx, grad_probs, grad_lse, grad_forward, grad_reverse):
        probs, value, value_rev = ctx.saved_tensors
        B, C, N, _ = probs.shape
        grad = None  # dP, one new [B, C, N, N] tensor, every use of P accumulated into it
        if grad_forward is not None:
            grad = grad_forward @ value.mT
        if grad_reverse is not None:
            if grad is None:
                grad = value_rev @ grad_reverse.mT
            else:
                flat = grad.view(B * C, N, N)
                flat.baddbmm_(value_rev.reshape(B * C, N, -1), grad_reverse.reshape(B * C, N, -1).mT)
        if grad is not None:
            if grad_probs is not None:
                grad.add_(grad_probs)
            grad_logits = _logits_gradient(grad, probs, grad_lse, into=grad)
        elif grad_probs is not None:  # autograd's buffer: not overwritten
            grad_logits = _logits_gradient(grad_probs, probs, grad_lse)
        else:
            grad_logits = probs * grad_lse.unsqueeze(-1)
        grad_value = probs.mT @ grad_forward if grad_forward is not None and ctx.needs_input_grad[2] else None
        grad_value_rev = probs @ grad_reverse if grad_reverse is not None and ctx.needs_input_grad[3] else None
        return grad_logits, None, grad_value, grad_value_rev, None


def _needs_graph(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def softmax_with_null(logits: torch.Tensor, has_head: torch.Tensor):
    """``(P [B, C, N, N], l [B, C, N])``: the row softmax and log-normaliser of ``logits``
    with a null column of logit 0 on the rows where ``has_head [B, N]`` is False."""
    no_head = ~has_head[:, None, :, None]  # [B, 1, N, 1]
    if _needs_graph(logits):
        return _SoftmaxWithNull.apply(logits, no_head)
    return _softmax(logits, no_head)


def probs_and_messages(logits, has_head, value, value_rev, overwrite: bool = False):
    """``(P, l, P V, (V_rev^T P)^T)`` for ``value, value_rev [B, C, N, r]``: the softmax of
    ``softmax_with_null`` and both head messages of one projection (every group's).
    ``overwrite``: P is written over ``logits`` (the caller reads them no more; a non-leaf
    tensor whose producer's backward does not need it, e.g. a GEMM's output)."""
    no_head = ~has_head[:, None, :, None]
    # torch.compile plans its own buffers (and refuses an in-place Function on its views)
    overwrite = overwrite and not torch.compiler.is_compiling()
    if _needs_graph(logits, value, value_rev):
        return _ProbsAndMessages.apply(logits, no_head, value, value_rev, overwrite)
    return _probs_and_messages(logits, no_head, value, value_rev, overwrite)
