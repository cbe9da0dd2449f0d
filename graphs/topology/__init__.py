"""Topologies: which head arcs a sentence's factor graph has.

    arc_set.py    ``Topology``: the arc set of n tokens plus virtual nodes, ``|`` (union),
                  the masks and arcs a kernel reads, ``to_data``
    builtins.py   full, causal, chain, window, star, root, clusters, segments
    reader.py     the one reader of specs: ``parse`` (text, mask, networkx graph,
                  function of n, stored dict) and ``from_mask``/``from_graph``/
                  ``from_callable``/``from_data``

``distance_groups`` and the limits are named here too: callers read ``graphs.topology.*``.
"""

from graphs.distances import distance_groups
from graphs.limits import MAX_CLUSTERS, MAX_NODES, MAX_REACH
from graphs.topology.arc_set import Topology
from graphs.topology.builtins import NAMES, causal, chain, clusters, full, root, segments, star, window
from graphs.topology.reader import from_callable, from_data, from_graph, from_mask, parse

# ``Topology.from_data(d)`` stays where users call it. The one reader of specs makes
# Topologies, so it imports arc_set; the method is attached here, where both are known,
# and arc_set never imports the reader.
Topology.from_data = staticmethod(from_data)

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
