"""inference.mean_field.kernels.structure (HeadStructure): a structure that reads its
topology's rule of positions against one given the token table written out in the test
from each topology's predicate (tests/oracles.py): the same rows with a head, diagonals,
arcs and table."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
from inference.mean_field.kernels.structure import HeadStructure
from tests.oracles import TOPOLOGY_CASES as CASES

RULED = [(topo, rule) for topo, rule, _ in CASES if topo.token_rule is not None]


def predicate_table(rule, n: int) -> torch.Tensor:
    return torch.tensor([[i != j and rule(i, j, n) for j in range(n)] for i in range(n)], dtype=torch.bool)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(RULED), n=st.integers(1, 30), seed=st.integers(0, 1000))
def test_a_structure_reading_the_rule_equals_one_given_the_table(case, n, seed):
    topo, rule = case
    crf = graphs.CRF(vocab_size=5, labels=2, topology=topo)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(seed)) < 0.8
    table = predicate_table(rule, n)
    common = dict(n=n, gamma=crf.gamma, nodes=crf.node_mask(mask), band=topo.band, border=topo.border(mask))
    by_rule = HeadStructure(**common, topology=topo)
    by_table = HeadStructure(**common, token_arcs=table, topology=topo)
    assert by_rule.token_rule is not None and by_table.token_rule is None
    assert torch.equal(by_rule.has_head, by_table.has_head)
    for offset in range(-n + 1, n):
        assert torch.equal(by_rule.diagonal(offset), by_table.diagonal(offset))
    assert torch.equal(by_rule.arcs, by_table.arcs)
    assert torch.equal(by_rule.token_arcs, table)  # built on first read


SEGMENTED = [(topo, rule) for topo, rule in RULED if topo.segment_length is not None]


@settings(max_examples=30, deadline=None)
@given(case=st.sampled_from(SEGMENTED), n=st.integers(1, 40), rows=st.integers(1, 7), seed=st.integers(0, 1000))
def test_rows_with_a_head_read_block_by_block_equal_the_table(case, n, rows, seed):
    """Blocks of a few rows (the kernel's are 128) on segments(l): each block reads only the
    heads its rows can reach (their segment and the one before), and finds the same rows."""
    from unittest import mock

    from inference.mean_field.kernels import structure

    topo, rule = case
    crf = graphs.CRF(vocab_size=5, labels=2, topology=topo)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(seed)) < 0.6
    common = dict(n=n, gamma=crf.gamma, nodes=crf.node_mask(mask), band=topo.band, border=topo.border(mask))
    with mock.patch.object(structure, "_RULE_ROWS", rows):
        by_rule = HeadStructure(**common, topology=topo).has_head
    assert torch.equal(by_rule, HeadStructure(**common, token_arcs=predicate_table(rule, n), topology=topo).has_head)


def test_a_structure_needs_its_table_or_a_topology():
    import pytest

    with pytest.raises(ValueError, match="needs its token_arcs or a topology"):
        HeadStructure(n=2, gamma=1, nodes=torch.ones(1, 2, dtype=torch.bool))


ROW_TOPOLOGIES = ["star(wrap=True)", "window(1) | star(wrap=True)", "star(wrap=True) | clusters(2)"]


@settings(max_examples=30, deadline=None)
@given(spec=st.sampled_from(ROW_TOPOLOGIES), n=st.integers(1, 12), seed=st.integers(0, 1000))
def test_a_structure_of_row_tokens_reads_each_rows_table_however_it_was_given(spec, n, seed):
    """A topology whose rows have token arcs of their own length: from the topology alone,
    from its arcs, or from each row's table ``[B, n, n]``, the structure has the same table per
    row (the token arcs of ``Topology.arcs``), rows with a head, diagonals, arcs and border."""
    topo = graphs.topology.parse(spec)
    mask = torch.rand(3, n, generator=torch.Generator().manual_seed(seed)) < 0.7
    crf = graphs.CRF(vocab_size=5, labels=2, topology=topo)
    arcs = topo.arcs(mask)
    common = dict(n=n, gamma=crf.gamma, nodes=crf.node_mask(mask), band=topo.band, border=topo.border(mask))
    by_topology = HeadStructure(**{**common, "border": None}, topology=topo)
    by_arcs = HeadStructure(**common, arcs=arcs, topology=topo)
    by_table = HeadStructure(**common, token_arcs=arcs[:, :n, :n])
    for structure in (by_topology, by_arcs, by_table):
        assert structure.row_tokens
        assert torch.equal(structure.token_arcs, arcs[:, :n, :n])
        assert torch.equal(structure.token_mask(transposed=True), arcs[:, :n, :n].transpose(1, 2))
        assert torch.equal(structure.has_head, arcs.any(-1))
        for offset in range(-n + 1, n):
            assert torch.equal(structure.diagonal(offset), arcs[:, :n, :n].diagonal(offset, dim1=1, dim2=2))
        assert torch.equal(structure.arcs, arcs)
        assert all(torch.equal(a, b) for a, b in zip(structure.border, (arcs[:, :n, n:], arcs[:, n:])))
    assert not HeadStructure(**common, topology=graphs.topology.parse("star()")).row_tokens


def test_new_arcs_give_a_structure_of_row_tokens_the_new_rows_token_tables():
    """Each row's token table is a view of the arcs: arcs set after a kernel read the table
    (``HeadStructure.arcs = ...``) are the ones every later read sees, the table included."""
    topo = graphs.topology.parse("star(wrap=True) | root()")
    old, new = torch.tensor([[True] * 5, [True] * 5]), torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    crf = graphs.CRF(vocab_size=5, labels=2, topology=topo)
    structure = HeadStructure(n=5, gamma=crf.gamma, nodes=crf.node_mask(new), topology=topo, arcs=topo.arcs(old))
    assert torch.equal(structure.token_arcs, topo.arcs(old)[:, :5, :5])  # read once: built
    structure.arcs = topo.arcs(new)
    assert torch.equal(structure.token_arcs, topo.arcs(new)[:, :5, :5])
    for offset in range(-4, 5):
        assert torch.equal(structure.diagonal(offset), topo.arcs(new)[:, :5, :5].diagonal(offset, dim1=1, dim2=2))
