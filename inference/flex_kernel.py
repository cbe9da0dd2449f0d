"""The head messages (``inference.head_kernels``'s docstring) through torch's flex_attention.

One attention head per (channel c, distance group k), head h = c * K + k: it attends with
group k's query and key over the arcs of group k only (a block mask built from the
structure), so its log-normaliser lse_k covers exactly the row's arcs of group k. The row
lse merges them by log-sum-exp with the null head (logit 0 on rows with no legal head), and
group k's forward message is its output times exp(lse_k - lse). The reverse message is the
same attention with queries and keys swapped and the key bias ``-lse`` of the forward rows,
un-normalised by its own lse (as in ``head_kernels.fused``). A ``bias [K, C]`` on the scores
of group k, channel c is a constant per head: it shifts that head's lse and nothing else.
Projections with a group axis of size 1 (one shared by every group) are flex's grouped-query
attention: C key/value heads, each read by its channel's K query heads (the queries are
repeated per group; keys and values are not), and the messages are summed over the groups.

Memory: the projections in head layout and the per-head lse, O(n); the block masks'
metadata, O((n / 128)^2) per head; the compiled kernels keep nothing n x n. The block masks
are built from ``structure.arcs`` one slab of 128 rows at a time.

Where it runs: on CUDA, the compiled flex_attention (Triton; ``BACKEND="TRITON"``, whose
backward differentiates through the lse; flex's FLASH backend does not). On the CPU,
flex_attention's compiled kernel neither returns the lse nor has a backward, so the kernel
runs flex_attention's eager reference (it materialises the scores, is differentiable, and
reads the same block masks): correct, for tests, not memory-linear. The Triton kernel keeps
its lse in float32 whatever the inputs' type, so ``compute_dtype=torch.float64`` (which
``MeanField`` asks for past a score bound of 512) still merges float32 normalisers there:
about |score| 2**-24 relative, as the fused kernel in float32 (float64 on CUDA is untested
here). Under TF32 matmuls (``torch.set_float32_matmul_precision("high")``) the Triton
kernel rounds its dot products, the reverse's ``-lse`` column included, to TF32.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch._higher_order_ops.flex_attention import flex_attention as _flex_reference
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from inference.head_kernels import HeadMessages, HeadStructure

__all__ = ["flex", "flex_available"]

BLOCK = 128  # flex_attention's default sparse block size
# Triton's tl.dot wants head dimensions of at least 16: projections are zero-padded to it
_MIN_HEAD_DIM = 16
# the Triton backend: the FLASH backend's backward does not differentiate through the lse
_KERNEL_OPTIONS = {"BACKEND": "TRITON"}


@functools.cache
def _compiled_flex_attention():
    """Compiled on first use, not at import: torch.compile pulls in sympy and networkx,
    which an exported model's runtime must not need."""
    return torch.compile(flex_attention)


def flex_available(device: torch.device) -> bool:
    """Where the flex kernel is memory-linear (compiled); elsewhere it runs eager."""
    return device.type == "cuda"


def _same_score(score, batch, head, q_idx, kv_idx):
    return score


def _group_of(q_idx, kv_idx, structure: HeadStructure):
    """The distance group of arc (q_idx -> kv_idx), index arithmetic only (usable inside a
    mask_mod): the same rule as ``graphs.topology.distance_groups`` and ``head_kernels.fused``.
    The diagonal (never an arc) gets a left group here, group 0 there: no arc reads it."""
    offset = kv_idx - q_idx
    distance = offset.abs()
    bucket = torch.zeros_like(distance)
    for cut in structure.bucket_cuts:
        bucket = bucket + (distance >= cut).to(distance.dtype)
    token_group = torch.where(offset > 0, bucket, bucket + (structure.gamma + 1))
    virtual = (q_idx >= structure.n) | (kv_idx >= structure.n)
    return torch.where(virtual, structure.virtual_group, token_group)


