"""What a head kernel reads and returns, as data: the arcs of one batch (``HeadStructure``)
and the head messages (``HeadMessages``). The kernels (``inference.head_kernels``,
``inference.flex_kernel``) are functions of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HeadStructure", "HeadMessages"]


@dataclass
class HeadStructure:
    """Everything a kernel needs to know about the arcs of one batch."""

    n: int  # tokens
    gamma: int
    groups: torch.Tensor  # [N, N] long
    arcs: torch.Tensor  # [B, N, N] bool: topology & existing nodes
    nodes: torch.Tensor  # [B, N] bool
    token_arcs: torch.Tensor  # [n, n] bool: the topology alone, between tokens
    band: tuple[float, float] | None = None  # the topology's token offsets, if a band
    prior: torch.Tensor | None = None  # [C, N, N] log prior on heads (adaptive span); naive only
    cuts: tuple[int, ...] | None = None  # distance buckets' cut points (None: 2 .. gamma + 1)

    @property
    def bucket_cuts(self) -> tuple[int, ...]:
        return tuple(range(2, self.gamma + 2)) if self.cuts is None else self.cuts

    @property
    def reach(self) -> int:
        """The largest token offset before the last bucket (``gamma`` without cuts): offsets up
        to it are near diagonals, beyond it one far group per direction."""
        cuts = self.bucket_cuts
        return cuts[-1] - 1 if cuts else 0

    @property
    def has_head(self) -> torch.Tensor:
        return self.arcs.any(-1)

    @property
    def virtual_group(self) -> int:
        return 2 * (self.gamma + 1)


@dataclass
class HeadMessages:
    forward: torch.Tensor | None  # [B, N, K, C, r] (None when only lse was asked for)
    reverse: torch.Tensor | None  # [B, N, K, C, r]
    lse: torch.Tensor  # [B, C, N]
    probs: torch.Tensor | None = None  # [B, C, N, N] (naive only)
    logits: torch.Tensor | None = None  # [B, C, N, N] (naive only; for damping)
    query: torch.Tensor | None = None  # the projections the head marginals were computed from
    key: torch.Tensor | None = None
    stacked: torch.Tensor | None = None  # [B, N, 2, K, C, r]: forward and reverse in one tensor (fused)
    groups: tuple[int, ...] | None = None  # the group of each projection slot (None: slot k is group k)
