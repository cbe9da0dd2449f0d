"""``from_graph`` and ``from_mask`` refuse what is not positions or a mask with values:
a node True (or 1.0) compared equal to the position 1 and was read as it, and a mask on the
'meta' device failed with torch's NotImplementedError."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphs import topology

NOT_POSITIONS = r"a topology graph's nodes must be the positions 0..n_max-1 \(integers\)"


@given(n_max=st.integers(2, 6), where=st.data(), stand_in=st.sampled_from(["bool", "float"]))
def test_a_node_that_only_compares_equal_to_a_position_is_refused_by_name(n_max, where, stand_in):
    position = where.draw(st.integers(0, 1) if stand_in == "bool" else st.integers(0, n_max - 1))
    nodes = [p for p in range(n_max) if p != position] + [bool(position) if stand_in == "bool" else float(position)]
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_edge(nodes[0], nodes[-1])
    with pytest.raises(ValueError, match=NOT_POSITIONS):
        topology.from_graph(graph)
    with pytest.raises(ValueError, match=NOT_POSITIONS):
        topology.parse(graph)


def test_integer_positions_of_any_integer_type_are_read():
    graph = nx.DiGraph([(np.int64(0), np.int64(2)), (2, 1)])
    assert topology.from_graph(graph).to_data() == {"arcs": [[0, 2], [2, 1]], "n_max": 3}


def test_a_mask_on_the_meta_device_is_refused_by_name():
    mask = torch.zeros(3, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="a topology mask must hold values: a mask on the 'meta' device has none"):
        topology.from_mask(mask)
    with pytest.raises(ValueError, match="a topology mask must hold values"):
        topology.parse(mask)
