"""Messages through the head variables: the attention inside mean field.

Given per-node projections of the label marginals for every distance group k and
channel c (``query = q_z U``, ``key = q_z V``, both ``[B, N, K, C, r]``; r the tables'
rank, d when ``projections.at_label_rank`` re-factored them), the head
marginals are ``P[c, i, j] = softmax_j(scale * query[i, k(i,j), c] . key[j, k(i,j), c])``
over the legal heads j of i, and the messages to the labels are

    forward[i, k, c] = sum_j P[c, i, j] [k(i,j) = k] value[j, k, c]       (from i's head)
    reverse[i, k, c] = sum_j P[c, j, i] [k(j,i) = k] value_rev[j, k, c]   (from i's dependents)

(async mean field: value = key, value_rev = query). Both kernels return these and the
row log-normaliser ``lse [B, C, N]``.

Two conventions every kernel here keeps (and any other head kernel must, e.g. a
flex-attention one with the same signature):

* ``bias [K, C]`` (optional): a head-logit bias per distance group and channel, added
  *after* the scale: the logit of arc i -> j in channel c is
  ``scale * query[i, k, c] . key[j, k, c] + bias[k, c]`` with k = k(i, j). It is a potential
  on the head variable alone (``graphs.ternary``'s "shared" form: a relative-position
  prior), so the attention weight and μP's factor do not multiply it.
* a group axis of size 1 (``[B, N, 1, C, r]``) is one projection shared by every group:
  the scores use it for every k, and the messages come back with a group axis of size 1,
  summed over the groups (what the shared form's back-projection needs). No projection
  is ever copied per group.

``naive`` materialises ``P [B, C, N, N]``: the reference, and the only kernel with
damping, step sizes and dropout on P. ``fused`` never does: the distance groups are
disjoint, so a row's arcs split into near-diagonal bands (one diagonal per group with
|offset| <= gamma, O(n) work), two far attentions (offset > gamma to the right or to
the left, one group each) and the slices touching virtual nodes; their
log-normalisers merge by log-sum-exp. The reverse message of a far part is an
attention with queries and keys swapped whose key bias is ``-lse`` of the forward
rows, un-normalised by its own ``lse`` (so no column sum is ever materialised). The far
attentions run through the CPU flash op in query blocks that skip fully masked keys
(``inference.mean_field.kernels.fused.far_attention``): each block reads only the keys its rows can reach, bounded by
the topology's data (a band's reach, a segment length) where it has them. The fused
kernel's steps (scores per part, row normalisers, messages) are ``fused/kernel.py``.
Each group is read as ``[B, N, C, r]`` (a view of the group-major projections), and the
messages come back as one slot-major tensor (``stacked``).

Rows with no legal head (padding, ``causal`` at i = 0) get a zero row of P and
``lse = 0``: a "null head" of logit 0 is the only choice there, which keeps softmax
and its gradient finite.

``fused`` is finite wherever ``naive`` is (tests/inference/mean_field/kernels/test_head_kernels.py: potentials to
+-1e4, padded rows and sentences, float32/float64/bf16, every topology, with and without
the CPU flash kernel); bf16/fp16 inputs are computed in float32. Its reverse messages
divide by the lse of another row and the parts merge in log space, so in float32 the
messages err by about |score| x 2**-23 relative (~1e-4 at |score| ~ 1e3, O(1) at 1e8, where
ties lose their log 2): ``compute_dtype=torch.float64`` is exact there, and ``MeanField``
asks for it whenever ``score_bound`` of its parameters exceeds 512.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from inference.mean_field.kernels.fused import kernel as fused_kernel
from inference.mean_field.kernels.fused.far_attention import flash_available
from inference.mean_field.kernels.fused.kernel import used_groups
from inference.mean_field.kernels.null_softmax import softmax_with_null
from inference.mean_field.kernels.precision import full_precision
from inference.mean_field.kernels.shared_heads import shared_heads
from inference.mean_field.kernels.structure import HeadMessages, HeadStructure, each_group

__all__ = [
    "HeadStructure",
    "HeadMessages",
    "naive",
    "fused",
    "log_normaliser",
    "fused_available",
    "used_groups",
    "score_bound",
]


def _groups(x: torch.Tensor) -> list[torch.Tensor]:
    """``[B, N, K, C, r]`` -> its K groups, each ``[B, C, N, r]`` (views). One unbind per
    tensor: indexing ``x[:, :, k]`` at every use made the backward zero-fill a full-size
    gradient per use (the largest single cost when profiled)."""
    return [group.transpose(1, 2) for group in x.unbind(2)]


def _unheads(per_group: list[torch.Tensor]) -> torch.Tensor:
    """K tensors ``[B, C, N, r]`` -> ``[B, N, K, C, r]``."""
    return torch.stack(per_group, dim=2).transpose(1, 3)


def group_bias(bias: torch.Tensor, structure: HeadStructure) -> torch.Tensor:
    """``[C, N, N]``: the bias ``[K, C]`` of each arc's distance group."""
    return bias.T[:, structure.groups]


