"""The head messages (``inference.mean_field.kernels.head_kernels``'s docstring) through torch's flex_attention.

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
metadata, O((n / 128)^2) per head, built once per batch from tables cached per topology
(``inference.mean_field.kernels.flex_masks``); the mask_mod reads the nodes, O(B n), and the
topology's band or token table (``[n, n]``; ``[B, n, n]`` bool for a topology of each row's
length); the compiled kernels keep nothing n x n of their own.

Where it runs: on CUDA, the compiled flex_attention (Triton; ``BACKEND="TRITON"``, whose
backward differentiates through the lse; flex's FLASH backend does not). Compiled once per
configuration (``_compiled``): shapes are dynamic, and the configuration is the key of a
bounded cache, each entry with its own recompile budget; a recompile past Dynamo's limit
raises instead of falling back to eager. On the CPU, flex_attention's compiled kernel
neither returns the lse nor has a backward, so the kernel runs flex_attention's eager
reference (it materialises the scores, is differentiable, and reads the same block masks):
correct, for tests, not memory-linear; ``MeanField`` refuses it for training there.
Precision: computed in float32 at least, outside autocast (``kernel_precision``); float64
runs the eager reference, never the Triton kernel (``MeanField`` routes float64 on CUDA to
the fused kernel). Under TF32 matmuls (``torch.set_float32_matmul_precision("high")``) the
Triton kernel rounds its dot products, the reverse's ``-lse`` column included, to TF32.
"""

from __future__ import annotations

import functools
import math
import types

import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F
from torch._higher_order_ops.flex_attention import flex_attention as _flex_reference
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from inference.mean_field.kernels.flex_masks import BLOCK, block_masks, group_count
from inference.mean_field.kernels.precision import full_precision
from inference.mean_field.kernels.structure import HeadMessages, HeadStructure

__all__ = ["flex", "flex_available", "COMPILE_BACKEND", "COMPILED_DEVICES"]

# Triton's tl.dot wants head dimensions of at least 16: projections are zero-padded to it
_MIN_HEAD_DIM = 16
# the Triton backend: the FLASH backend's backward does not differentiate through the lse
_KERNEL_OPTIONS = {"BACKEND": "TRITON"}
# float32 dot products on CUDA: three TF32 tensor-core products (hi*hi + hi*lo + lo*hi), close
# to float32's precision (the scores reach hundreds, so plain TF32 errs by tenths); Triton's
# "ieee" float32 dot runs without tensor cores and starves the kernel
_CUDA_FLOAT32_PRECISION = "'tf32x3'"
# the block masks' block size (flex_masks.BLOCK); benchmarks/flex_options times smaller ones,
# with kernel tiles that divide it
_MASK_BLOCK = BLOCK


def _kernel_options(device: torch.device) -> dict:
    if device.type == "cuda" and torch.version.hip is None:  # ROCm's Triton has no tf32x3
        return {**_KERNEL_OPTIONS, "FLOAT32_PRECISION": _CUDA_FLOAT32_PRECISION}
    return _KERNEL_OPTIONS


# where the compiled kernel runs, and through which torch.compile backend (tests run the
# compiled path on the CPU with "aot_eager", without gradients)
COMPILED_DEVICES = frozenset({"cuda"})
COMPILE_BACKEND = "inductor"


@functools.lru_cache(maxsize=32)
def _compiled(configuration: tuple):
    """A compiled flex_attention for one configuration (device, dtype, gradients, heads, head
    dimensions, and whether the batch or the block count is 1, which Dynamo specialises).
    Each is a function of its own code object, so each has its own recompile budget; shapes
    within it are dynamic. Compiled on first use, not at import: torch.compile pulls in
    sympy and networkx, which an exported model's runtime must not need."""
    # a copy of _attend's code object: Dynamo keeps one cache (and budget) per code object
    code = _attend.__code__.replace(co_name=f"attend_{len(_CONFIGURATIONS)}")
    _CONFIGURATIONS.append(configuration)
    attend = types.FunctionType(code, _attend.__globals__, code.co_name)
    return torch.compile(attend, backend=configuration[0], dynamic=True, fullgraph=True)


_CONFIGURATIONS: list[tuple] = []  # the configurations compiled so far, in order


def _attend(*args, **kwargs):
    return flex_attention(*args, **kwargs)


def _no_duck_shapes():
    from torch.fx.experimental import _config as shape_config  # torch.compile's own, imported on use

    return shape_config.patch(use_duck_shape=False)


def flex_available(device: torch.device) -> bool:
    """Where the flex kernel is memory-linear (compiled); elsewhere it runs eager."""
    return device.type == "cuda"


def _head_dim(width: int) -> int:
    """The head dimension a projection is zero-padded to: at least 16, and a power of two
    where this torch's flex_attention accepts no other (older releases refuse, e.g., the
    reverse attention's r + 1)."""
    if width <= _MIN_HEAD_DIM:
        return _MIN_HEAD_DIM
    supported = getattr(flex_module, "_supported_head_dim", None)
    return width if supported is None or supported(width) else 1 << (width - 1).bit_length()


