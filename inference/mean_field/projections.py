"""The label <-> head-space projections of mean field, as GEMMs over token rows, one per
distance group.

``project``: label marginals ``q [B, N, d]`` -> per-group, per-channel projections
``query = q U``, ``key = q V``, each ``[B, N, K, C, r]`` (K = 1: one shared by every group).
``back_project``: the head kernels' messages back to label space, ``forward U^T`` and
``reverse V^T`` times their weights, summed over groups and channels. ``at_label_rank``:
tables of a rank r above the label count d re-factored at rank d, ``(U V^T, I)`` (``MeanField``
projects with those: the same ternary tensor, a quarter of the numbers at d = 16, r = 64);
r below is the rank of the tables given.

Layout: the projections are stored group-major, ``[K, B, N, C, r]``, and handed out as
``[B, N, K, C, r]`` views. A kernel reads one group at a time (a near diagonal, a far
attention), and one group's rows are then one contiguous block: read token-major, each
token's C r numbers of a group lie one K C r stride apart, a pass over a group that is not
in cache reads memory in short strided runs (docs/benchmarks.md, "Group-major projections
and messages", has the measurements). The fused kernel writes its messages the same way
(slot-major, ``[2 K, B, N, C, r]``), and ``back_project`` reads them with one batched GEMM.
Tables made ``as_groups`` (the fused kernel's) have ``project`` hand the groups out as
separate tensors instead.

``GemmTables`` holds the tables in the GEMMs' layouts; an unrolled forward makes them once and
every iteration reuses them (the layout copies, the weights' products and the tables'
gradients then happen once per forward, not once per iteration).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from inference.mean_field.kernels.precision import full_precision

__all__ = ["GemmTables", "at_label_rank", "project", "back_project"]


def _per_group(table: torch.Tensor) -> torch.Tensor:
    """``[K, C, d, r]`` -> ``[K, d, C r]``: one GEMM's right factor per group."""
    K, C, d, r = table.shape
    return table.permute(0, 2, 1, 3).reshape(K, d, C * r)