def head_potential(structure: HeadStructure, bias: torch.Tensor | None, dtype: torch.dtype):
    """``[C, N, N]`` or None: what the naive kernel adds to the scaled scores, the bias of
    each arc's group and the adaptive span's log prior."""
    potential = None if bias is None else group_bias(bias, structure)
    if structure.prior is not None:
        potential = structure.prior if potential is None else potential + structure.prior
    return None if potential is None else potential.to(dtype)


# ---- naive ------------------------------------------------------------------------


def naive_logits(query, key, scale, structure: HeadStructure, bias: torch.Tensor | None = None, groups=None):
    """``[B, C, N, N]`` head logits, ``-inf`` on illegal arcs. ``groups``: the group each slot
    of the projections holds (``HeadMessages.groups``; None: slot k is group k)."""
    logits = None
    slots = zip(_groups(query), _groups(key))
    for k, (query_k, key_k) in zip(groups or range(query.shape[2]), slots):  # one pass if shared
        # the scale on the [B, C, N, r] query, not on the [B, C, N, N] scores: one pass over
        # the scores fewer, forward and backward
        scores = (query_k * scale) @ key_k.transpose(-1, -2)
        logits = scores if logits is None else torch.where(structure.groups == k, scores, logits)
    # in place on the fresh scores (their GEMM's backward does not read them), and the mask
    # added as 0 / -inf on [B, 1, N, N]: a masked_fill copied the [B, C, N, N] logits forward
    # and their gradient backward
    potential = head_potential(structure, bias, logits.dtype)
    if potential is not None:
        logits = logits.add_(potential)
    return logits.add_(torch.where(structure.arcs, 0.0, -math.inf).to(logits.dtype)[:, None])


@full_precision
def naive(
    query,
    key,
    value,
    value_rev,
    scale: float,
    structure: HeadStructure,
    *,
    damping: float = 0.0,
    previous_logits: torch.Tensor | None = None,
    step_size: float = 1.0,
    previous_probs: torch.Tensor | None = None,
    dropout: float = 0.0,
    training: bool = False,
    bias: torch.Tensor | None = None,
) -> HeadMessages:
    mixing = step_size != 1.0 and previous_probs is not None
    # head damping reads the logits of the last iteration: kept on the plain path
    shared = value.shape[2] == 1 and not (damping or mixing or (dropout and training))
    # torch.compile and torch.export trace the plain operators below (a Python loop over the
    # batch, of GEMMs into views of one output, is not a graph they plan buffers for, and a
    # dynamic batch has no length to loop over)
    if shared and not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        # one projection for every group: one sentence at a time, P written once, no other
        # [B, C, N, N] tensor forward or backward (inference.mean_field.kernels.shared_heads)
        potential = head_potential(structure, bias, query.dtype)
        probs, lse, forward, reverse = shared_heads(
            query.squeeze(2), key.squeeze(2), scale, potential, structure.arcs, value.squeeze(2), value_rev.squeeze(2)
        )
        return HeadMessages(forward.unsqueeze(2), reverse.unsqueeze(2), lse, probs, None, query, key)
    logits = naive_logits(query, key, scale, structure, bias)
    if damping and previous_logits is not None:
        logits = damping * previous_logits + (1 - damping) * logits
    probs, lse = softmax_with_null(logits, structure.has_head)
    if mixing:
        probs = (1 - step_size) * previous_probs + step_size * probs
    kept = probs
    probs = F.dropout(probs, dropout, training) if dropout else probs
    forward, reverse = [], []
    for k, (value_k, value_rev_k) in enumerate(zip(_groups(value), _groups(value_rev))):
        in_group = probs if value.shape[2] == 1 else probs * (structure.groups == k)  # shared: every group
        forward.append(in_group @ value_k)
        # (V^T P)^T, not P^T V: the same products, and the gradient reaching P from this GEMM
        # is row-major like P's (a transposed one made every pass of the softmax's backward
        # strided)
        reverse.append((value_rev_k.transpose(-1, -2) @ in_group).transpose(-1, -2))
    return HeadMessages(_unheads(forward), _unheads(reverse), lse, kept, logits, query, key)


