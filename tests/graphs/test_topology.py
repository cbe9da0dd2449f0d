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


# ---- padded batches: arcs(mask) builds each row for its real length ------------------

SPECS = ["full", "causal", "window(1)", "segments(2)", "star()", "root()", "window(1) | root()"]
LENGTH_DEPENDENT = ["clusters(1)", "clusters(2)", "clusters(3)", "clusters(2, dynamic=True)", "window(1) | clusters(3)"]


@given(
    spec=st.sampled_from(SPECS + LENGTH_DEPENDENT),
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    extra_padding=st.integers(0, 3),
)
def test_each_row_has_the_arcs_of_its_sentence_alone(spec, lengths, extra_padding):
    """Oracle: the arcs of row b (padded at the end, as batches are) between its L real
    tokens and the virtual nodes are mask(L) of the sentence without padding; a padded
    position has no arc at all."""
    n = max(lengths) + extra_padding
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    topo = topology.parse(spec)
    arcs = topo.arcs(mask)
    m = topo.extra_nodes
    assert arcs.shape == (len(lengths), n + m, n + m)
    for b, length in enumerate(lengths):
        nodes = torch.cat([torch.arange(length), torch.arange(n, n + m)])
        assert torch.equal(arcs[b][nodes[:, None], nodes[None, :]], topo.mask(length)), (spec, b)
        padded = ~torch.cat([mask[b], torch.ones(m, dtype=torch.bool)])
        assert not arcs[b][padded].any() and not arcs[b][:, padded].any()


@given(k=st.integers(1, 4), dynamic=st.booleans(), row=st.lists(st.booleans(), min_size=1, max_size=9))
def test_clusters_count_real_tokens_wherever_the_padding_sits(k, dynamic, row):
    """Padding in the middle too: the r-th real token of L joins the cluster of token r in
    clusters(k).mask(L)."""
    mask = torch.tensor([[True] + row])
    real = mask[0].nonzero().flatten()
    n, length = mask.shape[1], len(real)
    topo = topology.clusters(k, dynamic)
    nodes = torch.cat([real, torch.arange(n, n + k)])
    assert torch.equal(topo.arcs(mask)[0][nodes[:, None], nodes[None, :]], topo.mask(length))


def test_contiguous_clusters_follow_the_real_length():
    """By hand: 5 real tokens in 3 clusters are {0, 1}, {2, 3}, {4} (floor(i 3 / 5)),
    however much padding follows; today's mask(n) of the padded length 8 would give
    {0, 1, 2}, {3, 4, 5}, {6, 7}."""
    topo = topology.clusters(3)
    for pad in (0, 1, 3):
        mask = torch.arange(5 + pad)[None] < 5
        arcs = topo.arcs(mask)[0]
        n = 5 + pad
        member = [arcs[i, n:].nonzero().flatten().tolist() for i in range(5)]
        assert member == [[0], [0], [1], [1], [2]]


def test_arcs_of_a_full_batch_equal_mask():
    for spec in SPECS + LENGTH_DEPENDENT:
        topo = topology.parse(spec)
        assert torch.equal(topo.arcs(torch.ones(3, 6, dtype=torch.bool)), topo.mask(6).expand(3, -1, -1)), spec


def test_arcs_rejects_a_bad_mask():
    with pytest.raises(ValueError, match=r"mask must be a bool tensor \[batch, n\]"):
        topology.full().arcs(torch.ones(3, 4))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        topology.full().arcs(torch.ones(4, dtype=torch.bool))


# ---- the PT on clusters(k): its real-token outputs do not depend on the padding ----------


def pt_outputs_under_padding(k, sentence, pads, seed):
    import probformer as pf

    torch.manual_seed(seed)
    config = pf.PTConfig(vocab_size=12, labels=4, channels=2, rank=2, topology=f"window(1) | clusters({k})")
    model = pf.ProbabilisticTransformer(config).eval()
    outputs = []
    for pad in pads:
        tokens = torch.tensor([sentence + [0] * pad])
        mask = torch.arange(len(sentence) + pad)[None] < len(sentence)
        with torch.no_grad():
            outputs.append(model(tokens, mask)[0][0, : len(sentence)])
    return outputs


PT_CASES = dict(
    k=st.integers(1, 4),
    sentence=st.lists(st.integers(1, 11), min_size=1, max_size=6),
    pads=st.lists(st.integers(0, 5), min_size=2, max_size=3),
    seed=st.integers(0, 100),
)


@given(**PT_CASES)
def test_pt_on_clusters_is_invariant_to_padding_when_the_crf_reads_arcs(k, sentence, pads, seed):
    """With CRF.arc_mask(mask) = topology.arcs(mask) (the change asked of graphs/crf.py),
    the same sentence under any padding gives the same outputs at its real tokens."""
    import graphs

    original = graphs.CRF.arc_mask
    graphs.CRF.arc_mask = lambda self, mask: self.topology.arcs(mask)
    try:
        outputs = pt_outputs_under_padding(k, sentence, pads, seed)
    finally:
        graphs.CRF.arc_mask = original
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], rtol=1e-5, atol=1e-5)


def test_pt_on_clusters_is_invariant_to_padding():
    outputs = pt_outputs_under_padding(3, [3, 5, 7, 9, 11], [0, 4], seed=0)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["yes", "False", 1, 0, None, 1.0])
def test_flag_arguments_must_be_bools(bad):
    # star('yes') was accepted (a truthy string read as wrap=True)
    cases = [
        (lambda: topology.star(bad), r"star\(wrap=...\)"),
        (lambda: topology.star(wrap=bad), r"star\(wrap=...\)"),
        (lambda: topology.clusters(2, dynamic=bad), r"clusters\(dynamic=...\)"),
        (lambda: topology.segments(2, causal=bad), r"segments\(causal=...\)"),
    ]
    for make, name in cases:
        with pytest.raises(ValueError, match=name + r" must be True or False"):
            make()
