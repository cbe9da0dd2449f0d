"""The materialised head kernel of the shared ternary form (one projection U, V for every
distance group; distance enters as an additive bias), computed one sentence at a time.

For a sentence b the head logits of every channel, ``S = scale q k^T + additive`` with
``-inf`` on illegal arcs, are one ``[C, N, N]`` block; its row softmax P (with the null
column of ``inference.mean_field.kernels.null_softmax``: logit 0 on rows with no legal head, never
materialised), the log-normaliser and both messages ``P V`` and ``P^T V_rev`` are taken
from it while it is in cache, and P is written straight into the ``[B, C, N, N]`` tensor
that the backward reads. The backward works sentence by sentence in one ``[C, N, N]``
buffer: dP from both messages, dS = P (dP - sum_j dP P + dl), and from dS the gradients
of q, k and the additive bias, so no other ``[B, C, N, N]`` tensor is ever made.

Why: plain operators made three ``[B, C, N, N]`` tensors per iteration (the scores, P's
gradient, and the logits' gradient that autograd hands to the GEMM), each fresh from the
system (67 MB at B = C = 8, n = 512: blocks that large are given back on free and faulted
in again, several times the cost of a block in cache), and every pass of the softmax
and its backward read them from memory.

The exponentials are powers of two (logits scaled by log2 e inside the GEMM, through its
alpha and beta): on CPUs ``exp2`` runs several times faster than ``exp``, and the scale
costs nothing there. Projections are token-major ``[B, N, C, r]``; the messages and the
gradients come back token-major, written by the GEMMs (strided, no copies).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from inference.mean_field.kernels.precision import full_precision

__all__ = ["shared_heads"]

LOG2_E = 1.0 / math.log(2.0)
LN_2 = math.log(2.0)


def _channels(x: torch.Tensor) -> torch.Tensor:
    """One sentence's ``[N, C, r]`` as ``[C, N, r]`` (a view)."""
    return x.transpose(0, 1)


def _logits_into(block, query, key, scale, additive, mask):
    """``log2 e (scale q k^T + additive + mask)`` written into ``block``: the bias and the
    mask (0 / -inf) in one pass, then the GEMM accumulating onto them."""
    q, k = _channels(query), _channels(key)
    if additive is None:
        block.copy_(mask.expand_as(block))
    else:
        torch.add(additive, mask, out=block)
    return torch.baddbmm(block, q, k.mT, beta=LOG2_E, alpha=scale * LOG2_E, out=block)


def _softmax2_(block, no_head):
    """P over ``block`` in place (logits in log2 units, a null logit 0 on ``no_head`` rows);
    returns the natural log-normaliser ``[C, N]``."""
    shift = block.amax(-1, keepdim=True)
    shift = torch.where(no_head, shift.clamp_min(0.0), shift)
    block.sub_(shift).exp2_()
    total = block.sum(-1, keepdim=True) + torch.where(no_head, torch.exp2(-shift), 0.0)
    block.div_(total)
    return (shift + total.log2()).squeeze(-1).mul_(LN_2)


def _forward(query, key, scale, additive, arcs, value, value_rev):
    B, N, C, _ = query.shape
    probs = query.new_empty(B, C, N, N)
    lse = query.new_empty(B, C, N)
    forward = value.new_empty(B, N, C, value.shape[-1])
    reverse = value_rev.new_empty(B, N, C, value_rev.shape[-1])
    mask = torch.where(arcs, 0.0, -math.inf).to(query.dtype)  # [B, N, N]
    no_head = ~arcs.any(-1, keepdim=True)  # [B, N, 1]
    for b in range(B):
        block = _logits_into(probs[b], query[b], key[b], scale, additive, mask[b])
        lse[b] = _softmax2_(block, no_head[b])
        torch.bmm(block, _channels(value[b]), out=_channels(forward[b]))
        torch.bmm(block.mT, _channels(value_rev[b]), out=_channels(reverse[b]))
    return probs, lse, forward, reverse


