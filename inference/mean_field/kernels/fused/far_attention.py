"""The far attentions of the fused head kernel (``head_kernels.fused``), token-major.

Row i attends over the keys at token offset ``shift`` or more on one side -- ``"left"``:
j <= i - shift, ``"right"``: j >= i + shift -- optionally also within a ``token_mask
[n, n]`` (or ``[B, n, n]``, each row's own), with logit ``scale q_i . k_j + key_bias_j``. It
returns the attention output and the row log-normaliser, both differentiable (the lse too:
the reverse messages divide by it).

Layout: every tensor is token-major, ``[B, n, C, r]`` (one group of the projections, read in
place), and so is the output; the CPU flash-attention op reads and
writes that layout through strides. The key bias rides in one extra column (queries get a
column of ones, values a zero column), which the backward reuses to carry the gradient of
the lse (see ``_BlockedFlash.backward``).

Sinks: ``shift`` zero keys of score ``_SINK`` are placed where the masked triangle starts
(before the tokens on the left, after them on the right), so every row sees at least one
key and a row with no real key has lse = _SINK + log(#sinks), computed from the same
numbers in the forward and the backward (``head_kernels``' docstring says why that matters).
Keys a row must ignore get ``_ABSENT``.

Blocks: the op's own causal mode skips masked work only in 512-key steps, so the rows are
cut into query blocks, and each block is given only the keys some row of it can see. With
no more than the side known, that is a prefix on the left and a suffix on the right: a half
of the n x n work plus a sliver per block. A ``KeySpan`` from the topology's data (a band's
reach for ``window(w)``, the segment length of ``segments(l)``) bounds each row's keys
further: a block then reads its rows plus the span (O(n w) work for a window, O(n l) for
segments), smaller blocks for a narrower span. The block masks of an unmasked side are
windows of one strip ``[block, n + block]`` (memory linear in n); a ``token_mask`` gets its
rows' slice per block (the span is only where to look: the mask decides every arc). A mask
per row (``[B, n, n]``) gives each block a mask ``[B, 1, rows, keys]``, made where the block is
read, forward and backward, and dropped after: the bool table is all it keeps (O(B n^2) bytes). A block
whose keys do not reach a sink leaves a row with no key at out = an average of masked
values and lse ~ ``ABSENT``, which the kernel's log-sum-exp merge weighs by exactly 0.

Off the CPU (or without the op) the same attention is materialised (correct, O(n^2) memory).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.mean_field.kernels.fused.message_assembly import write_product
from inference.mean_field.kernels.structure import segment_span

__all__ = ["far_attention", "flash_available", "KeySpan", "UNBOUNDED", "MASKED", "SINK", "ABSENT"]

# finite "minus infinity" inside fused kernels: exp() of it is exactly 0, and it stays far
# below any score float32 can still tell apart (potentials of 1e8 and beyond), yet twice or
# four times it is still far from float32's largest number (3.4e38)
MASKED = -1e30
# the score of a row's sink keys, and the bias of keys a row must ignore: 1e30 apart,
# beyond any rounding of either
SINK = MASKED
ABSENT = 2 * MASKED

_flash_forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def flash_available(device: torch.device) -> bool:
    return device.type == "cpu" and _flash_forward is not None and _flash_backward is not None


# from this length on an unmasked side takes the op's own causal mode (one call, no mask to
# read; the right side on the reversed sequence): past 768 rows the op splits queries by 256
# and skips the masked keys itself. Measured fused forward + backward of one far attention
# (1 thread, C = 8, r = 64; seconds, op's causal mode / blocks here): n = 512, B = 8: 0.186 /
# 0.161 (left), 0.201 / 0.177 (right); n = 768, B = 4: 0.158 / 0.158, 0.176 / 0.158; n = 1024,
# B = 4: 0.253 / 0.267, 0.278 / 0.267; n = 2048, B = 1: 0.191 / 0.213, 0.198 / 0.213.
NATIVE_CAUSAL_FROM = 1024


def query_block(n: int) -> int:
    """Rows per block: 8 blocks or more (the skipped work tends to a half as blocks shrink),
    but none under 64 rows (each block is one call of the op)."""
    return max(64, -(-n // 8))


def _heads(x: torch.Tensor) -> torch.Tensor:
    """Token-major ``[B, L, C, E]`` -> the op's ``[B, C, L, E]`` (a view)."""
    return x.transpose(1, 2)