def _block_counts(structure: HeadStructure, groups: int) -> torch.Tensor:
    """``[B, K, nb, nb]``: per group, the number of arcs in each 128 x 128 block (padding
    beyond N counts as no arc, so an edge block is never full). One slab of rows at a time:
    at most ``B K 128 N`` booleans exist at once."""
    arcs = structure.arcs
    B, N = arcs.shape[0], arcs.shape[-1]
    nb = -(-N // BLOCK)
    columns = torch.arange(N, device=arcs.device)
    group_ids = torch.arange(groups, device=arcs.device)[:, None, None]
    slabs = []
    for start in range(0, N, BLOCK):
        rows = columns[start : start + BLOCK]
        in_group = _group_of(rows[:, None], columns[None, :], structure) == group_ids  # [K, R, N]
        slab = arcs[:, None, start : start + BLOCK] & in_group  # [B, K, R, N]
        slab = F.pad(slab, (0, nb * BLOCK - N, 0, BLOCK - rows.numel()))
        slabs.append(slab.view(B, groups, BLOCK, nb, BLOCK).sum((2, 4), dtype=torch.int32))
    return torch.stack(slabs, 2)


def _block_mask(counts: torch.Tensor, channels: int, mask_mod, size: int) -> BlockMask:
    """A BlockMask over heads h = c * K + k from the per-group block counts: blocks with every
    arc are "full" (no mask_mod there), blocks with some are partial."""

    def ordered(blocks: torch.Tensor):
        blocks = blocks.to(torch.int32).repeat(1, channels, 1, 1)
        indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
        return blocks.sum(-1, dtype=torch.int32), indices.to(torch.int32)

    full = counts == BLOCK * BLOCK
    partial_blocks, partial_indices = ordered((counts > 0) & ~full)
    full_blocks, full_indices = ordered(full)
    return BlockMask.from_kv_blocks(
        partial_blocks, partial_indices, full_blocks, full_indices, BLOCK, mask_mod, (size, size)
    )


def _block_masks(structure: HeadStructure, groups: int, channels: int) -> tuple[BlockMask, BlockMask]:
    """The block masks of the forward attention (row i over its heads j) and of the reverse
    one (head i over its dependents j): each other's transpose."""
    arcs = structure.arcs

    def forward_mask(batch, head, q_idx, kv_idx):
        return arcs[batch, q_idx, kv_idx] & (_group_of(q_idx, kv_idx, structure) == head % groups)

    def reverse_mask(batch, head, q_idx, kv_idx):
        return arcs[batch, kv_idx, q_idx] & (_group_of(kv_idx, q_idx, structure) == head % groups)

    counts = _block_counts(structure, groups)
    size = arcs.shape[-1]
    return (
        _block_mask(counts, channels, forward_mask, size),
        _block_mask(counts.transpose(-1, -2), channels, reverse_mask, size),
    )


def _attention(q, k, v, block_mask: BlockMask):
    """``softmax(q k^T + mask) v`` and its natural-log lse (``-inf`` on rows with no key, whose
    output is 0), differentiable in q, k, v and the lse. Fewer key/value heads than query
    heads: query head h reads key/value head h // (H_q / H_kv)."""
    width = v.shape[-1]
    pad = lambda t: F.pad(t, (0, max(0, _MIN_HEAD_DIM - t.shape[-1])))  # noqa: E731
    q, k, v = pad(q), pad(k), pad(v)
    if q.device.type == "cpu":  # the eager reference (see the module docstring)
        options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
        out, lse_base2, _ = _flex_reference(q, k, v, _same_score, block_mask.as_tuple(), 1.0, options)  # GQA too
        lse = lse_base2 * math.log(2)  # the reference returns the kernels' base-2 lse
    else:
        attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
        options = dict(scale=1.0, enable_gqa=k.shape[1] != q.shape[1], kernel_options=_KERNEL_OPTIONS)
        out, aux = attend(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True), **options)
        lse = aux.lse
    return out[..., :width], lse.to(out.dtype)  # the Triton kernel keeps lse in float32


