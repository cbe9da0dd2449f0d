"""The one reader of topology specs (graphs.topology.reader): text specs parsed and refused,
and networkx graphs, masks and callables stored as data and restored exactly. Oracles: the
arc sets written in each test."""

import json

import networkx as nx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs
from graphs import topology


def test_parse_round_trips_names_and_arguments():
    assert torch.equal(topology.parse("window(2)").mask(5), topology.window(2).mask(5))
    assert torch.equal(topology.parse("full").mask(4), topology.full().mask(4))
    both = topology.parse("window(2) | star(wrap=True)")
    assert torch.equal(both.mask(6), (topology.window(2) | topology.star(wrap=True)).mask(6))
    assert topology.parse(both) is both
    for made in (topology.clusters(3, dynamic=True), topology.segments(4, causal=True), topology.segments(2)):
        again = topology.parse(made.name)
        assert again.name == made.name and torch.equal(again.mask(9), made.mask(9))
        assert again.segment_length == made.segment_length


@pytest.mark.parametrize(
    "spec,match",
    [
        ("nonsense", "unknown topology name 'nonsense'"),
        ("window", "bad arguments for topology 'window'"),
        ("window(x)", "integers or True/False"),
        ("window(0)", "window width w must be an integer >= 1"),
        ("clusters(-1)", "number of clusters k"),
        ("segments(0)", "segment length l"),
        ("segments(2, causal=1)", "causal=...\\) must be True or False"),
        ("clusters(2, dynamic=3)", "dynamic=...\\) must be True or False"),
        ("window(2) |", "bad term"),
        ("", "non-empty string"),
    ],
)
def test_parse_rejects_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        topology.parse(spec)


@st.composite
def arc_sets(draw):
    n_max = draw(st.integers(1, 7))
    pairs = [(i, j) for i in range(n_max) for j in range(n_max) if i != j]
    return n_max, draw(st.sets(st.sampled_from(pairs), max_size=len(pairs))) if pairs else set()


def mask_of(arcs, n):
    return torch.tensor([[(i, j) in arcs for j in range(n)] for i in range(n)], dtype=torch.bool)


@given(data=arc_sets(), length=st.integers(1, 7), repeats=st.integers(1, 3))
def test_a_graph_a_mask_and_their_data_give_the_written_arcs(data, length, repeats):
    """A MultiDiGraph holding each edge ``repeats`` times gives the same arcs: an arc is
    there or not."""
    n_max, arcs = data
    graph, multigraph = nx.DiGraph(), nx.MultiDiGraph()
    for g in (graph, multigraph):
        g.add_nodes_from(range(n_max))
    graph.add_edges_from(arcs)
    multigraph.add_edges_from(list(arcs) * repeats)
    from_graph, from_mask = topology.parse(graph), topology.parse(mask_of(arcs, n_max))
    restored = topology.Topology.from_data(json.loads(json.dumps(from_graph.to_data())))
    for made in (from_graph, topology.parse(multigraph), from_mask, restored):
        if length <= n_max:  # a sentence of length n uses the subgraph on 0..n-1
            assert torch.equal(made.mask(length), mask_of(arcs, length))
        else:
            with pytest.raises(ValueError, match=f"covers {n_max} positions"):
                made.mask(length)
    assert from_graph.name == from_mask.name == restored.name


def test_a_callable_topology_builds_each_length_and_cannot_be_stored():
    def left_neighbour(n):
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        graph.add_edges_from((i, i - 1) for i in range(1, n))
        return graph

    made = topology.parse(left_neighbour)
    for n in (1, 4, 9):
        assert torch.equal(made.mask(n), mask_of({(i, i - 1) for i in range(1, n)}, n))
    with pytest.raises(ValueError, match="cannot be stored as data .* built from a callable"):
        made.to_data()
    with pytest.raises(ValueError, match="cannot be stored"):
        (made | topology.root()).to_data()


@pytest.mark.parametrize(
    "text", ["full", "window(2) | star()", "clusters(3, dynamic=True)", "segments(2, causal=True)"]
)
def test_built_in_topologies_are_stored_as_their_text(text):
    made = topology.parse(text)
    assert made.to_data() == {"text": made.name}
    restored = topology.from_data(made.to_data())
    for n in (1, 5):
        assert torch.equal(restored.mask(n), made.mask(n))


