"""The label <-> head-space projections of mean field, as plain GEMMs over token-major rows.

``project``: label marginals ``q [B, N, d]`` -> per-group, per-channel projections
``query = q U``, ``key = q V``, each ``[B, N, K, C, r]`` (K = 1: one shared by every group).
``back_project``: the head kernels' messages back to label space, ``forward U^T`` and
``reverse V^T`` times their weights, summed over groups and channels.

``GemmTables`` holds the tables in the GEMMs' layouts; an unrolled forward makes them once and
every iteration reuses them (the layout copies, the weights' products and the tables'
gradients then happen once per forward, not once per iteration).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GemmTables", "project", "back_project"]


def _rows(table: torch.Tensor) -> torch.Tensor:
    """``[K, C, d, r]`` -> ``[d, K C r]``: the GEMM's right factor for one table."""
    K, C, d, r = table.shape
    return table.permute(2, 0, 1, 3).reshape(d, K * C * r)


@dataclass(frozen=True)
class GemmTables:
    query: torch.Tensor  # [d, K C r]
    key: torch.Tensor  # [d, K C r]
    back: torch.Tensor  # [2 K C r, d]: forward and reverse messages to label logits, weighted
    shape: tuple[int, int, int]  # (K, C, r) of the projections
    groups: tuple[int, ...] | None = None  # the distance groups kept, in order (None: all)

    @classmethod
    def of(cls, u: torch.Tensor, v: torch.Tensor, scales: dict, groups: tuple[int, ...] | None = None) -> GemmTables:
        """From tables ``u, v [K, C, d, r]`` and the message weights ``scales["head"]`` and
        ``scales["dependents"]``; ``groups``: project onto these groups only (the others'
        GEMM columns are never computed)."""
        if groups is not None:
            u, v = u[list(groups)], v[list(groups)]
        query, key = _rows(u), _rows(v)
        back = torch.cat([scales["head"] * query.T, scales["dependents"] * key.T])
        return cls(query, key, back, (u.shape[0], u.shape[1], u.shape[3]), groups)


def project(q_z: torch.Tensor, tables: GemmTables) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query, key)`` ``[B, N, K, C, r]``: one GEMM per table over all groups and channels.
    Two GEMMs, not one over ``[U | V]``: their gradients arrive separately, and one GEMM
    would first stack them (a copy of both)."""
    shape = (*q_z.shape[:-1], *tables.shape)
    return (q_z @ tables.query).view(shape), (q_z @ tables.key).view(shape)


def back_project(stacked: torch.Tensor, tables: GemmTables) -> torch.Tensor:
    """``[B, N, d]``: ``scales["head"] forward U^T + scales["dependents"] reverse V^T`` in one
    GEMM, from the messages ``stacked [B, N, 2, K, C, r]`` (forward, reverse) as the fused
    kernel returns them (contiguous: the GEMM reads them, and its gradient is written, in place)."""
    return stacked.flatten(2) @ tables.back