def flex(
    query,
    key,
    value,
    value_rev,
    scale: float,
    structure: HeadStructure,
    messages: bool = True,
    compute_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> HeadMessages:
    """The contract of ``head_kernels.fused`` (half precision computed in float32, a wider
    ``compute_dtype`` on request, ``bias [K, C]`` added to the scaled scores of group k,
    channel c, a group axis of size 1 shared by every group)."""
    if structure.prior is not None:
        raise ValueError("the flex kernel has no head prior (adaptive span); use kernel='naive'")
    groups, channels = _group_count(structure), query.shape[3]
    if query.shape[2] not in (1, groups):
        raise ValueError(f"query must have a group axis of 1 or K = {groups} (the structure's), got {query.shape[2]}")
    if bias is not None and tuple(bias.shape) != (groups, channels):
        raise ValueError(f"bias must have shape [K, C] = [{groups}, {channels}], got {list(bias.shape)}")
    dtype = query.dtype
    wide = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if compute_dtype is not None and torch.finfo(compute_dtype).bits > torch.finfo(wide).bits:
        wide = compute_dtype
    bias = None if bias is None else bias.to(wide)
    result = _flex(*(t.to(wide) for t in (query, key, value, value_rev)), scale, structure, messages, bias)
    narrow = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return HeadMessages(narrow(result.forward), narrow(result.reverse), narrow(result.lse), query=query, key=key)


def _group_count(structure: HeadStructure) -> int:
    """K: both directions' buckets, plus the virtual group where there are virtual nodes."""
    return structure.virtual_group + (1 if structure.nodes.shape[1] > structure.n else 0)


def _flex(query, key, value, value_rev, scale: float, structure: HeadStructure, messages: bool, bias) -> HeadMessages:
    B, N, slots, C, r = query.shape  # slots = 1: one projection shared by every group
    K = _group_count(structure)

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, N, G, C, w] -> [B, C * G, N, w]
        return t.permute(0, 3, 2, 1, 4).reshape(B, C * t.shape[2], N, t.shape[-1])

    def query_heads(t: torch.Tensor) -> torch.Tensor:  # -> [B, C * K, N, w]: one per group
        return heads(t.expand(B, N, K, C, t.shape[-1]))

    def messages_of(out: torch.Tensor) -> torch.Tensor:  # [B, C * K, N, w] -> [B, N, slots, C, w]
        out = out.reshape(B, C, K, N, out.shape[-1])
        out = out.sum(2, keepdim=True) if slots == 1 else out
        return out.permute(0, 3, 2, 1, 4)

    forward_mask, reverse_mask = _block_masks(structure, K, C)
    key_h = heads(key)
    # the scale goes into the queries (any finite scale, 0 included)
    out, lse_parts = _attention(scale * query_heads(query), key_h, heads(value) if messages else key_h, forward_mask)
    lse_parts = lse_parts.view(B, C, K, N)
    if bias is not None:
        lse_parts = lse_parts + bias.T[None, :, :, None]
    null = torch.where(structure.has_head, -math.inf, 0.0).to(lse_parts.dtype)  # [B, N]
    lse = torch.cat([null[:, None, None].expand(B, C, 1, N), lse_parts], 2).logsumexp(2)  # [B, C, N]
    if not messages:  # the ELBO needs only the normalisers
        return HeadMessages(None, None, lse)

    # a group with no arc in a row has lse_k = -inf: weight 0, gradient 0
    weight = (lse_parts - lse[:, :, None]).exp().reshape(B, C * K, N, 1)
    forward = messages_of(weight * out)

    # reverse: head i gathers its dependents j, P(j -> i) = exp(score_ji + bias - lse_j); the
    # key bias -lse_j rides in one extra head dimension (q' = [scale key, 1], k' = [query, -lse])
    q_rev = scale * query_heads(key)
    q_rev = torch.cat([q_rev, torch.ones_like(q_rev[..., :1])], -1)
    key_bias = (-lse)[:, :, None, :, None].expand(B, C, slots, N, 1).reshape(B, C * slots, N, 1)
    k_rev = torch.cat([heads(query), key_bias], -1)
    out_rev, lse_rev = _attention(q_rev, k_rev, heads(value_rev), reverse_mask)
    lse_rev = lse_rev.view(B, C, K, N)
    if bias is not None:
        lse_rev = lse_rev + bias.T[None, :, :, None]
    # lse_rev = log sum_j P(j -> i) <= log N exactly, but each term is exp(score - lse_j) with
    # lse_j rounded elsewhere: past ~1e7 in float32 that can overflow, so cap it (as fused does)
    lse_rev = lse_rev.clamp(max=math.log(N))
    reverse = messages_of(lse_rev.exp().reshape(B, C * K, N, 1) * out_rev)
    return HeadMessages(forward, reverse, lse)
