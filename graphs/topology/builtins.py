"""The built-in topologies: ``full``, ``causal``, ``chain``, ``window``, ``star``,
``root``, ``clusters`` and ``segments``. Each is stored as its constructor's text
(``Topology.to_data()`` gives ``{"text": "window(2)"}``), which ``graphs.topology.parse``
reads back through ``NAMES``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from graphs.limits import MAX_CLUSTERS, MAX_REACH, check_positive
from graphs.topology.arc_set import Topology

__all__ = ["full", "causal", "chain", "window", "star", "root", "clusters", "segments", "NAMES"]


def _check_flag(name: str, value) -> None:
    # a string such as 'yes' or 'False' is truthy: refused, not read as True
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False (a bool), got {value!r}")


def _positions(size, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices ``[size, 1]`` and ``[1, size]`` of a ``[size, size]`` mask (on
    ``device``; None: the default device, or the one a ``torch.device`` context sets)."""
    pos = torch.arange(size, device=device)
    return pos[:, None], pos[None, :]


def _within(left: float, right: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rule ``-left <= j - i <= right``, ``j != i`` (head j of dependent i), built from
    comparisons of the position tensors: no integer table of their pairs is made."""

    def rule(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        allowed = i != j
        if not math.isinf(left):
            allowed = allowed & (j >= i - left)
        if not math.isinf(right):
            allowed = allowed & (j <= i + right)
        return allowed

    return rule


def _no_token_arcs(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return torch.zeros(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)


def _by_rule(name: str, rule, band=None, segment_length=None) -> Topology:
    """A built-in with no virtual node: its ``[n, n]`` mask is its rule over the positions."""

    def build(n: int) -> torch.Tensor:
        pos = torch.arange(n)
        return rule(pos[:, None], pos[None, :])

    return _as_text(Topology(name, (), build, band, segment_length, token_rule=rule))


def full() -> Topology:
    """Every token may choose every other token (the PT / BERT encoder)."""
    return _by_rule("full()", _within(math.inf, math.inf), (math.inf, math.inf))


def causal() -> Topology:
    """Token i may choose only earlier tokens j < i (a decoder). Token 0 has no head."""
    return _by_rule("causal()", _within(math.inf, -1), (math.inf, 0))


def chain() -> Topology:
    """Token i may choose only its left neighbour i - 1 (a linear chain: with a
    ``graphs.factors.Pairwise`` on it, the linear-chain CRF). Token 0 has no head."""
    return _by_rule("chain()", _within(1, -1), (1, 0))


def window(w: int) -> Topology:
    """Token i may choose tokens j with 0 < |i - j| <= w (local attention, no wrap-around)."""
    w = check_positive("window width w", w, MAX_REACH)
    return _by_rule(f"window({w})", _within(w, w), (w, w))


def star(wrap: bool = False) -> Topology:
    """Star-Transformer: a relay node joined both ways to every token, plus a ring.

    The ring joins each token to its neighbours i - 1 and i + 1; with ``wrap=True``
    the first and last tokens are neighbours too (a closed ring).
    """
    _check_flag("star(wrap=...)", wrap)

    def build(n: int) -> torch.Tensor:
        if wrap:
            return build_rows(torch.ones(1, n, dtype=torch.bool))[0]
        i, j = _positions(n + 1)
        tokens = (i < n) & (j < n)
        ring = tokens & ((j == i - 1) | (j == i + 1))  # comparisons of positions: no [n, n] integers
        return ring | ((i < n) & (j == n)) | ((i == n) & (j < n))  # tokens <-> relay

    def build_rows(mask: torch.Tensor) -> torch.Tensor:
        """The ring closed between each row's first and last real tokens (not the batch's
        first and last positions: padding must not move the arc)."""
        n = mask.shape[1]
        i, j = _positions(n + 1, mask.device)  # not a torch.device context: Dynamo cannot trace one
        tokens = (i < n) & (j < n)
        ring = tokens & ((j == i - 1) | (j == i + 1))
        relay = ((i < n) & (j == n)) | ((i == n) & (j < n))
        position = j[0, :n]
        first = torch.where(mask, position, n).amin(1)[:, None, None]  # [B, 1, 1]
        last = torch.where(mask, position, -1).amax(1)[:, None, None]
        ends = ((i == first) & (j == last)) | ((i == last) & (j == first))  # a self-arc when one token: arcs() drops it
        return (ring | relay)[None] | (ends & tokens)

    def build_border(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        relay_row = torch.cat([mask, mask.new_zeros(mask.shape[0], 1)], 1)[:, None, :]  # the relay: every token
        return mask[:, :, None], relay_row  # every token: the relay

    name = f"star(wrap={wrap})"
    if wrap:  # the closing arc depends on each row's real length: no band, no rule of positions
        return _as_text(
            Topology(name, ("relay",), build, build_rows=build_rows, build_border=build_border, row_tokens=True)
        )
    return _as_text(Topology(name, ("relay",), build, (1, 1), build_border=build_border, token_rule=_within(1, 1)))


def root() -> Topology:
    """A ROOT node (PT's sentence-classification variant): every token may choose it as
    head; ROOT chooses none. Compose it with a token topology, e.g. ``full() | root()``."""

    def build(n: int) -> torch.Tensor:
        i, j = _positions(n + 1)
        return (i < n) & (j == n)

    def build_border(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mask[:, :, None], mask.new_zeros(mask.shape[0], 1, mask.shape[1] + 1)  # ROOT chooses none

    return _as_text(Topology("root()", ("root",), build, (0, 0), build_border=build_border, token_rule=_no_token_arcs))


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
    clustered = Topology(
        name, virtual, build, (0, 0), build_rows=build_rows, build_border=build_border, token_rule=_no_token_arcs
    )
    return _as_text(clustered)


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

    earlier = _within(math.inf, -1)

    def rule(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        own, heads = torch.div(i, length, rounding_mode="floor"), torch.div(j, length, rounding_mode="floor")
        same = (own == heads) & (earlier(i, j) if causal else i != j)
        return same | (own == heads + 1)  # or the previous segment

    name = f"segments({length}, causal=True)" if causal else f"segments({length})"
    return _by_rule(name, rule, segment_length=length)


def _as_text(topology: Topology) -> Topology:
    """A built-in topology is stored as its constructor text (``parse`` reads it back)."""
    return replace(topology, data={"text": topology.name})


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
