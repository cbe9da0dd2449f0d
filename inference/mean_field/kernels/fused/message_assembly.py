"""The fused kernel's row-wise parts without autograd's copies: the near diagonals' scores
(``band_scores``), and the messages written straight into one tensor.

Every message of ``head_kernels.fused`` is a sum of parts ``weight[i] * source[i + shift]``
over a range of rows (a band diagonal: the head probability times the value one offset
away; a far attention: its weight times its output; the virtual nodes' products, unweighted).
``assemble`` writes each part once into ``[B, N, S, C, r]`` (S slots: forward and reverse of
every group; stored slot-major), zeroing only the rows no part covers. With autograd ops the same sum made a
product tensor per part, padded it to full length (another copy), then stacked the slots (a
third), and each slice's backward zero-filled a full-size gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Part", "assemble", "band_scores", "write_product"]


@dataclass(frozen=True)
class Part:
    """``out[:, row : row + length, slot] (+)= weight[:, weight_row : ..] * source[:, source_row : ..]``
    (tensors ``[B, L, C, r]``, the weight ``[B, L, C, 1]`` or None)."""

    slot: int
    row: int
    length: int
    source: torch.Tensor
    source_row: int
    weight: torch.Tensor | None = None
    weight_row: int = 0


def _rows(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t[:, start : start + length]


def write_product(target: torch.Tensor, value: torch.Tensor, factor: torch.Tensor | None = None) -> None:
    """``target = value * factor`` (or ``value``) in place, in one pass where it can: torch.compile
    refuses ``out=`` into a strided view, so a compiled graph copies, then multiplies."""
    if factor is None:
        target.copy_(value)
    elif torch.compiler.is_compiling():
        target.copy_(value)
        target.mul_(factor)
    else:
        torch.mul(value, factor, out=target)


class _Assemble(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, slots, rows, *tensors):
        # spec: (slot, row, length, source index, source row, weight index or -1, weight row)
        B, _, C, r = tensors[spec[0][3]].shape
        # slot-major storage: each part writes one contiguous block (``projections``' layout)
        out = tensors[spec[0][3]].new_empty(slots, B, rows, C, r).permute(1, 2, 0, 3, 4)
        covered = set()
        for slot, row, length, source, source_row, weight, weight_row in spec:
            target = _rows(out[:, :, slot], row, length)
            value = _rows(tensors[source], source_row, length)
            if slot in covered:  # a later part of the slot: added in order
                target += value if weight < 0 else _rows(tensors[weight], weight_row, length) * value
                continue
            covered.add(slot)
            out[:, :row, slot] = 0
            out[:, row + length :, slot] = 0
            write_product(target, value, None if weight < 0 else _rows(tensors[weight], weight_row, length))
        for slot in set(range(slots)) - covered:
            out[:, :, slot] = 0
        ctx.spec = spec
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        grads = [None] * len(tensors)

        def accumulate(index: int, start: int, value: torch.Tensor, factor: torch.Tensor | None = None):
            if grads[index] is None:  # the first part: written, the other rows zeroed
                total = torch.empty_like(tensors[index], memory_format=torch.contiguous_format)
                total[:, :start] = 0
                total[:, start + value.shape[1] :] = 0
                write_product(_rows(total, start, value.shape[1]), value, factor)
                grads[index] = total
            else:
                target = _rows(grads[index], start, value.shape[1])
                target += value if factor is None else value * factor

        for slot, row, length, source, source_row, weight, weight_row in ctx.spec:
            part = _rows(grad[:, :, slot], row, length)
            w = None if weight < 0 else _rows(tensors[weight], weight_row, length)
            if needs[source]:
                accumulate(source, source_row, part, w)
            if weight >= 0 and needs[weight]:
                accumulate(weight, weight_row, (part * _rows(tensors[source], source_row, length)).sum(-1, True))
        return (None, None, None, *grads)


def assemble(parts: list[Part], slots: int, rows: int) -> torch.Tensor:
    """``[B, rows, slots, C, r]``: each slot the sum of its parts in the order given (zero
    where none); differentiable in every source and weight."""
    if not parts:
        raise ValueError("assemble needs at least one part")
    tensors, index = [], {}

    def position(t: torch.Tensor | None) -> int:
        if t is None:
            return -1
        if id(t) not in index:
            index[id(t)] = len(tensors)
            tensors.append(t)
        return index[id(t)]

    spec = tuple(
        (p.slot, p.row, p.length, position(p.source), p.source_row, position(p.weight), p.weight_row) for p in parts
    )
    return _Assemble.apply(spec, slots, rows, *tensors)


class _BandScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, offset, rows):
        lo, hi = max(0, -offset), rows - max(0, offset)
        ctx.save_for_backward(q, k)
        ctx.offset, ctx.rows = offset, rows
        return (_rows(q, lo, hi - lo) * _rows(k, lo + offset, hi - lo)).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        q, k = ctx.saved_tensors
        offset, rows = ctx.offset, ctx.rows
        lo, hi = max(0, -offset), rows - max(0, offset)
        grads = []
        for index, (other, start, other_start) in enumerate(((k, lo, lo + offset), (q, lo + offset, lo))):
            if not ctx.needs_input_grad[index]:
                grads.append(None)
                continue
            total = torch.empty_like(other, memory_format=torch.contiguous_format)
            total[:, :start] = 0
            total[:, start + hi - lo :] = 0
            write_product(_rows(total, start, hi - lo), _rows(other, other_start, hi - lo), grad[..., None])
            grads.append(total)
        return grads[0], grads[1], None, None


def band_scores(q: torch.Tensor, k: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """``[B, hi - lo, C]``: ``q[:, i] . k[:, i + offset]`` for the rows ``lo <= i < hi`` of the
    first ``rows`` where both exist (``q, k [B, N, C, r]``). The gradients come back full-size
    with zero rows outside the diagonal, written once (autograd's slices zero-filled a
    full-size gradient per slice, then copied into it)."""
    return _BandScores.apply(q, k, offset, rows)