def test_a_union_of_a_graph_and_a_built_in_is_stored_and_restored():
    graph = nx.DiGraph([(0, 2), (2, 1)])
    made = topology.parse(graph) | topology.root()
    data = json.loads(json.dumps(made.to_data()))
    assert data == {"union": [{"arcs": [[0, 2], [2, 1]], "n_max": 3}, {"text": "root()"}]}
    restored = topology.from_data(data)
    expected = torch.zeros(4, 4, dtype=torch.bool)
    expected[0, 2] = expected[2, 1] = True
    expected[:3, 3] = True  # every token may choose ROOT
    assert torch.equal(restored.mask(3), expected) and restored.extra_nodes == 1


def test_a_crf_takes_a_graph_as_its_topology():
    crf = graphs.CRF(vocab_size=4, labels=2, topology=nx.DiGraph([(1, 0), (2, 0)]))
    arcs = crf.arc_mask(torch.tensor([[True, True, True], [True, True, False]]))
    assert torch.equal(arcs[0], mask_of({(1, 0), (2, 0)}, 3)) and torch.equal(arcs[1], mask_of({(1, 0)}, 3))


@pytest.mark.parametrize(
    "spec,match",
    [
        (nx.DiGraph([(0, 0)]), r"arc \(0, 0\) is a self-arc"),
        (nx.DiGraph([("a", "b")]), "nodes must be the positions 0..n_max-1"),
        (nx.DiGraph([(0, 5)]), "nodes must be the positions"),
        (nx.Graph([(0, 1)]), "must be a networkx.DiGraph"),
        (torch.ones(2, 3, dtype=torch.bool), "must be square"),
        (torch.ones(2, 2), "must be a bool tensor"),
        ({"arcs": [[0, 1]]}, "must have the keys"),
        ({"arcs": [[0, 4]], "n_max": 2}, r"arc \(0, 4\) lies outside the positions 0..1"),
        ({"arcs": [[0, 1.7]], "n_max": 3}, r"must hold integer positions, got the pair \[0, 1.7\]"),  # was arc (0, 1)
        ({"arcs": [[0, True]], "n_max": 3}, r"must hold integer positions, got the pair \[0, True\]"),
        ({"arcs": [["2", 0]], "n_max": 3}, r"must hold integer positions, got the pair \['2', 0\]"),
        (3, "topology must be a Topology, a non-empty string, a networkx DiGraph"),
    ],
)
def test_bad_topology_data_is_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        topology.parse(spec)


def test_a_batch_padded_past_a_graphs_positions_is_refused_naming_the_padding():
    """Three real tokens padded to four positions over a 3-position graph: the error said "a
    sentence of length 4"."""
    crf = graphs.CRF(vocab_size=5, labels=2, topology=nx.DiGraph([(0, 1), (1, 0), (2, 1)]))
    with pytest.raises(
        ValueError, match=r"covers 3 positions .* got 4 positions \(a sentence, or a batch with its padding\)"
    ):
        crf.arc_mask(torch.tensor([[True, True, True, False]]))


@given(first=arc_sets(), second=arc_sets())
def test_two_arc_sets_have_one_name_only_when_they_are_the_same_arcs(first, second):
    """The name is what tells stored topologies apart (a saved model's check compares it): a
    digest of the arcs. The sum it used to be gave (0, 3), (1, 0) and (0, 1), (1, 2) one name."""
    (n_first, arcs_first), (n_second, arcs_second) = first, second
    same = n_first == n_second and set(map(tuple, arcs_first)) == set(map(tuple, arcs_second))
    names = [topology.parse(mask_of(arcs, n)).name for n, arcs in (first, second)]
    assert (names[0] == names[1]) == same
    colliding = [mask_of({(0, 3), (1, 0)}, 4), mask_of({(0, 1), (1, 2)}, 4)]
    assert topology.parse(colliding[0]).name != topology.parse(colliding[1]).name


def test_a_function_topology_is_called_once_per_length_in_a_padded_batch():
    """The per-length cache evaluated its default on every row: the function ran once a row."""
    calls = []

    def chain(n):
        calls.append(n)
        return torch.ones(n, n, dtype=torch.bool).tril(-1)

    mask = torch.tensor([[True] * 3 + [False]] * 5 + [[True] * 4])
    topology.from_callable(chain).arcs(mask)
    assert sorted(calls) == [3, 4]