def _augmented(q, k, v, key_bias, scale: float, shift: int, side: str):
    """``(q', k', v')`` ``[B, L, C, r + 1]``: scaled queries with a ones column, keys with the
    key-bias column, values with a zero column; keys and values with the ``shift`` sinks."""
    B, n, C, r = q.shape
    queries = q.new_empty(B, n, C, r + 1)
    write_product(queries[..., :r], q, q.new_full((), scale))  # the scale on q: any finite scale, 0 included
    queries[..., r] = 1
    keys, values = q.new_empty(B, n + shift, C, r + 1), q.new_empty(B, n + shift, C, r + 1)
    tokens, sinks = (slice(shift, None), slice(0, shift)) if side == "left" else (slice(0, n), slice(n, None))
    keys[:, tokens, :, :r] = k
    keys[:, tokens, :, r] = key_bias
    keys[:, sinks] = 0
    keys[:, sinks, :, r] = SINK
    values[:, tokens, :, :r] = v
    values[:, tokens, :, r] = 0
    values[:, sinks] = 0
    return queries, keys, values


def _visible(rows: torch.Tensor, keys: torch.Tensor, n: int, shift: int, side: str, token_mask) -> torch.Tensor:
    """Bool ``[len(rows), len(keys)]``: may row i see augmented key t (sinks included)?
    ``[B, len(rows), len(keys)]`` for a token mask per row (``[B, n, n]``)."""
    rows, keys = rows[:, None], keys[None, :]
    if side == "left":  # key t is token t - shift; the sinks are t < shift
        visible, token = keys <= rows, keys - shift
        is_token = token >= 0
    else:  # key t is token t; the sinks are t >= n
        visible, token = keys >= rows + shift, keys
        is_token = token < n
    if token_mask is not None:  # the table, or the topology's rule of positions
        token = token.clamp(0, n - 1)
        if not isinstance(token_mask, torch.Tensor):
            allowed = token_mask(rows, token)
        else:  # one table, or one per row
            allowed = token_mask[rows, token] if token_mask.dim() == 2 else token_mask[:, rows, token]
        visible = visible & (allowed | ~is_token)
    return visible


@dataclass(frozen=True)
class KeySpan:
    """Where the keys a row may see can lie, known from the topology (a superset: the token
    mask still decides each arc). ``width``: within that many tokens of the row (a band;
    ``math.inf``: anywhere). ``segment``: within the segments ``seg(i) - before`` to
    ``seg(i) + after`` of ``segment`` tokens each (``segments(l)``: before = 1 for the arcs,
    after = 1 for their transpose)."""

    width: float = math.inf
    segment: int | None = None
    before: int = 0
    after: int = 0

    @property
    def bounded(self) -> bool:
        return self.width != math.inf or self.segment is not None

    def rows_per_block(self, n: int) -> int:
        """Query rows per block: half the span's own scale (a block's keys are its rows
        plus the span, so smaller blocks read fewer unreachable keys), at least 32 (each
        block is one call of the op), at most ``query_block(n)``."""
        scale = min(self.width, self.segment if self.segment is not None else math.inf)
        return int(max(32, min(query_block(n), scale / 2)))

    def tokens(self, lo: int, hi: int, n: int) -> tuple[int, int]:
        """``[start, stop)``: every key some row ``lo <= i < hi`` may see."""
        start, stop = 0, n
        if self.width != math.inf:
            start, stop = max(start, lo - int(self.width)), min(stop, hi + int(self.width))
        if self.segment is not None:
            first, last = segment_span(lo, hi, n, self.segment, self.before, self.after)
            start, stop = max(start, first), min(stop, last)
        return start, stop


UNBOUNDED = KeySpan()