def _same_score(score, batch, head, q_idx, kv_idx):
    return score


def _attention(q, k, v, block_mask, kind: tuple = ()):
    """``softmax(q k^T + mask) v`` and its natural-log lse (``-inf`` on rows with no key, whose
    output is 0), differentiable in q, k, v and the lse. Fewer key/value heads than query
    heads: query head h reads key/value head h // (H_q / H_kv). ``kind``: what the mask_mod's
    code and constants are (the topology's kind), part of the compiled configuration."""
    width = v.shape[-1]
    pad = lambda t: F.pad(t, (0, _head_dim(t.shape[-1]) - t.shape[-1]))  # noqa: E731  (zeros: same dot products)
    q, k, v = pad(q), pad(k), pad(v)
    gqa = k.shape[1] != q.shape[1]
    if q.device.type not in COMPILED_DEVICES or q.dtype == torch.float64:  # the eager reference (docstring)
        options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
        out, lse_base2, _ = _flex_reference(q, k, v, _same_score, block_mask.as_tuple(), 1.0, options)  # GQA too
        lse = lse_base2 * math.log(2)  # the reference returns the kernels' base-2 lse
    elif torch.compiler.is_compiling():  # inside a compiled model: traced into its graph
        out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=1.0, enable_gqa=gqa,
                                  return_aux=AuxRequest(lse=True),
                                  kernel_options=_kernel_options(q.device))  # fmt: skip
        lse = aux.lse
    else:
        out, lse = _run_compiled(q, k, v, block_mask, gqa, kind)
    return out[..., :width], lse.to(out.dtype)  # the Triton kernel keeps lse in float32


def _run_compiled(q, k, v, block_mask, gqa: bool, kind: tuple):
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    configuration = (COMPILE_BACKEND, q.device.type, q.dtype, grad, q.shape[1], k.shape[1], q.shape[-1],
                     v.shape[-1], q.shape[0] == 1, q.shape[2] <= block_mask.BLOCK_SIZE[0], block_mask.mask_mod.__code__,
                     kind)  # fmt: skip
    attend = _compiled(configuration)
    options = dict(scale=1.0, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    if COMPILE_BACKEND == "inductor":
        options["kernel_options"] = _kernel_options(q.device)
    # past the recompile limit Dynamo would run flex eagerly (O(n^2) memory) with a warning;
    # duck sizing would tie sizes that happen to be equal (a batch of 2 and 2 blocks)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), _no_duck_shapes():
        out, aux = attend(q, k, v, block_mask=block_mask, **options)
    return out, aux.lse


@full_precision
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
    groups, channels = group_count(structure), query.shape[3]
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


def _flex(query, key, value, value_rev, scale: float, structure: HeadStructure, messages: bool, bias) -> HeadMessages:
    B, N, slots, C, r = query.shape  # slots = 1: one projection shared by every group
    K = group_count(structure)

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, N, G, C, w] -> [B, C * G, N, w]
        return t.permute(0, 3, 2, 1, 4).reshape(B, C * t.shape[2], N, t.shape[-1])

    def query_heads(t: torch.Tensor) -> torch.Tensor:  # -> [B, C * K, N, w]: one per group
        return heads(t.expand(B, N, K, C, t.shape[-1]))

    def messages_of(out: torch.Tensor) -> torch.Tensor:  # [B, C * K, N, w] -> [B, N, slots, C, w]
        out = out.reshape(B, C, K, N, out.shape[-1])
        out = out.sum(2, keepdim=True) if slots == 1 else out
        return out.permute(0, 3, 2, 1, 4)

    forward_mask, reverse_mask = block_masks(structure, K, C, _MASK_BLOCK)
    # the topology's kind: what the mask_mods hold as constants (lengths are tensors there)
    kind = (structure.band, structure.bucket_cuts, structure.gamma, structure.virtual, structure.row_tokens)
    key_h = heads(key)
    # the scale goes into the queries (any finite scale, 0 included)
    values = heads(value) if messages else key_h
    out, lse_parts = _attention(scale * query_heads(query), key_h, values, forward_mask, kind)
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
    out_rev, lse_rev = _attention(q_rev, k_rev, heads(value_rev), reverse_mask, kind)
    lse_rev = lse_rev.view(B, C, K, N)
    if bias is not None:
        lse_rev = lse_rev + bias.T[None, :, :, None]
    # lse_rev = log sum_j P(j -> i) <= log N exactly, but each term is exp(score - lse_j) with
    # lse_j rounded elsewhere: past ~1e7 in float32 that can overflow, so cap it (as fused does)
    lse_rev = lse_rev.clamp(max=math.log(N))
    reverse = messages_of(lse_rev.exp().reshape(B, C * K, N, 1) * out_rev)
    return HeadMessages(forward, reverse, lse)
