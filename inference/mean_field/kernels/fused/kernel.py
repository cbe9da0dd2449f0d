"""The fused head kernel's computation, part by part (``head_kernels.fused`` is its entry).

A row's arcs split into parts: the near diagonals (one per offset |o| <= reach, each in one
distance group), the two far attentions (offset beyond reach to the right or to the left,
one group each) and the slices touching virtual nodes. ``messages`` runs the algorithm:

    1. the scores of every part, per row (``_band_scores``, ``_far_forward``, ``_virtual_scores``);
    2. the row log-normaliser: log-sum-exp over the parts and the null head (``_row_normalisers``);
    3. the messages, each part's forward and reverse written into one tensor (``_band_parts``,
       ``_far_parts``, ``_virtual_parts``, then ``message_assembly.assemble``).

Token-major throughout: projections ``[B, N, C, r]`` per group (each its own tensor, or a
view of the group-major projections: ``projections.project``), row quantities (scores,
normalisers) ``[B, n, C]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from inference.mean_field.kernels.fused.far_attention import ABSENT, MASKED, KeySpan, far_attention
from inference.mean_field.kernels.fused.message_assembly import Part, assemble, band_scores
from inference.mean_field.kernels.structure import HeadMessages, HeadStructure

__all__ = ["messages", "used_groups"]


def _far_masks(structure: HeadStructure):
    """Per far side: None (every far token arc allowed: no mask), a token mask, or
    False (no far arc at all). Decided from the topology's band, in plain Python, so
    that compiled graphs see no data-dependent branch."""
    shift = structure.reach + 1
    if structure.band is None:
        return {"right": structure.token_mask(), "left": structure.token_mask()}
    sides = {}
    for side, reach in zip(("left", "right"), structure.band):
        sides[side] = False if reach < shift else (None if reach == math.inf else structure.token_mask())
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


def _split_groups(tensors) -> list[list[torch.Tensor]]:
    """Each ``[B, N, K, C, r]`` -> its K groups ``[B, N, C, r]`` (views), with one ``unbind``
    per distinct tensor (async mean field passes key as value, query as value_rev): its
    backward stacks the groups' gradients once, where indexing ``x[:, :, k]`` at every use
    zero-filled a full-size gradient per use. Split along the group dimension moved first,
    so that the stacked gradient is group-major, the projections' own layout
    (``projections.project``). Projections given as their groups (a tuple, ``project`` with the
    fused kernel's tables) are read as they are: no split, and no stack in the backward."""
    split = {}
    for t in tensors:
        if id(t) not in split:
            split[id(t)] = list(t) if isinstance(t, tuple) else list(t.movedim(2, 0).unbind(0))
    return [split[id(t)] for t in tensors]


class _Inputs(NamedTuple):
    """The fused kernel's inputs: the projections split per group (``[B, N, C, r]`` views), and
    where each group's projections and messages live (``slot``)."""

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    values_rev: list[torch.Tensor]
    K: int  # slots per direction (1: one projection shared by every group)
    scale: float
    structure: HeadStructure
    bias: torch.Tensor | None
    groups: tuple[int, ...] | None

    def slot(self, k: int) -> int:
        """Where group k's projections and messages live."""
        return self.groups.index(k) if self.groups is not None else 0 if self.K == 1 else k

    def bias_of(self, k: int) -> torch.Tensor | float:
        """``[C]``: group k's bias per channel."""
        return 0.0 if self.bias is None else self.bias[k]

    def token_nodes(self) -> torch.Tensor:
        """``[B, n, 1]``: which token rows are nodes."""
        return self.structure.nodes[:, : self.structure.n, None]


def messages(
    query, key, value, value_rev, scale, structure: HeadStructure, with_messages: bool, bias, flash, groups, back=None
):
    """The head messages and row log-normalisers of ``head_kernels.fused`` (its arguments,
    already in the computing type); ``with_messages=False``: the normalisers only; ``back``:
    also the messages' back-projection (``message_assembly.assemble``)."""
    queries, keys, values, values_rev = _split_groups((query, key, value, value_rev))
    x = _Inputs(queries, keys, values, values_rev, len(queries), scale, structure, bias, groups)
    sides, spans = _far_masks(structure), _far_spans(structure)
    # 1. scores of every part, per row
    band = _band_scores(x)
    far = _far_forward(x, sides, spans, flash)
    virtual = _virtual_scores(x) if structure.nodes.shape[1] > structure.n else None
    # 2. the row log-normaliser: log-sum-exp over the parts, plus the null head
    lse_tokens, lse, lse_virtual = _row_normalisers(x, band, far, virtual)
    has_head = structure.has_head
    if not with_messages:  # the ELBO needs only the normalisers: skip the reverse attentions
        return HeadMessages(None, None, torch.where(has_head[:, None], lse, 0.0))
    # 3. messages: parts written into one tensor, forward of slot k in slot k, reverse in K + k
    parts = _band_parts(x, band, lse_tokens) + _far_parts(x, far, lse_tokens, sides, spans, flash)
    if virtual is not None:
        parts += _virtual_parts(x, virtual, lse_tokens, lse_virtual)
    N = x.queries[0].shape[1]
    if not parts:  # no arc can exist (n = 1, no virtual node): zero messages
        parts.append(Part(0, 0, N, x.queries[0].new_zeros(()).expand_as(x.queries[0]), 0))
    stacked, label_message = assemble(parts, 2 * x.K, N, back)
    stacked = stacked.unflatten(2, (2, x.K))
    lse = torch.where(has_head[:, None], lse, 0.0)
    return HeadMessages(stacked[:, :, 0], stacked[:, :, 1], lse, stacked=stacked, label_message=label_message)


def _band_scores(x: _Inputs) -> dict[int, torch.Tensor]:
    """offset -> ``[B, n, C]`` scores of arc (i, i + offset), MASKED where illegal."""
    structure, n = x.structure, x.structure.n
    band = {}
    for offset in _band_offsets(structure):
        k = _group_of(offset, structure)
        q_k, key_k = x.queries[x.slot(k)], x.keys[x.slot(k)]
        lo, hi = max(0, -offset), n - max(0, offset)
        s = x.scale * band_scores(q_k, key_k, offset, n) + x.bias_of(k)
        legal = structure.diagonal(offset)[..., None]  # [B, hi - lo, 1]
        band[offset] = F.pad(s.masked_fill(~legal, MASKED), (0, 0, lo, n - hi), value=MASKED)
    return band


def _far_forward(x: _Inputs, sides: dict, spans: dict, flash: bool) -> dict:
    """side -> ``(group, forward output [B, n, C, r], part lse [B, n, C])`` of each far side
    that has arcs."""
    structure, n = x.structure, x.structure.n
    shift = structure.reach + 1
    B, _, C, _ = x.queries[0].shape
    token_nodes = x.token_nodes()
    far = {}
    for side, k in (("right", structure.gamma), ("left", 2 * structure.gamma + 1)):
        if sides[side] is False or n <= shift:
            continue
        key_bias = torch.where(token_nodes, x.bias_of(k), ABSENT).to(x.queries[0].dtype).expand(B, n, C)
        q_k, key_k, v_k = (g[x.slot(k)][:, :n] for g in (x.queries, x.keys, x.values))
        out, lse = far_attention(q_k, key_k, v_k, key_bias, x.scale, shift, side, sides[side], flash, spans[side][0])
        far[side] = (k, out, torch.where(token_nodes, lse.transpose(1, 2), MASKED))
    return far


def _virtual_scores(x: _Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(columns [B, C, n, m], rows [B, C, m, N])``: the scores of token rows at the m
    virtual heads and of the virtual rows at every head, MASKED where illegal."""
    structure, n = x.structure, x.structure.n
    kv = structure.virtual_group
    q_v, key_v = (g[x.slot(kv)].transpose(1, 2) for g in (x.queries, x.keys))  # [B, C, N, r]
    bias_v = 0.0 if x.bias is None else x.bias[kv][:, None, None]  # [C, 1, 1]
    virtual_cols = x.scale * (q_v[..., :n, :] @ key_v[..., n:, :].transpose(-1, -2)) + bias_v  # [B, C, n, m]
    virtual_cols = virtual_cols.masked_fill(~structure.border[0][:, None], MASKED)
    virtual_rows = x.scale * (q_v[..., n:, :] @ key_v.transpose(-1, -2)) + bias_v  # [B, C, m, N]
    virtual_rows = virtual_rows.masked_fill(~structure.border[1][:, None], MASKED)
    return virtual_cols, virtual_rows


def _row_normalisers(x: _Inputs, band: dict, far: dict, virtual):
    """``(lse of token rows [B, n, C], lse of every row [B, C, N], lse of virtual rows
    [B, C, m] or None)``: log-sum-exp over the parts and the null head (logit 0 where a row
    has no legal head)."""
    structure, n = x.structure, x.structure.n
    B, N, C, _ = x.queries[0].shape
    null = torch.where(structure.has_head, MASKED, 0.0).to(x.queries[0].dtype)[..., None]  # [B, N, 1]
    token_parts = [null[:, :n, None].expand(B, n, C, 1)] + [s[..., None] for s in band.values()]
    token_parts += [lse[..., None] for (_, _, lse) in far.values()]
    if virtual is not None:
        token_parts.append(virtual[0].transpose(1, 2))  # [B, n, C, m]
    lse_tokens = torch.cat(token_parts, -1).logsumexp(-1)  # [B, n, C]
    lse = lse_tokens.transpose(1, 2)  # [B, C, n]
    if virtual is None:
        return lse_tokens, lse, None
    lse_virtual = torch.cat([null[:, None, n:].expand(B, C, N - n, 1), virtual[1]], -1)
    lse_virtual = lse_virtual.logsumexp(-1)  # [B, C, m]
    return lse_tokens, torch.cat([lse, lse_virtual], -1), lse_virtual


def _band_parts(x: _Inputs, band: dict, lse_tokens) -> list[Part]:
    """The near diagonals' forward and reverse messages."""
    n = x.structure.n
    parts = []
    for offset, s in band.items():
        p = (s - lse_tokens).exp()[..., None]  # [B, n, C, 1]: P(i -> i + offset)
        lo, hi = max(0, -offset), n - max(0, offset)
        k = x.slot(_group_of(offset, x.structure))
        parts.append(Part(k, lo, hi - lo, x.values[k], lo + offset, p, lo))
        # head h = i + offset receives from dependent i = h - offset
        parts.append(Part(x.K + k, lo + offset, hi - lo, x.values_rev[k], lo, p, lo))
    return parts


def _far_parts(x: _Inputs, far: dict, lse_tokens, sides: dict, spans: dict, flash: bool) -> list[Part]:
    """The far sides' forward messages (their attention outputs, reweighted to the whole row)
    and reverse messages: an attention with queries and keys swapped whose key bias is
    ``-lse`` of the forward rows, un-normalised by its own ``lse``."""
    n, shift = x.structure.n, x.structure.reach + 1
    token_nodes = x.token_nodes()
    parts = []
    for side, (k, out, part_lse) in far.items():
        weight = (part_lse - lse_tokens).exp()[..., None]
        parts.append(Part(x.slot(k), 0, n, out, 0, weight))
        # reverse: head i gathers dependents j on the opposite side, weighted exp(s_ji + bias - lse_j)
        swap = "left" if side == "right" else "right"
        mask = None if sides[side] is None or sides[side] is False else x.structure.token_mask(transposed=True)
        key_bias = torch.where(token_nodes, x.bias_of(k) - lse_tokens, ABSENT)
        q_k, key_k, v_rev = (g[x.slot(k)][:, :n] for g in (x.keys, x.queries, x.values_rev))
        out_rev, lse_rev = far_attention(q_k, key_k, v_rev, key_bias, x.scale, shift, swap, mask, flash, spans[side][1])
        # a padding head has no dependent: drop its row before exp() (its raw scores may be huge).
        # lse_rev = log sum_j P(j -> i) <= log n exactly, but each term is exp(score - lse_j)
        # with lse_j rounded elsewhere: past ~1e7 in float32 that can overflow, so cap it
        lse_rev = torch.where(token_nodes, lse_rev.transpose(1, 2).clamp(max=math.log(n)), MASKED)
        parts.append(Part(x.K + x.slot(k), 0, n, out_rev, 0, lse_rev.exp()[..., None]))
    return parts


def _virtual_parts(x: _Inputs, virtual, lse_tokens, lse_virtual) -> list[Part]:
    """The virtual slices' forward and reverse messages (plain products: their slices are
    ``[n, m]`` and ``[m, N]``)."""
    virtual_cols, virtual_rows = virtual
    n, N = x.structure.n, x.queries[0].shape[1]
    p_cols = (virtual_cols - lse_tokens.transpose(1, 2)[..., None]).exp()  # [B, C, n, m]
    p_rows = (virtual_rows - lse_virtual[..., None]).exp()  # [B, C, m, N]
    kv = x.slot(x.structure.virtual_group)
    v_v, v_rev_v = (g[kv].transpose(1, 2) for g in (x.values, x.values_rev))  # [B, C, N, r]
    forward = torch.cat([p_cols @ v_v[..., n:, :], p_rows @ v_v], -2).transpose(1, 2)
    from_rows = p_rows.transpose(-1, -2) @ v_rev_v[..., n:, :]  # [B, C, N, r]
    from_cols = p_cols.transpose(-1, -2) @ v_rev_v[..., :n, :]  # [B, C, m, r]
    reverse = (from_rows + F.pad(from_cols, (0, 0, n, 0))).transpose(1, 2)
    return [Part(kv, 0, N, forward, 0), Part(x.K + kv, 0, N, reverse, 0)]
