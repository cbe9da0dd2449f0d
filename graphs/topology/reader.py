"""The one reader of topology specs: anything that describes a topology becomes a
``Topology`` here, checked with an error that says what is wrong. ``parse`` takes them
all: a ``Topology``; the text of the built-ins (``"window(2) | star()"``); a bool mask or a
``networkx.DiGraph`` over the positions ``0..n_max-1`` (stored as an arc table that a
sentence of length n slices); a function of the sentence length that returns either; or
the dict ``Topology.to_data()`` stores (``from_data``).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import re
from collections.abc import Callable, Collection

import torch

from graphs.limits import MAX_NODES
from graphs.topology.arc_set import Topology
from graphs.topology.builtins import NAMES

__all__ = ["parse", "from_mask", "from_graph", "from_callable", "from_data"]

_TERM = re.compile(r"^\s*([a-z_]+)\s*(?:\(\s*([^()]*?)\s*\))?\s*$")


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
    ``0..n-1`` or a bool ``[n, n]`` mask. In a padded batch each row gets the arcs of its
    real length, over its real tokens in order. It has no stored form: ``to_data`` refuses
    it, so a model on it cannot be checkpointed or exported (store a graph or mask instead)."""
    name, arcs = arcs_of_callable(build)

    def build_rows(mask: torch.Tensor) -> torch.Tensor:
        """Each row's arcs from ``build(its real length)``, laid over its real tokens in order:
        a sentence has the same arcs however much padding its batch adds. The lengths are
        read on the host: the function is Python of an integer n."""
        rows = mask.new_zeros(mask.shape[0], mask.shape[1], mask.shape[1])
        tables = {}
        for row, length in enumerate(mask.sum(1).tolist()):
            if length:
                if length not in tables:  # the function once per length, not once per row
                    tables[length] = arcs(length).to(mask.device)
                table = tables[length]
                real = mask[row].nonzero().flatten()
                rows[row, real[:, None], real[None, :]] = table
        return rows

    return Topology(name, (), arcs, build_rows=build_rows, row_tokens=True)


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


# ---- checks: each spec is read into arcs (or a term) with an error that says what is wrong ----


