"""``Topology``: which head arcs a sentence's factor graph has, as data.

For a sentence of ``n`` tokens a topology names ``n + m`` nodes: the tokens first, then
``m`` *virtual* nodes (a Star-Transformer relay, SwarmFormer cluster nodes) that carry
labels but no word. ``mask(n)[i, j]`` is True when node ``i`` may choose node ``j`` as
its head in a channel; the diagonal is always False (no self-arcs). ``graph(n)`` is the
same arc set as a ``networkx.DiGraph`` with an edge ``i -> j`` for "i may choose j as
head", for inspection and plotting.

Topologies compose with ``|`` (union): token-token arcs are OR-ed, and each operand's
virtual nodes are kept, laid out one operand after the other. Arcs are laid over the
positions ``0..n-1`` of a (possibly padded) batch; a padded position simply loses its
node (see ``graphs.CRF``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphs.limits import check_length

__all__ = ["Topology"]

# Topology.mask(n, device) copies, newest last: (id, (n, device)) -> (topology, mask)
_MASKS: dict = {}
_MASKS_KEPT = 64


@dataclass(frozen=True)
class Topology:
    """An arc set over ``n`` tokens plus a fixed number of virtual nodes.

    ``virtual`` names the virtual nodes (in order); ``build(n)`` returns the
    ``[n + len(virtual), n + len(virtual)]`` boolean mask. ``band = (left, right)``
    says, when it is known symbolically, that the token-token arcs are exactly the
    offsets ``-left <= j - i <= right`` (``math.inf`` for unbounded); None means an
    arbitrary pattern. Engines use it to pick mask-free kernels. ``segment_length`` is
    set by ``segments(l)``: arcs stay within a segment and the one before it.

    ``build_rows(mask)`` is set where the arcs depend on the sentence length and not only
    on positions (contiguous ``clusters``, ``star(wrap=True)``, a function of n): from a
    batch's token mask ``[B, n]`` it builds every row for its real length,
    ``[B, n + m, n + m]``. ``arcs(mask)`` uses it. ``row_tokens`` says that the token-token
    arcs are among them (not only arcs to virtual nodes): an engine then reads each row's
    token arcs from ``arcs(mask)``, never one ``mask(n)`` table for the whole batch.

    ``token_rule(i, j)``, where known, says whether token i may choose token j from their
    positions alone (bool, for position tensors that broadcast; never a self-arc): a kernel
    asks it for the blocks it reads instead of building the ``[n, n]`` table, so a long
    sentence on a sparse topology costs memory linear in n. None: only ``mask(n)`` says.
    """

    name: str
    virtual: tuple[str, ...]
    build: Callable[[int], torch.Tensor]
    band: tuple[float, float] | None = None
    segment_length: int | None = None
    build_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    data: dict | None = field(default=None, compare=False)  # how to store it (see to_data); None: it cannot be
    build_border: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None  # see border()
    token_rule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    row_tokens: bool = False  # a row's token-token arcs depend on its real length (build_rows says)

    @functools.cached_property
    def token_rule_transposed(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """``token_rule`` of the reversed arcs (may token j choose token i), one function per
        topology, so a kernel's caches keyed on it hit on every batch."""
        rule = self.token_rule
        return None if rule is None else lambda i, j: rule(j, i)

    @property
    def n_max(self) -> int | None:
        """The number of positions of a topology from a graph or mask (None: any length)."""
        return self.data["n_max"] if self.data is not None and "n_max" in self.data else None

    @property
    def extra_nodes(self) -> int:
        return len(self.virtual)

    def num_nodes(self, n: int) -> int:
        return n + self.extra_nodes

    def mask(self, n: int, device=None) -> torch.Tensor:
        """Boolean ``[n + m, n + m]``: ``mask[i, j]`` iff node i may take node j as head. With
        ``device``, a copy there, made once per (n, device) and kept: a forward on a GPU
        copies no mask from the CPU after its first batch of that length."""
        if device is not None and not isinstance(n, torch.SymInt) and not torch.compiler.is_compiling():
            key = (n, torch.device(device))
            cached = _MASKS.get((id(self), key))
            if cached is None or cached[0] is not self:
                with torch.device(device):  # the builders' factory calls make it there, not on the CPU
                    built = self.mask(n)
                cached = (self, built.to(device))  # a no-op unless a builder sliced a stored table (arcs)
                _MASKS[(id(self), key)] = cached
                while len(_MASKS) > _MASKS_KEPT:  # the oldest first
                    _MASKS.pop(next(iter(_MASKS)))
            return cached[1]
        n = check_length(n, self.extra_nodes)
        arcs = self.build(n)
        if device is not None:
            arcs = arcs.to(device)
        nodes = torch.arange(arcs.shape[0], device=arcs.device)
        return arcs & (nodes[:, None] != nodes[None, :])  # no self-arcs; out of place, so export keeps n symbolic

    def arcs(self, mask: torch.Tensor) -> torch.Tensor:
        """``[B, n + m, n + m]`` bool for a padded batch (``mask [B, n]``, True for a real
        token): the arcs of each row between the nodes it has (a padded position loses its
        node; the virtual nodes are in every row). A row's arcs are those of its real length
        (the number of its real tokens), so a sentence has the same arcs however much
        padding its batch adds. For a topology made of positions alone (no ``build_rows``)
        this is ``mask(n)`` cut to each row's nodes."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
            raise ValueError(f"mask must be a bool tensor [batch, n], got {getattr(mask, 'shape', mask)!r}")
        batch, n = mask.shape
        check_length(n, self.extra_nodes)
        rows = self._rows(mask)
        nodes = torch.cat([mask, mask.new_ones(batch, self.extra_nodes)], 1)
        index = torch.arange(n + self.extra_nodes, device=mask.device)
        not_self = index[:, None] != index[None, :]
        return rows & nodes[:, :, None] & nodes[:, None, :] & not_self

    def border(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_to_virtual [B, n, m], virtual_rows [B, m, n + m])``: the rows and columns of
        ``arcs(mask)`` that touch a virtual node, without building the ``[B, N, N]`` arcs (a
        memory-linear kernel reads the token arcs from ``mask(n)`` and these)."""
        batch, n = mask.shape
        m = self.extra_nodes
        if self.build_border is not None:
            return self.build_border(mask)
        if m == 0:  # no virtual node: nothing to read from a table
            return mask.new_zeros(batch, n, 0), mask.new_zeros(batch, 0, n)
        if self.build_rows is not None:  # no border of its own: sliced from the rows
            arcs = self.arcs(mask)
            return arcs[:, :n, n:], arcs[:, n:, :]
        table = self.mask(n, mask.device)  # cached; its self-arcs removed
        nodes = torch.cat([mask, mask.new_ones(batch, m)], 1)
        return table[:n, n:][None] & mask[:, :, None], table[n:, :][None] & nodes[:, None, :]

    def _rows(self, mask: torch.Tensor) -> torch.Tensor:
        if self.build_rows is not None:
            return self.build_rows(mask)
        n = mask.shape[1]
        if isinstance(n, torch.SymInt) or torch.compiler.is_compiling():
            arcs = self.build(n).to(mask.device)
        else:  # the cached device copy (its self-arcs removed: arcs() removes them anyway)
            arcs = self.mask(n, mask.device)
        return arcs[None].expand(mask.shape[0], -1, -1)

    def graph(self, n: int):
        """The arcs as a networkx DiGraph (edge i -> j: i may choose j as head); nodes carry
        ``kind``. networkx is imported here only: masks need torch alone."""
        import networkx as nx

        arcs = self.mask(n)
        g = nx.DiGraph(topology=self.name)
        for i in range(n):
            g.add_node(i, kind="token")
        for v, label in enumerate(self.virtual):
            g.add_node(n + v, kind=label)
        g.add_edges_from(map(tuple, arcs.nonzero().tolist()))
        return g

    def __or__(self, other: Topology) -> Topology:
        if not isinstance(other, Topology):
            return NotImplemented
        left, right = self, other

        ma, mb = left.extra_nodes, right.extra_nodes

        def union(a: torch.Tensor, b: torch.Tensor, n) -> torch.Tensor:
            """``a [..., n + ma, n + ma] | b [..., n + mb, n + mb]`` on ``[..., N, N]``."""
            # b's virtual nodes sit after a's: tokens keep indices 0..n-1. Built by
            # concatenation, not index assignment, so a traced length stays symbolic.
            lead = b.shape[:-2]
            gap_rows, gap = b.new_zeros(*lead, ma, n + ma + mb), b.new_zeros(*lead, n + mb, ma)
            b_cols = torch.cat([b[..., :, :n], gap, b[..., :, n:]], -1)  # [..., n + mb, N]
            b_spread = torch.cat([b_cols[..., :n, :], gap_rows, b_cols[..., n:, :]], -2)
            return torch.nn.functional.pad(a, (0, mb, 0, mb)) | b_spread

        def build(n: int) -> torch.Tensor:
            return union(left.build(n), right.build(n), n)

        def build_rows(mask: torch.Tensor) -> torch.Tensor:
            return union(left._rows(mask), right._rows(mask), mask.shape[1])

        def build_border(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            (to_a, rows_a), (to_b, rows_b) = left.border(mask), right.border(mask)
            n, batch = mask.shape[1], mask.shape[0]
            rows_a = torch.cat([rows_a, rows_a.new_zeros(batch, ma, mb)], -1)  # b's virtual nodes after a's
            rows_b = torch.cat([rows_b[..., :n], rows_b.new_zeros(batch, mb, ma), rows_b[..., n:]], -1)
            return torch.cat([to_a, to_b], -1), torch.cat([rows_a, rows_b], 1)

        band = None
        if left.band is not None and right.band is not None:  # nested bands: the union is a band
            band = (max(left.band[0], right.band[0]), max(left.band[1], right.band[1]))
        rows = build_rows if left.build_rows is not None or right.build_rows is not None else None
        data = None
        if left.data is not None and right.data is not None:
            both_text = "text" in left.data and "text" in right.data
            data = {"text": f"{left.name} | {right.name}"} if both_text else {"union": [left.data, right.data]}
        token_rule = None
        if left.token_rule is not None and right.token_rule is not None:  # token arcs are OR-ed

            def token_rule(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
                return left.token_rule(i, j) | right.token_rule(i, j)

        name = f"{left.name} | {right.name}"
        virtual = left.virtual + right.virtual
        row_tokens = left.row_tokens or right.row_tokens
        return Topology(
            name, virtual, build, band, None, rows, data, build_border, token_rule=token_rule, row_tokens=row_tokens
        )

    def __repr__(self) -> str:
        return f"Topology({self.name})"

    def to_data(self) -> dict:
        """A JSON-able description that ``graphs.topology.from_data`` (and ``parse``) turns back
        into the same arcs:
        ``{"text": "window(2) | star()"}`` for the built-ins, ``{"arcs": [[i, j], ...],
        "n_max": n}`` for a graph or a mask, ``{"union": [a, b]}`` for a union of both kinds.
        ``ValueError`` for a topology that cannot be stored (built from a callable, or by
        hand): refused before anything is written."""
        if self.data is None:
            raise ValueError(
                f"topology {self.name!r} cannot be stored as data (it was built from a callable or by hand); "
                f"store a built-in topology, a networkx DiGraph or a boolean mask over n_max positions instead"
            )
        return self.data
