"""graphs.topology.arc_set (``Topology``): its graph, unions (and their token rules),
lengths, band, border and per-row arcs, against each topology restated as a predicate over
(dependent, head, n) in tests/oracles.py."""

import networkx as nx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphs import topology
from tests.oracles import LENGTH_DEPENDENT_SPECS as LENGTH_DEPENDENT
from tests.oracles import TOPOLOGY_CASES as CASES
from tests.oracles import TOPOLOGY_SPECS as SPECS


@pytest.mark.parametrize("topo,rule,extra", CASES, ids=[c[0].name for c in CASES])
def test_graph_has_the_mask_arcs(topo, rule, extra):
    n = 6
    g = topo.graph(n)
    assert isinstance(g, nx.DiGraph)
    assert g.number_of_nodes() == n + extra
    assert set(g.edges) == {tuple(e) for e in topo.mask(n).nonzero().tolist()}
    assert [g.nodes[i]["kind"] for i in range(n)] == ["token"] * n
    assert [g.nodes[n + v]["kind"] for v in range(extra)] == list(topo.virtual)


@given(n=st.integers(1, 9), w=st.integers(1, 4), k=st.integers(1, 3))
def test_union_is_or_with_virtual_nodes_concatenated(n, w, k):
    combined = topology.window(w) | topology.star() | topology.clusters(k)
    mask = combined.mask(n)
    assert combined.extra_nodes == 1 + k
    tokens = torch.arange(n)
    expected_tokens = topology.window(w).mask(n) | topology.star().mask(n)[:n, :n]
    assert torch.equal(mask[:n, :n], expected_tokens)
    relay = n
    assert torch.equal(mask[relay, :n], torch.ones(n, dtype=torch.bool))
    cl = topology.clusters(k).mask(n)
    assert torch.equal(mask[n + 1 :, n + 1 :], cl[n:, n:])
    assert torch.equal(mask[tokens[:, None], n + 1 + torch.arange(k)[None]], cl[:n, n:])
    assert not mask[relay, n + 1 :].any() and not mask[n + 1 :, relay].any()


def test_segments_record_their_length_and_unions_drop_it():
    assert topology.segments(5).segment_length == 5
    assert topology.segments(5, causal=True).segment_length == 5
    assert topology.full().segment_length is None
    assert (topology.segments(5) | topology.root()).segment_length is None


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_mask_rejects_bad_lengths(n):
    with pytest.raises(ValueError, match="sentence length n"):
        topology.full().mask(n)


@pytest.mark.parametrize("topo,rule,extra", CASES, ids=[c[0].name for c in CASES])
def test_band_describes_the_token_arcs_when_known(topo, rule, extra):
    composed = [topo, topo | topology.window(2), topo | topology.clusters(2)]
    for t in composed:
        if t.band is None:
            continue
        left, right = t.band
        n = 9
        offsets = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        expected = (offsets >= -left) & (offsets <= right) & (offsets != 0)
        assert torch.equal(t.mask(n)[:n, :n], expected), t.name


# ---- padded batches: arcs(mask) builds each row for its real length ------------------


def test_arcs_of_a_full_batch_equal_mask():
    for spec in SPECS + LENGTH_DEPENDENT:
        topo = topology.parse(spec)
        assert torch.equal(topo.arcs(torch.ones(3, 6, dtype=torch.bool)), topo.mask(6).expand(3, -1, -1)), spec


def test_arcs_rejects_a_bad_mask():
    with pytest.raises(ValueError, match=r"mask must be a bool tensor \[batch, n\]"):
        topology.full().arcs(torch.ones(3, 4))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        topology.full().arcs(torch.ones(4, dtype=torch.bool))


UNIONS = [
    "window(2) | root()",
    "segments(3) | root()",
    "window(1) | star()",
    "causal() | window(2)",
    "chain() | root()",
]


@pytest.mark.parametrize("spec", UNIONS)
@given(n=st.integers(1, 20))
def test_a_union_ors_its_operands_token_rules(spec, n):
    left, right = (topology.parse(part) for part in spec.split("|"))
    union, pos = topology.parse(spec), torch.arange(n)
    i, j = pos[:, None], pos[None, :]
    assert torch.equal(union.token_rule(i, j), left.token_rule(i, j) | right.token_rule(i, j))
    assert torch.equal(union.token_rule(i, j), union.mask(n)[:n, :n])


def test_a_union_with_a_table_only_topology_has_no_rule():
    assert topology.parse("window(2) | star(wrap=True)").token_rule is None
    assert topology.from_mask(torch.ones(4, 4, dtype=torch.bool).triu(1)).token_rule is None


@pytest.mark.parametrize("spec", SPECS + LENGTH_DEPENDENT + UNIONS + ["star(wrap=True)", "clusters(2) | root()"])
@given(n=st.integers(1, 16), seed=st.integers(0, 1000))
def test_the_border_is_the_arcs_touching_a_virtual_node(spec, n, seed):
    made = topology.parse(spec)
    mask = torch.rand(3, n, generator=torch.Generator().manual_seed(seed)) < 0.7
    arcs = made.arcs(mask)
    to_virtual, virtual_rows = made.border(mask)
    assert torch.equal(to_virtual, arcs[:, :n, n:])
    assert torch.equal(virtual_rows, arcs[:, n:, :])