def _key_slice(lo: int, hi: int, n: int, shift: int, side: str, span: KeySpan) -> slice:
    """The augmented keys (sinks included) of the query block ``[lo, hi)``: on the left
    tokens ``j <= i - shift`` (augmented ``j + shift``; the sinks ``[0, shift)`` when the
    range starts at token 0), on the right ``j >= i + shift`` (the sinks ``[n, n + shift)``
    when it reaches token n - 1). Never empty: a block with no reachable key gets one
    (masked for all its rows)."""
    start, stop = span.tokens(lo, hi, n)
    if side == "left":
        stop = min(stop, hi - shift)
        keys = (0 if start == 0 else start + shift, stop + shift)
    else:
        start = max(start, lo + shift)
        keys = (start, n + shift if stop == n else stop)
    if keys[1] <= keys[0]:
        first = min(keys[0], n + shift - 1)
        keys = (first, first + 1)
    return slice(*keys)


# the blocks of a token mask, newest last: key -> (token mask, blocks). The topology's mask is
# one tensor per (n, device) (``graphs.Topology.mask``), so every iteration and batch of that
# length reads the same blocks: built once, not per call
_BLOCKS: dict = {}
_BLOCKS_KEPT = 16


def _blocks(n: int, shift: int, side: str, token_mask, dtype, device, span: KeySpan = UNBOUNDED):
    """``[(rows, keys, mask [1, 1, rows, keys])]``, one per query block, as slices; those of a
    token mask kept for the mask's lifetime in a small cache. A mask per row (a batch's own)
    is not kept: its blocks hold no mask but the way to make it (``_mask_of``)."""
    per_row = isinstance(token_mask, torch.Tensor) and token_mask.dim() == 3
    if token_mask is None or per_row or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return _build_blocks(n, shift, side, token_mask, dtype, device, span)
    if isinstance(token_mask, torch.Tensor):
        layout = (token_mask.data_ptr(), tuple(token_mask.shape), token_mask.stride(), token_mask.device)
    else:  # a rule of positions: the same function object for every batch of its topology
        layout = ("rule", id(token_mask))
    key = (layout, n, shift, side, span, dtype, torch.device(device))
    cached = _BLOCKS.get(key)
    if cached is None:
        # holding the mask (or rule) keeps its address from being reused while the entry lives
        cached = (token_mask, _build_blocks(n, shift, side, token_mask, dtype, device, span))
        _BLOCKS[key] = cached
        while len(_BLOCKS) > _BLOCKS_KEPT:  # the oldest first
            _BLOCKS.pop(next(iter(_BLOCKS)))
    return cached[1]


def _build_blocks(n: int, shift: int, side: str, token_mask, dtype, device, span: KeySpan):
    if token_mask is None and side == "left" and n >= NATIVE_CAUSAL_FROM:  # the op's causal mode
        return [(slice(0, n), slice(0, n), None)]
    if token_mask is None and span.bounded:
        raise ValueError("a bounded key span needs the token mask that decides each arc")
    per_row = isinstance(token_mask, torch.Tensor) and token_mask.dim() == 3  # its masks made where read
    size = span.rows_per_block(n) if span.bounded else query_block(n)
    starts = range(0, n, size)
    if token_mask is None:  # every block's mask is a window of one strip
        rows = torch.arange(size, device=device)
        if side == "left":  # strip[a, x] visible iff x <= n + a; block at q: columns n - q ..
            strip = _visible(rows + n, torch.arange(n + size, device=device), n, 0, side, None)
        else:  # strip[a, x] visible iff x >= a; block at q: its first n - q columns
            strip = _visible(rows, torch.arange(n, device=device), n, 0, side, None)
        strip = torch.zeros(strip.shape, dtype=dtype, device=device).masked_fill(~strip, ABSENT)
    blocks = []
    for lo in starts:
        hi = min(lo + size, n)
        keys = _key_slice(lo, hi, n, shift, side, span)
        if token_mask is None:
            columns = slice(n - lo, n - lo + hi) if side == "left" else slice(0, n - lo)
            mask = strip[: hi - lo, columns][None, None]
        else:
            block = (slice(lo, hi), keys, n, shift, side, token_mask, dtype, device)
            mask = functools.partial(_block_mask, *block) if per_row else _block_mask(*block)
        blocks.append((slice(lo, hi), keys, mask))
    return blocks


