"""Topologies: which head arcs a sentence's factor graph has.

A topology is data. For a sentence of ``n`` tokens it names ``n + m`` nodes:
the tokens first, then ``m`` *virtual* nodes (a Star-Transformer relay, SwarmFormer
cluster nodes) that carry labels but no word. ``mask(n)[i, j]`` is True when node
``i`` may choose node ``j`` as its head in a channel; the diagonal is always False
(no self-arcs). ``graph(n)`` is the same arc set as a ``networkx.DiGraph`` with an
edge ``i -> j`` for "i may choose j as head", for inspection and plotting.

Topologies compose with ``|`` (union): token-token arcs are OR-ed, and each
operand's virtual nodes are kept, laid out one operand after the other.

Arcs are laid over the positions ``0..n-1`` of a (possibly padded) batch; a
padded position simply loses its node (see ``graphs.CRF``).

Topologies given as data (a mask, a networkx graph, a function of n, the stored dict,
the text of the built-ins) are checked and read in ``graphs.topology_data``; the
``from_*`` constructors and ``parse`` here make the ``Topology``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

# distance_groups and the limits are named here too: callers read graphs.topology.*
from graphs.distances import distance_groups
from graphs.limits import MAX_CLUSTERS, MAX_NODES, MAX_REACH, check_length, check_positive
from graphs.topology_data import arc_table, arcs_of_callable, arcs_of_graph, arcs_of_mask, read_data, read_term

__all__ = [
    "Topology",
    "full",
    "causal",
    "chain",
    "window",
    "star",
    "clusters",
    "segments",
    "root",
    "parse",
    "from_graph",
    "from_mask",
    "from_callable",
    "from_data",
    "NAMES",
    "distance_groups",
    "MAX_NODES",
    "MAX_CLUSTERS",
    "MAX_REACH",
]


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
    on positions (contiguous ``clusters``): from a batch's token mask ``[B, n]`` it builds
    every row for its real length, ``[B, n + m, n + m]``. ``arcs(mask)`` uses it.
    """

    name: str
    virtual: tuple[str, ...]
    build: Callable[[int], torch.Tensor]
    band: tuple[float, float] | None = None
    segment_length: int | None = None
    build_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    data: dict | None = field(default=None, compare=False)  # how to store it (see to_data); None: it cannot be
    build_border: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None  # see border()

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
        border = build_border if rows is not None else None
        name = f"{left.name} | {right.name}"
        return Topology(name, left.virtual + right.virtual, build, band, None, rows, data, build_border=border)

    def __repr__(self) -> str:
        return f"Topology({self.name})"

    def to_data(self) -> dict:
        """A JSON-able description that ``from_data`` turns back into the same arcs:
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

    @staticmethod
    def from_data(data) -> Topology:
        """The topology ``to_data`` described."""
        return from_data(data)


def _check_flag(name: str, value) -> None:
    # a string such as 'yes' or 'False' is truthy: refused, not read as True
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False (a bool), got {value!r}")


def _positions(size) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices ``[size, 1]`` and ``[1, size]`` of a ``[size, size]`` mask."""
    pos = torch.arange(size)
    return pos[:, None], pos[None, :]


def _offsets(n: int) -> torch.Tensor:
    """``offsets[i, j] = j - i``: head position relative to the dependent."""
    pos = torch.arange(n)
    return pos[None, :] - pos[:, None]


def full() -> Topology:
    """Every token may choose every other token (the PT / BERT encoder)."""
    return _as_text(Topology("full()", (), lambda n: torch.ones(n, n, dtype=torch.bool), (math.inf, math.inf)))


def causal() -> Topology:
    """Token i may choose only earlier tokens j < i (a decoder). Token 0 has no head."""
    return _as_text(Topology("causal()", (), lambda n: _offsets(n) < 0, (math.inf, 0)))


def chain() -> Topology:
    """Token i may choose only its left neighbour i - 1 (a linear chain: with a
    ``graphs.factors.Pairwise`` on it, the linear-chain CRF). Token 0 has no head."""
    return _as_text(Topology("chain()", (), lambda n: _offsets(n) == -1, (1, 0)))


def window(w: int) -> Topology:
    """Token i may choose tokens j with 0 < |i - j| <= w (local attention, no wrap-around)."""
    w = check_positive("window width w", w, MAX_REACH)
    return _as_text(Topology(f"window({w})", (), lambda n: _offsets(n).abs() <= w, (w, w)))


