"""Messages through the head variables: the attention inside mean field.

Given per-node projections of the label marginals for every distance group k and
channel c (``query = q_z U``, ``key = q_z V``, both ``[B, N, K, C, r]``), the head
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
the topology's data (a band's reach, a segment length) where it has them (``_far_spans``).
Everything stays token-major (``[B, N, C, r]`` per group, views of the projections), and
the messages come back as one tensor (``stacked``).

Rows with no legal head (padding, ``causal`` at i = 0) get a zero row of P and
``lse = 0``: a "null head" of logit 0 is the only choice there, which keeps softmax
and its gradient finite.

``fused`` is finite wherever ``naive`` is (tests/inference/test_numerics.py: potentials to
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

from inference.mean_field.kernels.fused.far_attention import ABSENT, MASKED, KeySpan, far_attention, flash_available
from inference.mean_field.kernels.fused.message_assembly import Part, assemble, band_scores
from inference.mean_field.kernels.null_softmax import softmax_with_null
from inference.mean_field.kernels.precision import full_precision
from inference.mean_field.kernels.shared_heads import shared_heads
from inference.mean_field.kernels.structure import HeadMessages, HeadStructure

__all__ = ["HeadStructure", "HeadMessages", "naive", "fused", "log_normaliser", "fused_available", "score_bound"]


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


def _far_masks(structure: HeadStructure):
    """Per far side: None (every far token arc allowed: no mask), a token mask, or
    False (no far arc at all). Decided from the topology's band, in plain Python, so
    that compiled graphs see no data-dependent branch."""
    shift = structure.reach + 1
    if structure.band is None:
        return {"right": structure.token_arcs, "left": structure.token_arcs}
    sides = {}
    for side, reach in zip(("left", "right"), structure.band):
        sides[side] = False if reach < shift else (None if reach == math.inf else structure.token_arcs)
    return sides


def _far_spans(structure: HeadStructure) -> dict:
    """Per far side: ``(span of its rows' keys, span of the transposed attention's)`` as
    ``KeySpan``s, from the topology's data (a band's reach, a segment length), never from the
    mask: the far attentions read only the keys in them (the mask still decides each arc)."""
    spans = {}
    for index, side in enumerate(("left", "right")):
        width = structure.band[index] if structure.band is not None else math.inf
        length = getattr(structure.topology, "segment_length", None)
        if length is None:
            spans[side] = (KeySpan(width=width), KeySpan(width=width))
        else:  # arcs reach the segment before; their transposes the segment after
            spans[side] = (KeySpan(width, length, before=1), KeySpan(width, length, after=1))
    return spans


def _band_offsets(structure: HeadStructure) -> list[int]:
    """The near diagonals that can hold an arc: |offset| <= reach, inside the topology's band
    (a diagonal outside it is all illegal: zero weight, so it is not computed)."""
    left, right = structure.band if structure.band is not None else (math.inf, math.inf)
    reach, n = structure.reach, structure.n
    return [o for o in range(-reach, reach + 1) if o and abs(o) < n and -left <= o <= right]


def used_groups(structure: HeadStructure) -> tuple[int, ...]:
    """The distance groups ``fused`` reads on this structure, in order: a topology without
    arcs to one side (``causal``) or a short sentence needs only some; the others' projections
    need not be computed (``MeanField`` then projects onto these alone)."""
    shift = structure.reach + 1
    used = {_group_of(offset, structure) for offset in _band_offsets(structure)}
    if structure.n > shift:
        sides = _far_masks(structure)
        far = (("right", structure.gamma), ("left", 2 * structure.gamma + 1))
        used |= {k for side, k in far if sides[side] is not False}
    if structure.nodes.shape[1] > structure.n:
        used.add(structure.virtual_group)
    return tuple(sorted(used)) or (0,)  # no arc at all (n = 1): one group holds the zero messages


def _group_of(offset: int, structure: HeadStructure) -> int:
    """The group of token offset ``offset``: right, the bucket of the distance; left, after the
    right ones."""
    bucket = sum(abs(offset) >= cut for cut in structure.bucket_cuts)
    return bucket if offset > 0 else structure.gamma + 1 + bucket


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
) -> HeadMessages:
    """Half-precision inputs are computed in float32 and the results cast back: the reverse
    messages divide by row normalisers computed elsewhere (exp(score - lse of another row)),
    and at bf16's 8 bits a potential of 1e2..1e4 rounds by more than exp() survives.

    ``compute_dtype`` (e.g. float64) computes in a wider type still: the row normalisers
    are merged and divided in log space, so a float32 result errs by about |score| 2**-23
    relative (two tied heads at |score| ~ 1e8 lose their log 2 entirely); ``MeanField``
    asks for float64 when its parameters allow scores that large (see ``score_bound``).

    The messages come back as views of one token-major tensor ``stacked [B, N, 2, K, C, r]``
    (forward, reverse), which the back-projection reads with one GEMM.

    ``groups``: the projections hold only these groups, in this order (at least
    ``used_groups(structure)``), and so do the messages; None: all of them (or one shared)."""
    if structure.prior is not None:
        raise ValueError("the fused kernel has no head prior (adaptive span); use kernel='naive'")
    dtype = query.dtype
    wide = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if compute_dtype is not None and torch.finfo(compute_dtype).bits > torch.finfo(wide).bits:
        wide = compute_dtype
    bias = None if bias is None else bias.to(wide)
    flash = fused_available(query.device)  # looked up here: tests patch it
    projections = [t.to(wide) for t in (query, key, value, value_rev)]
    result = _fused(*projections, scale, structure, messages, bias, flash, groups)
    lse = result.lse.to(dtype)
    if result.stacked is None:
        return HeadMessages(None, None, lse, query=query, key=key, groups=groups)
    stacked = result.stacked.to(dtype)
    forward, reverse = stacked[:, :, 0], stacked[:, :, 1]
    return HeadMessages(forward, reverse, lse, query=query, key=key, stacked=stacked, groups=groups)


def _split_groups(tensors) -> list[list[torch.Tensor]]:
    """Each ``[B, N, K, C, r]`` -> its K groups ``[B, N, C, r]`` (token-major views), with one
    ``unbind`` per distinct tensor (async mean field passes key as value, query as value_rev):
    its backward stacks the groups' gradients once, where indexing ``x[:, :, k]`` at every use
    zero-filled a full-size gradient per use."""
    split = {}
    return [split.setdefault(id(t), list(t.unbind(2))) for t in tensors]


def _fused(query, key, value, value_rev, scale, structure: HeadStructure, messages: bool, bias, flash, groups):
    """Token-major throughout: projections ``[B, N, C, r]`` per group, row quantities
    (scores, normalisers) ``[B, n, C]``."""
    B, N, K, C, r = query.shape  # K = 1: shared by every group (one message slot for all)
    n, gamma, reach = structure.n, structure.gamma, structure.reach
    m = N - n
    dtype = query.dtype
    nodes, has_head = structure.nodes, structure.has_head  # never structure.arcs: [B, N, N]
    token_nodes = nodes[:, :n, None]  # [B, n, 1]
    queries, keys, values, values_rev = _split_groups((query, key, value, value_rev))

    def group_of(offset: int) -> int:
        return _group_of(offset, structure)

    def slot(k: int) -> int:  # where group k's projections and messages live
        return groups.index(k) if groups is not None else 0 if K == 1 else k

    def bias_of(k: int) -> torch.Tensor | float:  # [C]: group k's bias per channel
        return 0.0 if bias is None else bias[k]

    # 1. scores of every part, per row
    band = {}  # offset -> [B, n, C] scores of arc (i, i + offset), MASKED where illegal
    for offset in _band_offsets(structure):
        k = group_of(offset)
        q_k, key_k = queries[slot(k)], keys[slot(k)]
        lo, hi = max(0, -offset), n - max(0, offset)
        s = scale * band_scores(q_k, key_k, offset, n) + bias_of(k)
        legal = structure.diagonal(offset)[..., None]  # [B, hi - lo, 1]
        band[offset] = F.pad(s.masked_fill(~legal, MASKED), (0, 0, lo, n - hi), value=MASKED)

    sides = _far_masks(structure)
    spans = _far_spans(structure)
    shift = reach + 1
    far = {}
    for side, k in (("right", gamma), ("left", 2 * gamma + 1)):
        if sides[side] is False or n <= shift:
            continue
        key_bias = torch.where(token_nodes, bias_of(k), ABSENT).to(dtype).expand(B, n, C)
        q_k, key_k, v_k = (g[slot(k)][:, :n] for g in (queries, keys, values))
        out, lse = far_attention(q_k, key_k, v_k, key_bias, scale, shift, side, sides[side], flash, spans[side][0])
        far[side] = (k, out, torch.where(token_nodes, lse.transpose(1, 2), MASKED))

    if m:
        kv = structure.virtual_group
        q_v, key_v = (g[slot(kv)].transpose(1, 2) for g in (queries, keys))  # [B, C, N, r]
        bias_v = 0.0 if bias is None else bias[kv][:, None, None]  # [C, 1, 1]
        virtual_cols = scale * (q_v[..., :n, :] @ key_v[..., n:, :].transpose(-1, -2)) + bias_v  # [B, C, n, m]
        virtual_cols = virtual_cols.masked_fill(~structure.border[0][:, None], MASKED)
        virtual_rows = scale * (q_v[..., n:, :] @ key_v.transpose(-1, -2)) + bias_v  # [B, C, m, N]
        virtual_rows = virtual_rows.masked_fill(~structure.border[1][:, None], MASKED)

    # 2. the row log-normaliser: log-sum-exp over the parts, plus the null head
    null = torch.where(has_head, MASKED, 0.0).to(dtype)[..., None]  # [B, N, 1]
    token_parts = [null[:, :n, None].expand(B, n, C, 1)] + [s[..., None] for s in band.values()]
    token_parts += [lse[..., None] for (_, _, lse) in far.values()]
    if m:
        token_parts.append(virtual_cols.transpose(1, 2))  # [B, n, C, m]
    lse_tokens = torch.cat(token_parts, -1).logsumexp(-1)  # [B, n, C]
    lse = lse_tokens.transpose(1, 2)  # [B, C, n]
    if m:
        lse_virtual = torch.cat([null[:, None, n:].expand(B, C, m, 1), virtual_rows], -1)
        lse_virtual = lse_virtual.logsumexp(-1)  # [B, C, m]
        lse = torch.cat([lse, lse_virtual], -1)

    if not messages:  # the ELBO needs only the normalisers: skip the reverse attentions
        return HeadMessages(None, None, torch.where(has_head[:, None], lse, 0.0))

    # 3. messages: parts written into one tensor, forward of slot k in slot k, reverse in K + k
    parts = []
    for offset, s in band.items():
        p = (s - lse_tokens).exp()[..., None]  # [B, n, C, 1]: P(i -> i + offset)
        lo, hi = max(0, -offset), n - max(0, offset)
        k = slot(group_of(offset))
        parts.append(Part(k, lo, hi - lo, values[k], lo + offset, p, lo))
        # head h = i + offset receives from dependent i = h - offset
        parts.append(Part(K + k, lo + offset, hi - lo, values_rev[k], lo, p, lo))
    for side, (k, out, part_lse) in far.items():
        weight = (part_lse - lse_tokens).exp()[..., None]
        parts.append(Part(slot(k), 0, n, out, 0, weight))
        # reverse: head i gathers dependents j on the opposite side, weighted exp(s_ji + bias - lse_j)
        swap = "left" if side == "right" else "right"
        mask = sides[side].transpose(0, 1) if isinstance(sides[side], torch.Tensor) else None
        key_bias = torch.where(token_nodes, bias_of(k) - lse_tokens, ABSENT)
        q_k, key_k, v_rev = (g[slot(k)][:, :n] for g in (keys, queries, values_rev))
        out_rev, lse_rev = far_attention(q_k, key_k, v_rev, key_bias, scale, shift, swap, mask, flash, spans[side][1])
        # a padding head has no dependent: drop its row before exp() (its raw scores may be huge).
        # lse_rev = log sum_j P(j -> i) <= log n exactly, but each term is exp(score - lse_j)
        # with lse_j rounded elsewhere: past ~1e7 in float32 that can overflow, so cap it
        lse_rev = torch.where(token_nodes, lse_rev.transpose(1, 2).clamp(max=math.log(n)), MASKED)
        parts.append(Part(K + slot(k), 0, n, out_rev, 0, lse_rev.exp()[..., None]))
    if m:
        p_cols = (virtual_cols - lse_tokens.transpose(1, 2)[..., None]).exp()  # [B, C, n, m]
        p_rows = (virtual_rows - lse_virtual[..., None]).exp()  # [B, C, m, N]
        kv = slot(kv)
        v_v, v_rev_v = (g[kv].transpose(1, 2) for g in (values, values_rev))  # [B, C, N, r]
        virtual = torch.cat([p_cols @ v_v[..., n:, :], p_rows @ v_v], -2).transpose(1, 2)
        parts.append(Part(kv, 0, N, virtual, 0))
        from_rows = p_rows.transpose(-1, -2) @ v_rev_v[..., n:, :]  # [B, C, N, r]
        from_cols = p_cols.transpose(-1, -2) @ v_rev_v[..., :n, :]  # [B, C, m, r]
        parts.append(Part(K + kv, 0, N, (from_rows + F.pad(from_cols, (0, 0, n, 0))).transpose(1, 2), 0))
    if not parts:  # no arc can exist (n = 1, no virtual node): zero messages
        parts.append(Part(0, 0, N, queries[0].new_zeros(()).expand_as(queries[0]), 0))
    stacked = assemble(parts, 2 * K, N).unflatten(2, (2, K))
    lse = torch.where(has_head[:, None], lse, 0.0)
    return HeadMessages(stacked[:, :, 0], stacked[:, :, 1], lse, stacked=stacked)


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
