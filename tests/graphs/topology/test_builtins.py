"""The built-in topologies (graphs.topology.builtins): each mask against its predicate in
tests/oracles.py, argument checks, and arcs per sentence of a padded batch."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphs import topology
from tests.oracles import LENGTH_DEPENDENT_SPECS as LENGTH_DEPENDENT
from tests.oracles import TOPOLOGY_CASES as CASES
from tests.oracles import TOPOLOGY_SPECS as SPECS


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


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "2"])
def test_constructors_validate_arguments(bad):
    for make in (topology.window, topology.clusters, topology.segments):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            make(bad)


# ---- padded batches: arcs(mask) builds each row for its real length ------------------


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


@pytest.mark.parametrize("topo,rule,extra", CASES, ids=[c[0].name for c in CASES])
@given(n=st.integers(1, 24))
def test_the_token_rule_is_the_predicate(topo, rule, extra, n):
    """A built-in's rule of positions (what a kernel asks for the blocks it reads) against
    its predicate between tokens; star(wrap=True), whose ring depends on n, has none."""
    if topo.token_rule is None:
        assert topo.name == "star(wrap=True)"
        return
    expected = expected_mask(rule, n, extra)[:n, :n]
    pos = torch.arange(n)
    assert torch.equal(topo.token_rule(pos[:, None], pos[None, :]), expected)
    assert torch.equal(topo.token_rule_transposed(pos[:, None], pos[None, :]), expected.T)
