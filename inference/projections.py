"""The label <-> head-space projections of mean field, as plain GEMMs over token-major rows.

``project``: label marginals ``q [B, N, d]`` -> per-group, per-channel projections
``query = q U``, ``key = q V``, each ``[B, N, K, C, r]`` (K = 1: one shared by every group).
``back_project``: the head kernels' messages back to label space, ``forward U^T`` and
``reverse V^T`` times their weights, summed over groups and channels.
"""

from __future__ import annotations

import torch

__all__ = ["project", "back_project"]


def _rows(table: torch.Tensor) -> torch.Tensor:
    """``[K, C, d, r]`` -> ``[d, K C r]``: the GEMM's right factor for one table."""
    K, C, d, r = table.shape
    return table.permute(2, 0, 1, 3).reshape(d, K * C * r)


def project(q_z: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query, key)`` ``[B, N, K, C, r]``: one GEMM per table over all groups and channels.
    Two GEMMs, not one over ``[U | V]``: their gradients arrive separately, and one GEMM
    would first stack them (a copy of both)."""
    shape = (*q_z.shape[:-1], *u.shape[:2], u.shape[-1])
    return (q_z @ _rows(u)).view(shape), (q_z @ _rows(v)).view(shape)


def back_project(stacked: torch.Tensor, u: torch.Tensor, v: torch.Tensor, scales: dict) -> torch.Tensor:
    """``[B, N, d]``: ``scales["head"] forward U^T + scales["dependents"] reverse V^T`` in one
    GEMM, from the messages ``stacked [B, N, 2, K, C, r]`` (forward, reverse) as the fused
    kernel returns them (contiguous: the GEMM reads them, and its gradient is written, in place)."""
    table = torch.cat([scales["head"] * _rows(u).T, scales["dependents"] * _rows(v).T])  # [2 K C r, d]
    return stacked.flatten(2) @ table