@full_precision
def at_label_rank(u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ternary tensor ``T = u v^T`` at rank d when the tables' rank r is larger:
    ``(T, I)``, each ``[K, C, d, d]``. The scores ``(q u) . (q' v) = (q T) . q'`` and the label
    messages are the same numbers, but every projection, attention and head-space message
    then carries d numbers per channel instead of r. Under autocast ``T`` is computed in
    float32 (``full_precision``), then rounded once, where the GEMMs read it."""
    K, C, d, _ = u.shape
    identity = torch.eye(d, dtype=u.dtype, device=u.device).expand(K, C, d, d)
    return torch.einsum("kcar,kcbr->kcab", u, v), identity


@dataclass(frozen=True)
class GemmTables:
    query: torch.Tensor  # [K, d, C r]
    key: torch.Tensor  # [K, d, C r]
    back: torch.Tensor  # [2 K, C r, d]: forward and reverse messages to label logits, weighted
    shape: tuple[int, int, int]  # (K, C, r) of the projections
    groups: tuple[int, ...] | None = None  # the distance groups kept, in order (None: all)
    as_groups: bool = False  # project hands out each projection as the tuple of its groups

    @classmethod
    def of(cls, u, v, scales: dict, groups: tuple[int, ...] | None = None, as_groups: bool = False) -> GemmTables:
        """From tables ``u, v [K, C, d, r]`` and the message weights ``scales["head"]`` and
        ``scales["dependents"]``; ``groups``: project onto these groups only (the others'
        GEMM columns are never computed); ``as_groups``: see ``project``."""
        if groups is not None:
            u, v = u[list(groups)], v[list(groups)]
        query, key = _per_group(u), _per_group(v)
        back = torch.cat([scales["head"] * query.transpose(1, 2), scales["dependents"] * key.transpose(1, 2)])
        return cls(query, key, back, (u.shape[0], u.shape[1], u.shape[3]), groups, as_groups)


class _GroupProjection(torch.autograd.Function):
    """``rows [M, d]`` times each group's table ``[K, d, C r]``: K separate outputs, each with
    its own gradient edge, so that a kernel reading the groups apart hands their gradients
    straight to these GEMMs (split from one ``[.., K, ..]`` tensor, autograd would first
    stack them into a copy of the whole)."""

    @staticmethod
    def forward(ctx, rows, table):
        ctx.set_materialize_grads(False)  # an unread group's gradient stays None: no zeros made
        ctx.save_for_backward(rows, table)
        return tuple(rows @ table[k] for k in range(table.shape[0]))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        rows, table = ctx.saved_tensors
        # under autocast the outputs (and so their gradients) are half precision: the backward
        # computes in the table's type, with autocast off, and returns each input's own type
        with torch.autocast(rows.device.type, enabled=False):
            return _group_projection_gradients(rows, table, grads, ctx.needs_input_grad)


def _group_projection_gradients(rows, table, grads, needs) -> tuple:
    """``(grad of rows, grad of table)`` from the K outputs' gradients (None: not read)."""
    grad_rows, grad_table = None, (torch.zeros_like(table) if needs[1] else None)
    wide_rows = rows.to(table.dtype)
    for k, grad in enumerate(grads):
        if grad is None:
            continue
        grad = grad.reshape(rows.shape[0], -1).to(table.dtype)
        if needs[0]:
            product = grad @ table[k].T
            grad_rows = product if grad_rows is None else grad_rows.add_(product)
        if grad_table is not None:
            torch.mm(wide_rows.T, grad, out=grad_table[k])
    return (None if grad_rows is None else grad_rows.to(rows.dtype)), grad_table


def project(q_z: torch.Tensor, tables: GemmTables):
    """``(query, key)`` ``[B, N, K, C, r]``, views of group-major ``[K, B, N, C, r]``: one
    batched GEMM per table over the groups. Two GEMMs, not one over ``[U | V]``: their
    gradients arrive separately, and one GEMM would first stack them (a copy of both).

    Tables made ``as_groups``: each as a tuple of its K groups ``[B, N, C, r]`` instead, each
    group its own output (the fused kernel reads them so, ``head_kernels.fused``)."""
    B, N, d = q_z.shape
    K, C, r = tables.shape
    if tables.as_groups:
        rows = q_z.reshape(B * N, d)
        return tuple(
            tuple(group.view(B, N, C, r) for group in _GroupProjection.apply(rows, table))
            for table in (tables.query, tables.key)
        )

    def batched_gemm(table: torch.Tensor) -> torch.Tensor:
        # bmm of the rows expanded over the groups: matmul's broadcasting backward transposes
        # the whole gradient into a copy first
        rows = q_z.reshape(1, B * N, d).expand(K, B * N, d)
        return torch.bmm(rows, table).view(K, B, N, C, r).permute(1, 2, 0, 3, 4)

    return batched_gemm(tables.query), batched_gemm(tables.key)


def _slot_major(stacked: torch.Tensor) -> bool:
    """Are ``stacked [B, N, 2, K, C, r]``'s slots the outermost dimension of its storage?"""
    return stacked.permute(2, 3, 0, 1, 4, 5).is_contiguous()


def back_project(stacked: torch.Tensor, tables: GemmTables) -> torch.Tensor:
    """``[B, N, d]``: ``scales["head"] forward U^T + scales["dependents"] reverse V^T``, from
    the messages ``stacked [B, N, 2, K, C, r]`` (forward, reverse). Slot-major (as the fused
    kernel writes them): one batched GEMM over the 2 K slots, read and differentiated in
    place, then summed; otherwise one GEMM over the token rows."""
    B, N, _, K, C, r = stacked.shape
    if _slot_major(stacked):
        per_slot = torch.bmm(stacked.permute(2, 3, 0, 1, 4, 5).reshape(2 * K, B * N, C * r), tables.back)
        return per_slot.sum(0).view(B, N, -1)
    return stacked.flatten(2) @ tables.back.flatten(0, 1)
