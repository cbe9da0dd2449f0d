"""The fused kernel's row-wise parts without autograd's copies: the near diagonals' scores
(``band_scores``), and the messages written straight into one tensor.

Every message of ``head_kernels.fused`` is a sum of parts ``weight[i] * source[i + shift]``
over a range of rows (a band diagonal: the head probability times the value one offset
away; a far attention: its weight times its output; the virtual nodes' products, unweighted).
``assemble`` writes each part once into ``[B, N, S, C, r]`` (S slots: forward and reverse of
every group; stored slot-major), zeroing only the rows no part covers. With autograd ops
the same sum made a product tensor per part, padded it to full length (another copy), then
stacked the slots (a third), and each slice's backward zero-filled a full-size gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

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


def _by_slot(spec) -> dict[int, list]:
    """The parts of each slot, in the order given (a slot's sum is written in that order)."""
    slots: dict[int, list] = {}
    for part in spec:
        slots.setdefault(part[0], []).append(part)
    return slots


class _Assemble(torch.autograd.Function):
    """The messages, and with ``back`` their back-projection ``sum_s out[:, :, s] back[s]``,
    one slot at a time: a slot's block is multiplied while it is still in cache, and in the
    backward its gradient from the label logits is made per slot and read at once, where a
    separate GEMM wrote all 2 K slots' gradients out first and the parts read them back."""

    @staticmethod
    def forward(ctx, spec, slots, rows, back, *tensors):
        # spec: (slot, row, length, source index, source row, weight index or -1, weight row)
        ctx.set_materialize_grads(False)
        B, _, C, r = tensors[spec[0][3]].shape
        # slot-major storage: each part writes one contiguous block (``projections``' layout)
        out = tensors[spec[0][3]].new_empty(slots, B, rows, C, r).permute(1, 2, 0, 3, 4)
        label = None if back is None else out.new_zeros(B * rows, back.shape[-1])
        parts = _by_slot(spec)
        for slot in range(slots):
            block = out[:, :, slot]
            if slot not in parts:
                block.zero_()
            for index, (_, row, length, source, source_row, weight, weight_row) in enumerate(parts.get(slot, ())):
                target = _rows(block, row, length)
                value = _rows(tensors[source], source_row, length)
                factor = None if weight < 0 else _rows(tensors[weight], weight_row, length)
                if index:  # a later part of the slot: added in order
                    target += value if factor is None else factor * value
                    continue
                block[:, :row] = 0
                block[:, row + length :] = 0
                write_product(target, value, factor)
            if back is not None:
                label.addmm_(block.reshape(B * rows, C * r), back[slot])
        ctx.spec, ctx.slots, ctx.with_back = spec, slots, back is not None
        ctx.save_for_backward(out if back is not None else None, back, *tensors)
        if back is None:
            return out, None
        return out, label.view(B, rows, -1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_label):
        out, back, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        grads = [None] * len(tensors)
        grad_back = None
        if grad_label is not None and ctx.needs_input_grad[3]:
            grad_back = torch.empty_like(back)

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

        parts = _by_slot(ctx.spec)
        if grad_label is not None:
            shape = out.shape[:2] + out.shape[3:]  # one slot's [B, rows, C, r]
            labels = grad_label.reshape(shape[0] * shape[1], -1)
        for slot in range(ctx.slots):
            block = None if grad is None else grad[:, :, slot]
            if grad_label is not None:  # this slot's share of the label logits' gradient
                from_labels = (labels @ back[slot].T).view(shape)
                block = from_labels if block is None else from_labels.add_(block)
                if grad_back is not None:
                    torch.mm(out[:, :, slot].reshape(labels.shape[0], -1).T, labels, out=grad_back[slot])
            if block is None:
                continue
            for _, row, length, source, source_row, weight, weight_row in parts.get(slot, ()):
                part = _rows(block, row, length)
                w = None if weight < 0 else _rows(tensors[weight], weight_row, length)
                if needs[source]:
                    accumulate(source, source_row, part, w)
                if weight >= 0 and needs[weight]:
                    accumulate(weight, weight_row, (part * _rows(tensors[source], source_row, length)).sum(-1, True))
        return (None, None, None, grad_back, *grads)


def assemble(parts: list[Part], slots: int, rows: int, back: torch.Tensor | None = None):
    """``(out [B, rows, slots, C, r], label message [B, rows, d] or None)``: each slot of
    ``out`` the sum of its parts in the order given (zero where none), and with ``back
    [slots, C r, d]`` the back-projection ``sum_s out[:, :, s] back[s]`` (flattened over
    C r); differentiable in every source, weight and ``back``."""
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
    return _Assemble.apply(spec, slots, rows, back, *tensors)


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