def _block_mask(rows: slice, keys: slice, n: int, shift: int, side: str, token_mask, dtype, device) -> torch.Tensor:
    """The additive mask of one block: ``[1, 1, rows, keys]``, or ``[B, 1, rows, keys]`` for a
    token mask per row (0 where visible, ``ABSENT`` elsewhere)."""
    rows, keys = (torch.arange(s.start, s.stop, device=device) for s in (rows, keys))
    visible = _visible(rows, keys, n, shift, side, token_mask)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, ABSENT)
    return mask[None, None] if mask.dim() == 2 else mask[:, None]


def _mask_of(mask):
    """A block's mask as the op reads it: kept (a tensor, or None), or made now (a mask per row)."""
    return mask() if callable(mask) else mask


def _accumulate(total: torch.Tensor, parts) -> None:
    """``total[:, keys] (+)= part`` for ``(keys, part)`` in order of ``keys.start``: each
    key row written by the first part that reaches it, added to by the later ones, and
    the rows none reaches zeroed (no full-size zero fill first)."""
    covered = None
    for keys, part in parts:
        if covered is None:
            total[:, : keys.start] = 0
            covered = keys.start
        if keys.start > covered:  # a gap no part reached
            total[:, covered : keys.start] = 0
            covered = keys.start
        split = min(covered, keys.stop)
        if split > keys.start:
            total[:, keys.start : split] += part[:, : split - keys.start]
        if keys.stop > split:
            total[:, split : keys.stop] = part[:, split - keys.start :]
            covered = keys.stop
    total[:, covered:] = 0


class _BlockedFlash(torch.autograd.Function):
    """The far attention through the CPU flash op, one call per query block.

    Backward: the op computes D_i = dO_i . O_i itself; the gradient g_i of lse_i enters the
    score gradient as dS_ij = A_ij (dO_i . v_j - D_i + g_i). The values' extra column is
    zero (so is the output's), so a ones column in dO and -g_i in that column of O fold it
    in; the keys' extra column then receives the key bias's gradient."""

    @staticmethod
    def forward(ctx, q, k, v, key_bias, scale, shift, side, token_mask, span):
        B, n, C, r = q.shape
        queries, keys, values = _augmented(q, k, v, key_bias, scale, shift, side)
        blocks = _blocks(n, shift, side, token_mask, q.dtype, q.device, span)
        out = q.new_empty(B, n, C, r + 1)
        lse = None
        for rows, cols, kept in blocks:
            mask = _mask_of(kept)
            o, part = _flash_forward(
                _heads(queries[:, rows]),
                _heads(keys[:, cols]),
                _heads(values[:, cols]),
                0.0,
                mask is None,
                attn_mask=mask,
                scale=1.0,
            )
            if lse is None:  # the op's own lse type (float32 for half inputs)
                lse = part.new_empty(B, C, n)
            out[:, rows] = _heads(o)
            lse[:, :, rows] = part
        ctx.save_for_backward(queries, keys, values, lse)
        ctx.out, ctx.blocks, ctx.scale, ctx.shift, ctx.side = out, blocks, scale, shift, side
        return out[..., :r], lse.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        queries, keys, values, lse = ctx.saved_tensors
        out, r = ctx.out, queries.shape[-1] - 1
        d_out = torch.empty_like(out)
        if grad_out is None:
            d_out[..., :r] = 0
        else:
            d_out[..., :r] = grad_out
        d_out[..., r] = 1
        # the output's extra column (zero in the forward) carries -g (in a copy: the forward's
        # output is a view of ``out`` and must stay untouched)
        out_and_g = torch.empty_like(out)
        out_and_g[..., :r] = out[..., :r]
        out_and_g[..., r] = 0 if grad_lse is None else -grad_lse.transpose(1, 2).to(out.dtype)
        grad_queries = torch.empty_like(queries)  # the blocks' rows tile [0, n) exactly once
        key_parts, value_parts = [], []
        for rows, cols, kept in ctx.blocks:
            mask = _mask_of(kept)
            gq, gk, gv = _flash_backward(
                _heads(d_out[:, rows]),
                _heads(queries[:, rows]),
                _heads(keys[:, cols]),
                _heads(values[:, cols]),
                _heads(out_and_g[:, rows]),
                lse[:, :, rows],
                0.0,
                mask is None,
                attn_mask=mask,
                scale=1.0,
            )
            grad_queries[:, rows] = _heads(gq)
            key_parts.append((cols, _heads(gk)))
            value_parts.append((cols, _heads(gv)))
        grad_keys, grad_values = torch.empty_like(keys), torch.empty_like(values)
        order = sorted(range(len(key_parts)), key=lambda index: key_parts[index][0].start)
        _accumulate(grad_keys, [key_parts[index] for index in order])
        _accumulate(grad_values, [value_parts[index] for index in order])
        n = queries.shape[1]
        tokens = slice(ctx.shift, None) if ctx.side == "left" else slice(0, n)
        grad_q = grad_queries[..., :r] * ctx.scale
        grad_k, grad_bias = grad_keys[:, tokens, :, :r], grad_keys[:, tokens, :, r]
        return grad_q, grad_k, grad_values[:, tokens, :, :r], grad_bias, None, None, None, None, None