# ---- fused ------------------------------------------------------------------------


def fused_available(device: torch.device) -> bool:
    return flash_available(device)


@full_precision
def fused(
    query,
    key,
    value,
    value_rev,
    scale: float,
    structure: HeadStructure,
    messages: bool = True,
    compute_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    groups: tuple[int, ...] | None = None,
    back: torch.Tensor | None = None,
) -> HeadMessages:
    """Half-precision inputs are computed in float32 and the results cast back: the reverse
    messages divide by row normalisers computed elsewhere (exp(score - lse of another row)),
    and at bf16's 8 bits a potential of 1e2..1e4 rounds by more than exp() survives.

    ``compute_dtype`` (e.g. float64) computes in a wider type still: the row normalisers
    are merged and divided in log space, so a float32 result errs by about |score| 2**-23
    relative (two tied heads at |score| ~ 1e8 lose their log 2 entirely); ``MeanField``
    asks for float64 when its parameters allow scores that large (see ``score_bound``).

    The messages come back as views of one tensor ``stacked [B, N, 2, K, C, r]`` (forward,
    reverse), stored slot-major; without ``back``, ``projections.back_project`` reads it
    with one batched GEMM.

    ``groups``: the projections hold only these groups, in this order (at least
    ``used_groups(structure)``), and so do the messages; None: all of them (or one shared).
    Each projection is a ``[B, N, K, C, r]`` tensor or the tuple of its K groups ``[B, N, C,
    r]`` (``projections.project`` with the fused kernel's tables: their gradients then reach the
    projection's GEMMs without being stacked into one tensor first).

    ``back``: the back-projection tables ``[2 K, C r, d]`` (``projections.GemmTables.back``);
    the messages then also come back projected to label logits (``label_message``), each
    slot multiplied as it is written (see ``message_assembly``)."""
    if structure.prior is not None:
        raise ValueError("the fused kernel has no head prior (adaptive span); use kernel='naive'")
    first = query[0] if isinstance(query, tuple) else query
    dtype, device = first.dtype, first.device
    wide = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if compute_dtype is not None and torch.finfo(compute_dtype).bits > torch.finfo(wide).bits:
        wide = compute_dtype
    bias = None if bias is None else bias.to(wide)
    label_back, back = back, None if back is None else back.to(wide)
    flash = fused_available(device)  # looked up here: tests patch it
    projections = [each_group(lambda group: group.to(wide), t) for t in (query, key, value, value_rev)]
    result = fused_kernel.messages(*projections, scale, structure, messages, bias, flash, groups, back)
    lse = result.lse.to(dtype)
    if result.stacked is None:
        return HeadMessages(None, None, lse, query=query, key=key, groups=groups)
    stacked = result.stacked.to(dtype)
    forward, reverse = stacked[:, :, 0], stacked[:, :, 1]
    label_message = None if result.label_message is None else result.label_message.to(dtype)
    return HeadMessages(
        forward,
        reverse,
        lse,
        query=query,
        key=key,
        stacked=stacked,
        groups=groups,
        label_message=label_message,
        label_back=label_back,
    )


@full_precision
def log_normaliser(
    query,
    key,
    scale: float,
    structure: HeadStructure,
    kernel: str,
    compute_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, C, N]`` row log-normalisers only (0 on rows with no legal head)."""
    if kernel == "naive":
        return softmax_with_null(naive_logits(query, key, scale, structure, bias), structure.has_head)[1]
    options = dict(messages=False, compute_dtype=compute_dtype, bias=bias)
    return fused(query, key, key, query, scale, structure, **options).lse


def score_bound(
    query_table: torch.Tensor, key_table: torch.Tensor, bias: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """A bound on the head logits |scale query . key + bias| over every label distribution:
    query = q U and key = q' V with q, q' on the simplex, so |q U V^T q'^T| <= max_a |U_a|
    max_b |V_b| (per group and channel; tables ``[K or 1, C, d, r]``), and |bias| <= its
    largest entry. A scalar tensor; reading it is a host sync."""
    bound = abs(scale) * (query_table.norm(dim=-1).amax(-1) * key_table.norm(dim=-1).amax(-1)).max()
    return bound if bias is None else bound + bias.abs().max()
