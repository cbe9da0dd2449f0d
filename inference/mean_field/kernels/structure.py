"""What a head kernel reads and returns, as data: the arcs of one batch (``HeadStructure``)
and the head messages (``HeadMessages``). The kernels (``inference.mean_field.kernels.head_kernels``,
``inference.mean_field.kernels.flex``) are functions of them.

Memory: a structure holds O(B N) per batch. The token arcs are the topology's rule of
positions (``graphs.Topology.token_rule``), asked for the blocks a kernel reads, or its own
table (``token_arcs [n, n]``, cached once per (topology, n, device) by ``graphs.Topology.mask``,
built on first read where a kernel needs it whole); a topology whose rows have token arcs of
their own length (``graphs.Topology.row_tokens``) has one table per row instead,
``[B, n, n]`` bool, a view of its ``[B, N, N]`` arcs: O(B N^2) bytes, not linear in n;
the arcs touching virtual nodes are ``border`` (``[B, n, m]`` and ``[B, m, N]``), and the rows
with a legal head (``has_head``) are counted from prefix sums over the nodes on a band
topology. The ``[B, N, N]`` arcs and the ``[N, N]`` distance groups are built only when a
kernel that materialises them (the naive one, the explicit ELBO) or a row's own token table
reads them, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphs.distances import distance_groups

__all__ = ["HeadStructure", "HeadMessages", "segment_span", "each_group"]

# float copies of non-band token tables (has_head's counts), newest last: key -> (table, copy)
_FLOAT_TABLES: dict = {}
_FLOAT_TABLES_KEPT = 8
_RULE_ROWS = 128  # rows of a token rule evaluated at once (has_head off a band): O(128 n) memory


def each_group(fn, projection):
    """``fn`` of a projection ``[B, N, K, C, r]``, or of each of its groups when it comes as
    their tuple (``projections.project`` with the fused kernel's tables)."""
    return tuple(map(fn, projection)) if isinstance(projection, tuple) else fn(projection)


def segment_span(lo: int, hi: int, n: int, length: int, before: int = 0, after: int = 0) -> tuple[int, int]:
    """``[start, stop)``: the tokens of the segments (of ``length`` tokens) from ``before``
    segments ahead of row ``lo``'s to ``after`` past row ``hi - 1``'s, within ``[0, n)``:
    where ``segments(l)``'s heads of rows ``lo <= i < hi`` lie (``before=1``: its arcs reach
    the previous segment; ``after=1`` for their transposes)."""
    start = max(0, (lo // length - before) * length)
    return start, min(n, ((hi - 1) // length + 1 + after) * length)


class HeadStructure:
    """Everything a kernel needs to know about the arcs of one batch.

    Args:
        n: tokens; gamma, cuts: the distance buckets (``cuts`` None: 2 .. gamma + 1).
        nodes: ``[B, N]`` bool, the nodes each row has (tokens, then the m virtual nodes).
        token_arcs: ``[n, n]`` bool, the topology alone between tokens; ``[B, n, n]``, each
            row's own (``row_tokens``); or None: the topology's rule answers for the blocks a
            kernel reads (its table is built on first read of ``token_arcs``; a topology with
            ``row_tokens`` gets each row's from ``arcs``).
        groups: ``[N, N]`` long distance groups, or None (built on first read).
        arcs: ``[B, N, N]`` bool (topology and existing nodes), or None (built on first read
            from the token table, the nodes and ``border``).
        band: the topology's token offsets ``(left, right)`` if a band.
        prior: ``[C, N, N]`` log prior on heads (adaptive span); the naive kernel only.
        border: ``(token_to_virtual [B, n, m], virtual_rows [B, m, N])``, the arcs touching a
            virtual node (existing nodes only), or None (sliced from ``arcs``).
        topology: the ``graphs.Topology`` (a cache key for the kernels' tables), or None.
    """

    def __init__(
        self,
        n: int,
        gamma: int,
        nodes: torch.Tensor,
        token_arcs: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        arcs: torch.Tensor | None = None,
        band: tuple[float, float] | None = None,
        prior: torch.Tensor | None = None,
        cuts: tuple[int, ...] | None = None,
        border: tuple[torch.Tensor, torch.Tensor] | None = None,
        topology=None,
    ):
        if token_arcs is None and topology is None:
            raise ValueError("a HeadStructure needs its token_arcs or a topology to read them from")
        self.n, self.gamma, self.nodes, self._token_arcs = n, gamma, nodes, token_arcs
        self._table_built = None  # the topology's table, once a kernel read it whole
        self.band, self.prior, self.cuts, self.topology = band, prior, cuts, topology
        self._groups, self._arcs, self._border, self._has_head = groups, arcs, border, None
        self.cache: dict = {}  # what a kernel derives from this batch once (flex's block masks)

    def __repr__(self) -> str:
        return f"HeadStructure(n={self.n}, nodes={list(self.nodes.shape)}, gamma={self.gamma}, band={self.band})"

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
    def virtual_group(self) -> int:
        return 2 * (self.gamma + 1)

    @property
    def virtual(self) -> int:
        """m, the number of virtual nodes."""
        return self.nodes.shape[1] - self.n

    @property
    def row_tokens(self) -> bool:
        """Whether each row has token arcs of its own (``token_arcs [B, n, n]``): a topology
        whose arcs depend on the row's real length (``graphs.Topology.row_tokens``)."""
        if self._token_arcs is not None:
            return self._token_arcs.dim() == 3
        return self.topology.row_tokens

    @property
    def token_arcs(self) -> torch.Tensor:
        """``[n, n]`` bool: the topology alone between tokens (the table: built on first read
        when the structure was given the topology's rule); ``[B, n, n]`` where each row has its
        own (``row_tokens``: a view of ``arcs``, so between existing tokens only)."""
        if self._token_arcs is not None:
            return self._token_arcs
        if self._table_built is None:  # built once; the rule stays what the other kernels ask
            n = self.n
            if self.topology.row_tokens:
                self._table_built = self.arcs[:, :n, :n]
            else:
                self._table_built = self.topology.mask(n, self.nodes.device)[:n, :n]
        return self._table_built

    @property
    def token_rule(self):
        """The topology's rule of positions (``graphs.Topology.token_rule``) when the structure
        reads the token arcs from it, else None (the table says)."""
        if self._token_arcs is not None or self.topology is None:
            return None
        return self.topology.token_rule

    def token_mask(self, transposed: bool = False):
        """What a kernel asks about token arcs: the rule (a function of position tensors) when
        there is one, else the ``[n, n]`` table; ``transposed``: of the reversed arcs (j -> i)."""
        if self.token_rule is not None:
            return self.topology.token_rule_transposed if transposed else self.token_rule
        return self.token_arcs.transpose(-2, -1) if transposed else self.token_arcs

    @property
    def groups(self) -> torch.Tensor:
        """``[N, N]`` long: each arc's distance group (built on first read)."""
        if self._groups is None:
            N = self.nodes.shape[1]
            self._groups = distance_groups(self.n, self.gamma, N - self.n, self.nodes.device, self.cuts)
        return self._groups

    @property
    def arcs(self) -> torch.Tensor:
        """``[B, N, N]`` bool: the topology's arcs between existing nodes (built on first read)."""
        if self._arcs is None:
            n, nodes = self.n, self.nodes
            if self._token_arcs is None and self.topology.row_tokens:  # each row's own, from its real length
                self._arcs = self.topology.arcs(nodes[:, :n])
                return self._arcs
            tokens = self.token_arcs & nodes[:, :n, None] & nodes[:, None, :n]  # one table, or one per row
            to_virtual, virtual_rows = self.border
            self._arcs = torch.cat([torch.cat([tokens, to_virtual], -1), virtual_rows], 1)
        return self._arcs

    @arcs.setter
    def arcs(self, arcs: torch.Tensor) -> None:
        self._arcs, self._border, self._has_head = arcs, None, None
        self._table_built = None  # a table per row (row_tokens) is a view of the arcs
        self.cache.clear()

    @property
    def border(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_to_virtual [B, n, m], virtual_rows [B, m, N])``: the arcs touching a
        virtual node."""
        if self._border is None:
            n, nodes = self.n, self.nodes
            if self._arcs is not None or (self._token_arcs is None and self.topology.row_tokens):
                self._border = (self.arcs[:, :n, n:], self.arcs[:, n:, :])  # given, or built from each row's length
            elif self.virtual == 0:
                self._border = (nodes.new_zeros(nodes.shape[0], n, 0), nodes.new_zeros(nodes.shape[0], 0, n))
            else:
                raise ValueError("a structure with virtual nodes needs its arcs or their border")
        return self._border

    def diagonal(self, offset: int) -> torch.Tensor:
        """``[B, n - |offset|]`` bool: is (i, i + offset) an arc, for the rows where both exist
        (views of the token table and the nodes: nothing ``[B, n, n]``)."""
        n, nodes = self.n, self.nodes
        lo, hi = max(0, -offset), n - max(0, offset)
        if self._arcs is not None:  # given explicitly: the arcs are the truth
            return self._arcs[:, :n, :n].diagonal(offset, dim1=1, dim2=2)
        if self.token_rule is not None:
            rows = torch.arange(lo, hi, device=nodes.device)
            arcs = self.token_rule(rows, rows + offset)
        else:  # [n - |offset|], or [B, n - |offset|] from each row's own table
            arcs = self.token_arcs.diagonal(offset, dim1=-2, dim2=-1)
        return arcs & nodes[:, lo:hi] & nodes[:, lo + offset : hi + offset]

    @property
    def has_head(self) -> torch.Tensor:
        """``[B, N]`` bool: rows with at least one legal head."""
        if self._has_head is None:
            if self._arcs is not None:
                self._has_head = self._arcs.any(-1)
            else:
                to_virtual, virtual_rows = self.border
                tokens = self._token_has_head() | to_virtual.any(-1)
                self._has_head = torch.cat([tokens, virtual_rows.any(-1)], 1)
        return self._has_head

    def _token_has_head(self) -> torch.Tensor:
        """``[B, n]``: token rows with a token head. A band: counted from prefix sums of the
        nodes (O(B n)); a rule: a block of rows at a time against the heads it can reach (its
        own and the previous segment for ``segments(l)``: O(B n l); every token otherwise);
        any other table: one product with a float copy of it, kept per table (a table per
        row: its rows' heads among the row's tokens)."""
        n, real = self.n, self.nodes[:, : self.n]
        if self.band is not None:
            left, right = band_limits(self.band, n)
            prefix = F.pad(real.to(torch.int32).cumsum(1, dtype=torch.int32), (1, 0))  # [B, n + 1]
            rows = torch.arange(n, device=real.device)
            count = prefix[:, (rows + right + 1).clamp(max=n)] - prefix[:, (rows - left).clamp(min=0)]
            return real & (count - real.to(torch.int32) > 0)  # the row's own token is no head
        if self.token_rule is not None:  # the rule, a block of rows at a time: O(block n) memory
            length, weights, found = getattr(self.topology, "segment_length", None), real.to(torch.float32), []
            for lo in range(0, n, _RULE_ROWS):
                hi = min(lo + _RULE_ROWS, n)
                start, stop = (0, n) if length is None else segment_span(lo, hi, n, length, before=1)
                rows, heads = (torch.arange(a, b, device=real.device) for a, b in ((lo, hi), (start, stop)))
                allowed = self.token_rule(rows[:, None], heads[None, :]).to(torch.float32)  # [rows, heads]
                found.append((weights[:, start:stop] @ allowed.T) > 0.5)  # [B, rows]
            return real & torch.cat(found, 1)
        if self.row_tokens:  # each row's own table, O(B n^2) bytes already
            return real & (self.token_arcs & real[:, None, :]).any(-1)
        table = _float_table(self.token_arcs)
        return real & ((real.to(table.dtype) @ table.T) > 0.5)


def _float_table(token_arcs: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a bool table, kept for the table's lifetime in a small cache (the
    topology's own table is cached per (n, device), so one copy serves every batch)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # a traced graph keeps no cache
        return token_arcs.to(torch.float32)
    key = (token_arcs.data_ptr(), tuple(token_arcs.shape), token_arcs.stride(), token_arcs.device)
    cached = _FLOAT_TABLES.get(key)
    if cached is None:
        cached = (token_arcs, token_arcs.to(torch.float32))
        _FLOAT_TABLES[key] = cached  # holds the table: its address is not reused while kept
        while len(_FLOAT_TABLES) > _FLOAT_TABLES_KEPT:
            _FLOAT_TABLES.pop(next(iter(_FLOAT_TABLES)))
    return cached[1]


def band_limits(band: tuple[float, float], n: int) -> tuple[int, int]:
    """A band's ``(left, right)`` as integers no wider than the sentence."""
    return tuple(n if side == math.inf else min(int(side), n) for side in band)


@dataclass
class HeadMessages:
    forward: torch.Tensor | None  # [B, N, K, C, r] (None when only lse was asked for)
    reverse: torch.Tensor | None  # [B, N, K, C, r]
    lse: torch.Tensor  # [B, C, N]
    probs: torch.Tensor | None = None  # [B, C, N, N] (naive only)
    logits: torch.Tensor | None = None  # [B, C, N, N] (naive only; for damping)
    query: torch.Tensor | tuple | None = None  # the projections the head marginals were computed from
    key: torch.Tensor | tuple | None = None  # (a tuple: the K groups, ``project(..., grouped=True)``)
    stacked: torch.Tensor | None = None  # [B, N, 2, K, C, r]: forward and reverse in one tensor (fused)
    groups: tuple[int, ...] | None = None  # the group of each projection slot (None: slot k is group k)
    # [B, N, d]: the messages back-projected to label logits through the tables the kernel was
    # given (fused, when given them; ``projections.back_project`` of ``stacked`` otherwise),
    # and those tables (``GemmTables.back``): a caller with other tables must not use it
    label_message: torch.Tensor | None = None
    label_back: torch.Tensor | None = None