class _SharedHeads(torch.autograd.Function):
    @staticmethod
    def forward(query, key, scale, additive, arcs, value, value_rev):
        return _forward(query, key, scale, additive, arcs, value, value_rev)

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, scale, additive, _, value, value_rev = inputs
        ctx.scale = scale
        ctx.additive_dtype = None if additive is None else additive.dtype
        ctx.save_for_backward(query, key, value, value_rev, output[0])
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not zeros

    @staticmethod
    @once_differentiable  # GEMMs into views of one output: no graph of the backward itself
    def backward(ctx, grad_probs, grad_lse, grad_forward, grad_reverse):
        query, key, value, value_rev, probs = ctx.saved_tensors
        B, N, C, _ = query.shape
        wants = ctx.needs_input_grad
        grad_query = torch.empty_like(query, memory_format=torch.contiguous_format) if wants[0] else None
        grad_key = torch.empty_like(key, memory_format=torch.contiguous_format) if wants[1] else None
        # summed over the sentences: in float32 at least (one rounding per sentence in bf16)
        wide = torch.promote_types(probs.dtype, torch.float32)
        grad_additive = probs.new_zeros(C, N, N, dtype=wide) if ctx.additive_dtype and wants[3] else None
        wants_value = wants[5] and grad_forward is not None  # V is read by the forward message only
        wants_value_rev = wants[6] and grad_reverse is not None
        grad_value = torch.empty_like(value, memory_format=torch.contiguous_format) if wants_value else None
        grad_value_rev = torch.empty_like(value_rev, memory_format=torch.contiguous_format) if wants_value_rev else None
        grad = probs.new_empty(C, N, N)  # dP, then dS, of one sentence
        for b in range(B):
            p = probs[b]
            # dP: every use of P accumulated into one block
            if grad_forward is not None:
                torch.bmm(_channels(grad_forward[b]), _channels(value[b]).mT, out=grad)
                if grad_reverse is not None:
                    grad.baddbmm_(_channels(value_rev[b]), _channels(grad_reverse[b]).mT)
            elif grad_reverse is not None:
                torch.bmm(_channels(value_rev[b]), _channels(grad_reverse[b]).mT, out=grad)
            else:
                grad.zero_()
            if grad_probs is not None:
                grad.add_(grad_probs[b])
            if grad_value is not None:
                torch.bmm(p.mT, _channels(grad_forward[b]), out=_channels(grad_value[b]))
            if grad_value_rev is not None:
                torch.bmm(p, _channels(grad_reverse[b]), out=_channels(grad_value_rev[b]))
            # dS = P (dP - sum_j dP P + dl): the row sums as batched dot products
            inner = torch.einsum("cij,cij->ci", grad, p)
            if grad_lse is not None:
                inner = inner - grad_lse[b]
            grad.sub_(inner.unsqueeze(-1)).mul_(p)
            if grad_additive is not None:
                grad_additive.add_(grad)
            if grad_query is not None:
                torch.baddbmm(
                    _channels(grad_query[b]),
                    grad,
                    _channels(key[b]),
                    beta=0.0,
                    alpha=ctx.scale,
                    out=_channels(grad_query[b]),
                )
            if grad_key is not None:
                torch.baddbmm(
                    _channels(grad_key[b]),
                    grad.mT,
                    _channels(query[b]),
                    beta=0.0,
                    alpha=ctx.scale,
                    out=_channels(grad_key[b]),
                )
        if grad_additive is not None:
            grad_additive = grad_additive.to(ctx.additive_dtype)
        return grad_query, grad_key, None, grad_additive, None, grad_value, grad_value_rev


@full_precision
def shared_heads(query, key, scale: float, additive, arcs, value, value_rev):
    """``(P [B, C, N, N], lse [B, C, N], P V [B, N, C, r], P^T V_rev [B, N, C, r])`` for
    token-major projections ``[B, N, C, r]``: the head logits ``scale q_i . k_j +
    additive[c, i, j]`` (``additive [C, N, N]`` or None) on the legal arcs ``arcs [B, N, N]``,
    a null logit 0 on rows with none. ``scale`` is a number (a constant: no gradient); the
    backward is differentiable once (no double backward)."""
    if isinstance(scale, torch.Tensor) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a Python number (a constant of the kernel), got {type(scale).__name__}")
    inputs = (query, key, value, value_rev) + (() if additive is None else (additive,))
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _SharedHeads.apply(query, key, scale, additive, arcs, value, value_rev)
    return _forward(query, key, scale, additive, arcs, value, value_rev)