def _materialised(q, k, v, key_bias, scale, shift, side, token_mask):
    """The same attention with the scores materialised (other devices; differentiable)."""
    n = q.shape[1]
    queries = torch.cat([scale * q, torch.ones_like(q[..., :1])], -1)
    keys = torch.cat([k, key_bias[..., None].to(k.dtype)], -1)
    values = F.pad(v, (0, 1))
    sinks = keys.new_zeros(keys.shape[0], shift, *keys.shape[2:])
    sinks[..., -1] = SINK
    pair = (lambda t, s: torch.cat([s, t], 1)) if side == "left" else (lambda t, s: torch.cat([t, s], 1))  # noqa: E731
    keys, values = pair(keys, sinks), pair(values, torch.zeros_like(sinks))
    queries, keys, values = (t.transpose(1, 2) for t in (queries, keys, values))
    positions = torch.arange(n + shift, device=q.device)
    visible = _visible(positions[:n], positions, n, shift, side, token_mask)
    visible = visible if visible.dim() == 2 else visible[:, None]  # a mask per row: [B, 1, n, n + shift]
    scores = (queries @ keys.transpose(-1, -2)).masked_fill(~visible, ABSENT)
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ values
    return out.transpose(1, 2)[..., :-1], lse


def far_attention(
    q, k, v, key_bias, scale: float, shift: int, side: str, token_mask=None, flash: bool = True, span=UNBOUNDED
):
    """``(out [B, n, C, r], lse [B, C, n])`` of row i over the keys j with j <= i - shift
    (``side="left"``) or j >= i + shift (``"right"``), and ``token_mask[i, j]`` if given
    (``token_mask[b, i, j]``: a mask per row, ``[B, n, n]``).
    ``q, k, v [B, n, C, r]`` and ``key_bias [B, n, C]`` (``ABSENT`` on keys that exist for no
    query, e.g. padding). ``flash``: use the CPU flash op (the caller decides: tests patch it).
    ``span`` (a ``KeySpan``, with a token mask): where a row's keys can lie; the op then reads
    only those (the result is the same: the mask decides). A row whose block holds no key it
    may see (rather than the sinks) gets lse ~ ``ABSENT``."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if flash and side == "right" and token_mask is None and q.shape[1] >= NATIVE_CAUSAL_FROM:
        flip = lambda t: t.flip(1)  # noqa: E731  (the reversed sequence: its left side)
        out, lse = _BlockedFlash.apply(flip(q), flip(k), flip(v), flip(key_bias), scale, shift, "left", None, UNBOUNDED)
        return flip(out), lse.flip(-1)
    if flash:
        return _BlockedFlash.apply(q, k, v, key_bias, scale, shift, side, token_mask, span)
    return _materialised(q, k, v, key_bias, scale, shift, side, token_mask)