def star(wrap: bool = False) -> Topology:
    """Star-Transformer: a relay node joined both ways to every token, plus a ring.

    The ring joins each token to its neighbours i - 1 and i + 1; with ``wrap=True``
    the first and last tokens are neighbours too (a closed ring).
    """
    _check_flag("star(wrap=...)", wrap)

    def build(n: int) -> torch.Tensor:
        i, j = _positions(n + 1)
        tokens = (i < n) & (j < n)
        ring = tokens & ((j - i).abs() == 1)
        if wrap:  # first <-> last (for n <= 2 these are neighbours or self-arcs already)
            ring = ring | (tokens & ((j - i).abs() == n - 1))
        return ring | ((i < n) & (j == n)) | ((i == n) & (j < n))  # tokens <-> relay

    return _as_text(Topology(f"star(wrap={wrap})", ("relay",), build, None if wrap else (1, 1)))


def root() -> Topology:
    """A ROOT node (PT's sentence-classification variant): every token may choose it as
    head; ROOT chooses none. Compose it with a token topology, e.g. ``full() | root()``."""

    def build(n: int) -> torch.Tensor:
        i, j = _positions(n + 1)
        return (i < n) & (j == n)

    return _as_text(Topology("root()", ("root",), build, (0, 0)))


def clusters(k: int, dynamic: bool = False) -> Topology:
    """SwarmFormer: k cluster nodes that talk among themselves and broadcast back.

    Contiguous (default): token i belongs to cluster floor(i * k / n) (sizes differ by at
    most one, any n); a token may choose its own cluster as head and a cluster any of its
    members. In a padded batch (``arcs(mask)``) n is each sentence's real length and i
    counts its real tokens, so padding never moves a token to another cluster.
    ``dynamic=True``: every token may choose any cluster and every cluster any token, so
    the head posterior of a token over the cluster nodes *is* its routing
    distribution (``probformer.SwarmFormer``'s Gumbel-softmax routing reads it as a sample).
    Clusters may always choose each other. Tokens do not see each other: compose with
    ``window`` for local token-token arcs.
    """
    k = check_positive("number of clusters k", k, MAX_CLUSTERS)
    _check_flag("clusters(dynamic=...)", dynamic)

    def belongs(mask: torch.Tensor) -> torch.Tensor:
        """``[B, n, k]``: token i's cluster (real tokens only)."""
        batch, n = mask.shape
        if dynamic:
            return mask[:, :, None].expand(batch, n, k)
        # contiguous over the real tokens: the r-th of L real tokens joins floor(r k / L)
        length = mask.sum(1, keepdim=True).clamp(min=1)
        rank = (mask.long().cumsum(1) - 1).clamp(min=0)
        member = torch.div(rank * k, length, rounding_mode="floor")
        return (member[:, :, None] == torch.arange(k, device=mask.device)) & mask[:, :, None]

    def build_rows(mask: torch.Tensor) -> torch.Tensor:
        batch, n = mask.shape
        member = belongs(mask)
        tokens = torch.cat([member.new_zeros(batch, n, n), member], 2)  # token -> its cluster
        nodes = torch.cat([member.transpose(1, 2), member.new_ones(batch, k, k)], 2)  # cluster -> members, clusters
        return torch.cat([tokens, nodes], 1)

    def build(n: int) -> torch.Tensor:
        return build_rows(torch.ones(1, n, dtype=torch.bool))[0]

    def build_border(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        member = belongs(mask)
        others = ~torch.eye(k, dtype=torch.bool, device=mask.device)  # clusters choose each other, not themselves
        return member, torch.cat([member.transpose(1, 2), others.expand(mask.shape[0], k, k)], 2)

    name = f"clusters({k}, dynamic=True)" if dynamic else f"clusters({k})"
    virtual = tuple(f"cluster{c}" for c in range(k))
    return _as_text(Topology(name, virtual, build, (0, 0), build_rows=build_rows, build_border=build_border))


def segments(length: int, causal: bool = False) -> Topology:
    """Folded context: segments of ``length`` tokens; a token may choose heads in its own
    segment or in the previous one (the condensed memory it folds in). With
    ``causal=True`` a token sees only earlier tokens of its own segment (a language model).

    Arcs never point into a later segment, so segment s's labels depend on segment s - 1
    and not the reverse: ``inference.Folded`` runs mean field segment by segment with
    segment s - 1's final posteriors as fixed messages (assumed-density filtering), in
    memory bounded by ``length``. ``segment_length`` on the topology records ``length``.
    """
    length = check_positive("segment length l", length, MAX_REACH)
    _check_flag("segments(causal=...)", causal)

    def build(n: int) -> torch.Tensor:
        seg = torch.arange(n) // length
        gap = seg[:, None] - seg[None, :]  # dependent's segment minus head's segment
        same = (gap == 0) & (_offsets(n) < 0) if causal else gap == 0
        return same | (gap == 1)

    name = f"segments({length}, causal=True)" if causal else f"segments({length})"
    return _as_text(Topology(name, (), build, segment_length=length))


def _as_text(topology: Topology) -> Topology:
    """A built-in topology is stored as its constructor text (``parse`` reads it back)."""
    return replace(topology, data={"text": topology.name})


# ---- topologies from data: networkx graphs, masks, callables (read in graphs.topology_data) ----


def from_mask(mask) -> Topology:
    """Arcs from a boolean ``[n_max, n_max]`` mask over positions (``mask[i, j]``: i may
    choose j as head; the diagonal must be False). A sentence of length n <= n_max uses
    ``mask[:n, :n]``; a longer one is refused."""
    return _from_arcs(*arcs_of_mask(mask))


def from_graph(graph) -> Topology:
    """Arcs from a ``networkx.DiGraph`` on the positions ``0..n_max-1`` (an edge i -> j:
    i may choose j as head). A sentence of length n uses the subgraph on ``0..n-1``."""
    return _from_arcs(*arcs_of_graph(graph))


def from_callable(build: Callable) -> Topology:
    """Arcs from a function of the sentence length n returning a ``networkx.DiGraph`` on
    ``0..n-1`` or a bool ``[n, n]`` mask. It has no stored form: ``to_data`` refuses it,
    so a model on it cannot be checkpointed or exported (store a graph or mask instead)."""
    name, arcs = arcs_of_callable(build)
    return Topology(name, (), arcs)


def _from_arcs(arcs: list, n_max: int) -> Topology:
    name, build, data = arc_table(arcs, n_max)
    return Topology(name, (), build, data=data)


def from_data(data) -> Topology:
    """The topology of ``Topology.to_data()``'s description."""
    kind, value = read_data(data)
    if kind == "text":
        return parse(value)
    if kind == "arcs":
        return _from_arcs(*value)
    return from_data(value[0]) | from_data(value[1])


NAMES: dict[str, Callable[..., Topology]] = {
    "full": full,
    "causal": causal,
    "chain": chain,
    "window": window,
    "star": star,
    "clusters": clusters,
    "segments": segments,
    "root": root,
}

# Topology.mask(n, device) copies, newest last: (id, (n, device)) -> (topology, mask)
_MASKS: dict = {}
_MASKS_KEPT = 64


def parse(spec) -> Topology:
    """A topology from anything that describes one: a ``Topology``; text, e.g. ``"full"``,
    ``"window(3)"``, ``"window(2) | star()"``, ``"star(wrap=True)"`` (arguments are integers
    or True/False); a ``networkx.DiGraph`` on positions (``from_graph``); a bool mask
    (``from_mask``); a function n -> graph or mask (``from_callable``); or the dict of
    ``Topology.to_data()``."""
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, torch.Tensor):
        return from_mask(spec)
    if isinstance(spec, dict):
        return from_data(spec)
    if hasattr(spec, "edges") and hasattr(spec, "nodes"):
        return from_graph(spec)
    if callable(spec):
        return from_callable(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"topology must be a Topology, a non-empty string, a networkx DiGraph, a bool mask, a function n -> graph "
            f"or Topology.to_data()'s dict, got {spec!r}"
        )
    parts = [_parse_term(term, spec) for term in spec.split("|")]
    result = parts[0]
    for part in parts[1:]:
        result = result | part
    return result


def _parse_term(term: str, spec: str) -> Topology:
    name, args, kwargs = read_term(term, spec, NAMES)
    try:
        return NAMES[name](*args, **kwargs)
    except TypeError as error:
        raise ValueError(f"bad arguments for topology {name!r} in {spec!r}: {error}") from None
