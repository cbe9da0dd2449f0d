import networkx as nx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphs import topology

# Each topology restated as a predicate over (dependent i, head j, n); virtual nodes are >= n.


def full_rule(i, j, n):
    return i < n and j < n


def causal_rule(i, j, n):
    return i < n and j < i


def window_rule(w):
    return lambda i, j, n: i < n and j < n and abs(i - j) <= w


def star_rule(wrap):
    def rule(i, j, n):
        if i < n and j < n:
            return abs(i - j) == 1 or (wrap and n > 2 and {i, j} == {0, n - 1})
        return (i < n) != (j < n)  # token <-> relay

    return rule


def clusters_rule(k, dynamic=False):
    def rule(i, j, n):
        if i < n and j < n:
            return False
        if i >= n and j >= n:
            return True
        token, cluster = (i, j - n) if i < n else (j, i - n)
        return dynamic or token * k // n == cluster

    return rule


def root_rule(i, j, n):
    return i < n and j >= n


def segments_rule(length, causal=False):
    def rule(i, j, n):
        gap = i // length - j // length
        return i < n and j < n and (gap == 1 or (gap == 0 and (j < i or not causal)))

    return rule


CASES = [
    (topology.full(), full_rule, 0),
    (topology.causal(), causal_rule, 0),
    (topology.window(1), window_rule(1), 0),
    (topology.window(3), window_rule(3), 0),
    (topology.star(), star_rule(False), 1),
    (topology.star(wrap=True), star_rule(True), 1),
    (topology.clusters(1), clusters_rule(1), 1),
    (topology.clusters(3), clusters_rule(3), 3),
    (topology.segments(2), segments_rule(2), 0),
    (topology.root(), root_rule, 1),
    (topology.segments(3), segments_rule(3), 0),
    (topology.segments(3, causal=True), segments_rule(3, causal=True), 0),
    (topology.clusters(3, dynamic=True), clusters_rule(3, dynamic=True), 3),
    (topology.parse("segments(4, causal=True)"), segments_rule(4, causal=True), 0),
]


def expected_mask(rule, n, extra):
    N = n + extra
    return torch.tensor([[i != j and rule(i, j, n) for j in range(N)] for i in range(N)])


@pytest.mark.parametrize("topo,rule,extra", CASES, ids=[c[0].name for c in CASES])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_mask_matches_definition(topo, rule, extra, n):
    mask = topo.mask(n)
    assert mask.dtype == torch.bool and mask.shape == (n + extra, n + extra)
    assert torch.equal(mask, expected_mask(rule, n, extra))
    assert not mask.diagonal().any()


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


def test_segments_record_their_length_and_unions_drop_it():
    assert topology.segments(5).segment_length == 5
    assert topology.segments(5, causal=True).segment_length == 5
    assert topology.full().segment_length is None
    assert (topology.segments(5) | topology.root()).segment_length is None


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


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "2"])
def test_constructors_validate_arguments(bad):
    for make in (topology.window, topology.clusters, topology.segments):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            make(bad)


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