def arcs_of_mask(mask) -> tuple[list, int]:
    """``(arcs, n_max)`` of a bool ``[n_max, n_max]`` mask (``mask[i, j]``: i may choose j)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"a topology mask must be a bool tensor [n_max, n_max], got {getattr(mask, 'shape', mask)!r}")
    if mask.shape[0] != mask.shape[1] or mask.shape[0] < 1:
        raise ValueError(f"a topology mask must be square [n_max, n_max] with n_max >= 1, got {tuple(mask.shape)}")
    if mask.is_meta:
        raise ValueError("a topology mask must hold values: a mask on the 'meta' device has none (build it on cpu)")
    return mask.detach().cpu().nonzero().tolist(), mask.shape[0]


def arcs_of_graph(graph) -> tuple[list, int]:
    """``(arcs, n_max)`` of a ``networkx.DiGraph`` (or ``MultiDiGraph``) on the positions
    ``0..n_max-1`` (an edge i -> j: i may choose j as head)."""
    if not (hasattr(graph, "nodes") and hasattr(graph, "edges") and getattr(graph, "is_directed", lambda: False)()):
        raise ValueError(f"a topology graph must be a networkx.DiGraph, got {type(graph).__name__}")
    nodes = list(graph.nodes)
    # True == 1 and 1.0 == 1: a bool or a float would pass a comparison with the positions
    positions = all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in nodes)
    if not nodes or not positions or sorted(int(i) for i in nodes) != list(range(len(nodes))):
        shown = sorted(nodes, key=repr)[:8]
        raise ValueError(f"a topology graph's nodes must be the positions 0..n_max-1 (integers), got {shown}")
    # edges(): (i, j) pairs in a MultiDiGraph too (its edge view yields keys); a repeated edge is one arc
    return [[i, j] for i, j in graph.edges()], len(nodes)


def arc_table(arcs: list, n_max: int) -> tuple[str, Callable[[int], torch.Tensor], dict]:
    """``(name, build, data)`` of the arcs ``[[i, j], ...]`` over ``n_max`` positions:
    ``build(n)`` is the ``[n, n]`` mask of a sentence of length n <= n_max, ``data`` the
    stored form, and the name tells two arc sets apart."""
    if n_max > MAX_NODES:
        raise ValueError(f"a topology over {n_max} positions exceeds the limit of {MAX_NODES} nodes")
    arcs = sorted({(int(i), int(j)) for i, j in arcs})
    for i, j in arcs:
        if not (0 <= i < n_max and 0 <= j < n_max):
            raise ValueError(f"arc ({i}, {j}) lies outside the positions 0..{n_max - 1}")
        if i == j:
            raise ValueError(f"arc ({i}, {i}) is a self-arc: a node never chooses itself as head")
    # one spare row and column (never an arc): a slice [:n, :n] with n <= n_max never takes the
    # whole table, so torch.export keeps the length dynamic over 1..n_max (no guard n != n_max)
    table = torch.zeros(n_max + 1, n_max + 1, dtype=torch.bool)
    if arcs:
        table[torch.tensor(arcs).T.unbind()] = True

    def build(n: int) -> torch.Tensor:
        if not isinstance(n, torch.SymInt) and n > n_max:
            raise ValueError(
                f"this topology covers {n_max} positions (n_max); got {n} positions (a sentence, or a batch "
                f"with its padding): trim padding past the longest sentence, or store arcs over more positions"
            )
        return table[:n, :n]

    data = {"arcs": [list(a) for a in arcs], "n_max": n_max}
    # a name tells two arc sets apart: a digest of the arcs themselves (a sum of them collided)
    digest = hashlib.sha256(json.dumps(data["arcs"]).encode()).hexdigest()[:12]
    return f"arcs(n_max={n_max}, {len(arcs)} arcs, #{digest})", build, data


def arcs_of_callable(build: Callable) -> tuple[str, Callable[[int], torch.Tensor]]:
    """``(name, build_n)``: ``build_n(n)`` is the ``[n, n]`` mask of the graph or mask that
    ``build(n)`` returns for a sentence of length n, checked as ``arcs_of_graph`` /
    ``arcs_of_mask`` and ``arc_table`` check a stored one."""
    if not callable(build):
        raise ValueError(f"from_callable needs a function n -> graph or mask, got {build!r}")

    def arcs(n: int) -> torch.Tensor:
        made = build(n)
        positions = arcs_of_mask(made) if isinstance(made, torch.Tensor) else arcs_of_graph(made)
        _, table, _ = arc_table(*positions)
        if positions[1] != n:
            raise ValueError(f"the topology function returned {positions[1]} positions for a sentence of length {n}")
        return table(n)

    return f"from_callable({getattr(build, '__name__', type(build).__name__)})", arcs


def read_data(data) -> tuple[str, object]:
    """What ``Topology.to_data()``'s dict describes, checked: ``("text", text)``,
    ``("arcs", (arcs, n_max))`` or ``("union", (left_data, right_data))``."""
    if not isinstance(data, dict) or len(data) == 0:
        raise ValueError(f"topology data must be a dict with 'text', 'arcs' or 'union', got {data!r}")
    if set(data) == {"text"}:
        return "text", data["text"]
    if set(data) == {"arcs", "n_max"}:
        n_max = data["n_max"]
        if isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < 1:
            raise ValueError(f"topology data 'n_max' must be an integer >= 1, got {n_max!r}")
        pairs = data["arcs"]
        if not isinstance(pairs, list) or any(not isinstance(a, list | tuple) or len(a) != 2 for a in pairs):
            raise ValueError("topology data 'arcs' must be a list of [i, j] pairs")
        for pair in pairs:  # int() would read 1.7 as 1, True as 1 and "2" as 2
            if any(isinstance(x, bool) or not isinstance(x, int) for x in pair):
                raise ValueError(f"topology data 'arcs' must hold integer positions, got the pair {list(pair)!r}")
        return "arcs", (data["arcs"], n_max)
    if set(data) == {"union"} and isinstance(data["union"], list) and len(data["union"]) == 2:
        return "union", (data["union"][0], data["union"][1])
    raise ValueError(f"topology data must have the keys 'text', 'arcs' and 'n_max', or 'union'; got {sorted(data)}")


def read_term(term: str, spec: str, names: Collection[str]) -> tuple[str, list, dict]:
    """``(name, args, kwargs)`` of one term of a topology's text ``spec``, e.g.
    ``"star(wrap=True)"``; the name must be one of ``names``, the arguments integers or
    True/False."""
    match = _TERM.match(term)
    if match is None:
        raise ValueError(f"cannot parse topology {spec!r}: bad term {term.strip()!r}")
    name, argtext = match.group(1), match.group(2)
    if name not in names:
        raise ValueError(f"unknown topology name {name!r}; allowed: {sorted(names)}")
    args, kwargs = [], {}
    for raw in filter(None, (a.strip() for a in (argtext or "").split(","))):
        key, _, value = raw.rpartition("=")
        parsed = _read_value(value.strip(), spec)
        if key:
            kwargs[key.strip()] = parsed
        else:
            args.append(parsed)
    return name, args, kwargs


def _read_value(text: str, spec: str):
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"topology arguments must be integers or True/False; got {text!r} in {spec!r}") from None
