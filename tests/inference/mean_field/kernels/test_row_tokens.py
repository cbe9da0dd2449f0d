"""Topologies whose rows have token arcs of their own length (``star(wrap=True)``, a function
of n, and unions with them): the fused and flex kernels read each row's token table
(``HeadStructure.token_arcs [B, n, n]``) and equal the naive kernel in values and gradients
(float64) on padded batches of mixed lengths; a sentence alone gets the same messages as in
a padded batch; and the kernels equal a dense reference whose arcs and distance groups are
written from the oracles' predicates (tests/oracles.py), not read from the library."""

import types
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
from inference.mean_field.kernels import head_kernels
from inference.mean_field.kernels.flex import flex
from inference.mean_field.kernels.structure import HeadStructure
from tests.builders import head_structure_of, last_is_head
from tests.oracles import dense_attention_reference, group_of, star_rule

pytestmark = pytest.mark.usefixtures("one_thread")


def mirror(n: int) -> torch.Tensor:
    """Token i may choose its mirror n - 1 - i: arcs that move with the sentence's length."""
    i = torch.arange(n)
    arcs = torch.zeros(n, n, dtype=torch.bool)
    arcs[i, n - 1 - i] = True
    return arcs & (i[:, None] != i[None, :])


def mirror_rule(i: int, j: int, n: int) -> bool:
    return i < n and j < n and i != j and j == n - 1 - i


ROW_TOPOLOGIES = {
    "star(wrap=True)": graphs.topology.parse("star(wrap=True)"),
    "window(1) | star(wrap=True)": graphs.topology.parse("window(1) | star(wrap=True)"),
    "causal | star(wrap=True)": graphs.topology.parse("causal | star(wrap=True)"),
    "star(wrap=True) | root()": graphs.topology.parse("star(wrap=True) | root()"),
    "mirror": graphs.topology.from_callable(mirror),
    "mirror | clusters(2)": graphs.topology.from_callable(mirror) | graphs.topology.clusters(2),
    "window(2) | last is head": graphs.topology.window(2) | graphs.topology.from_callable(last_is_head),
}

SCALE = 0.7


def crf_on(topology, gamma: int, channels: int = 2) -> graphs.CRF:
    return graphs.CRF(vocab_size=5, labels=3, channels=channels, rank=3, topology=topology, gamma=gamma)


def engine_structure(crf, mask) -> HeadStructure:
    """The structure as ``MeanField`` builds it: the topology, its border and each row's arcs."""
    topology = crf.topology
    return HeadStructure(
        n=mask.shape[1],
        gamma=crf.gamma,
        cuts=crf.distance_cuts,
        nodes=crf.node_mask(mask),
        border=topology.border(mask),
        band=topology.band,
        topology=topology,
        arcs=crf.arc_mask(mask),
    )


def projections_of(crf, structure, seed: int) -> list[torch.Tensor]:
    """query, key, value, value_rev ``[B, N, K, C, r]`` (float64, peaked: near-uniform attention hides bugs)."""
    generator = torch.Generator().manual_seed(seed)
    B, N = structure.nodes.shape
    shape = (B, N, crf.num_groups, crf.channels, crf.rank)
    return [2 * torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(4)]


def outputs_and_gradients(kernel, projections, structure, bias=None, cotangents=None):
    """forward, reverse, lse and the gradients of a fixed random function of them w.r.t. the
    projections (and the bias)."""
    leaves = [p.detach().clone().requires_grad_() for p in projections]
    extra = {} if bias is None else {"bias": bias.detach().clone().requires_grad_()}
    result = kernel(*leaves, SCALE, structure, **extra)
    outputs = (result.forward, result.reverse, result.lse) if hasattr(result, "lse") else result
    if cotangents is None:
        generator = torch.Generator().manual_seed(1)
        cotangents = [torch.randn(t.shape, generator=generator, dtype=torch.float64) for t in outputs]
    loss = sum((t * c).sum() for t, c in zip(outputs, cotangents))
    leaves += list(extra.values())
    loss = loss + sum(t.sum() * 0 for t in leaves)  # a batch with no arc at all depends on nothing
    return [t.detach() for t in outputs] + list(torch.autograd.grad(loss, leaves))


def fused_with(flash: bool):
    def kernel(*args, **kwargs):
        with mock.patch.object(head_kernels, "fused_available", lambda device: flash):
            return head_kernels.fused(*args, **kwargs)

    return kernel


KERNELS = {"fused (CPU flash op)": fused_with(True), "fused (materialised)": fused_with(False), "flex": flex}


def assert_all_close(ours, theirs, what):
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.isfinite(a).all(), (what, index)
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m, i=index: f"{what} output {i}: {m}")


@st.composite
def batches(draw, holes: bool = True):
    """``(mask [B, n], gamma)``: sentences of mixed real lengths, right-padded (and, with
    ``holes``, padded positions inside a row too)."""
    lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=3))
    n = max(1, max(lengths) + draw(st.integers(0, 3)))
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    if holes:
        mask = mask & torch.tensor([draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in lengths])
    return mask, draw(st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(ROW_TOPOLOGIES)),
    batch=batches(),
    with_bias=st.booleans(),
    built_by=st.sampled_from(["engine", "builder", "topology"]),
    seed=st.integers(0, 2**16),
)
def test_fused_and_flex_equal_naive_on_each_rows_own_token_arcs(name, batch, with_bias, built_by, seed):
    """Values and gradients (projections and bias), float64, on padded batches of mixed
    lengths, with the structure as the engine builds it, as the tests' builder does (each
    row's table given) and from the topology alone (each row's arcs built on first read)."""
    mask, gamma = batch
    crf = crf_on(ROW_TOPOLOGIES[name], gamma)
    if built_by == "engine":
        structure = engine_structure(crf, mask)
    elif built_by == "builder":
        structure = head_structure_of(crf, mask)
    else:  # nothing but the topology, the nodes and the border
        structure = engine_structure(crf, mask)
        structure._arcs = None
    assert structure.row_tokens and structure.token_arcs.shape == (mask.shape[0], mask.shape[1], mask.shape[1])
    projections = projections_of(crf, structure, seed)
    bias = torch.randn(crf.num_groups, crf.channels, dtype=torch.float64) if with_bias else None
    naive = outputs_and_gradients(head_kernels.naive, projections, engine_structure(crf, mask), bias)
    for kernel_name, kernel in KERNELS.items():
        assert_all_close(outputs_and_gradients(kernel, projections, structure, bias), naive, f"{name}: {kernel_name}")


def real_nodes(mask_row: torch.Tensor, virtual: int) -> torch.Tensor:
    """The node indices of one row that exist: its real tokens, then the virtual nodes."""
    n = mask_row.shape[0]
    return torch.cat([mask_row.nonzero().flatten(), torch.arange(n, n + virtual)])


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(ROW_TOPOLOGIES)), batch=batches(holes=False), seed=st.integers(0, 2**16))
def test_a_sentence_alone_gets_the_messages_it_gets_padded_in_a_batch(name, batch, seed):
    """Each row of a padded batch against the same sentence alone at its own length (its
    projections at its nodes): messages, lse and the gradients at its nodes, every kernel."""
    mask, gamma = batch
    crf = crf_on(ROW_TOPOLOGIES[name], gamma)
    structure = engine_structure(crf, mask)
    projections = projections_of(crf, structure, seed)
    virtual, (B, N), shape = crf.topology.extra_nodes, structure.nodes.shape, projections[0].shape
    generator = torch.Generator().manual_seed(seed + 1)
    cotangents = [torch.randn(size, generator=generator, dtype=torch.float64) for size in (shape, shape, (B, 2, N))]
    for row in range(B):
        length = int(mask[row].sum())
        if length == 0:
            continue
        nodes = real_nodes(mask[row], virtual)
        alone = engine_structure(crf, torch.ones(1, length, dtype=torch.bool))
        # the batch's cotangents: zero but at this row's nodes, where they are the sentence's own
        kept = torch.zeros(B, N, dtype=torch.bool)
        kept[row, nodes] = True
        batched_cotangents = [c * kept[:, :, None, None, None] for c in cotangents[:2]]
        batched_cotangents.append(cotangents[2] * kept[:, None])
        alone_cotangents = at_nodes(cotangents, row, nodes)
        alone_projections = [p[row : row + 1, nodes] for p in projections]
        for kernel_name, kernel in {"naive": head_kernels.naive, **KERNELS}.items():
            single = outputs_and_gradients(kernel, alone_projections, alone, cotangents=alone_cotangents)
            batched = outputs_and_gradients(kernel, projections, structure, cotangents=batched_cotangents)
            assert_all_close(at_nodes(batched, row, nodes), single, f"{name} row {row}: {kernel_name}")


def at_nodes(outputs: list, row: int, nodes: torch.Tensor) -> list:
    """forward, reverse, lse ``[B, C, N]`` and any gradients ``[B, N, ...]``: row ``row`` at ``nodes``."""
    forward, reverse, lse, *gradients = outputs
    return (
        [t[row : row + 1, nodes] for t in (forward, reverse)]
        + [lse[row : row + 1][:, :, nodes]]
        + [t[row : row + 1, nodes] for t in gradients]
    )


def oracle_structure(rule, mask: torch.Tensor, gamma: int, virtual: int):
    """What the dense reference reads, written from a predicate over (dependent, head, real
    length) on each row's real tokens in order (virtual nodes after them: the predicate's
    nodes from its length on), and the distance groups of the oracles (by position)."""
    B, n = mask.shape
    N = n + virtual
    arcs = torch.zeros(B, N, N, dtype=torch.bool)
    for row in range(B):
        nodes = real_nodes(mask[row], virtual).tolist()
        length = len(nodes) - virtual
        for a, i in enumerate(nodes):
            for b, j in enumerate(nodes):
                arcs[row, i, j] = a != b and rule(a, b, length)
    groups = torch.tensor([[group_of(i, j, n, gamma) for j in range(N)] for i in range(N)])
    nodes = torch.cat([mask, torch.ones(B, virtual, dtype=torch.bool)], 1)
    return types.SimpleNamespace(n=n, gamma=gamma, nodes=nodes, arcs=arcs, groups=groups)


ORACLE_CASES = {"star(wrap=True)": star_rule(True), "mirror": mirror_rule}


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(ORACLE_CASES)), batch=batches(holes=False), seed=st.integers(0, 2**16))
def test_each_kernel_equals_a_dense_reference_with_the_oracles_arcs(name, batch, seed):
    """Right-padded rows: a row's real tokens are its first positions, where the oracles'
    predicates (written for a sentence of the row's length) apply as they are."""
    mask, gamma = batch
    crf = crf_on(ROW_TOPOLOGIES[name], gamma)
    structure = engine_structure(crf, mask)
    projections = projections_of(crf, structure, seed)
    bias = torch.randn(crf.num_groups, crf.channels, dtype=torch.float64)
    oracle = oracle_structure(ORACLE_CASES[name], mask, gamma, crf.topology.extra_nodes)
    expected = outputs_and_gradients(dense_attention_reference, projections, oracle, bias)
    for kernel_name, kernel in {"naive": head_kernels.naive, **KERNELS}.items():
        ours = outputs_and_gradients(kernel, projections, structure, bias)
        assert_all_close(ours, expected, f"{name}: {kernel_name}")


@pytest.mark.parametrize("name", ["star(wrap=True)", "window(2) | last is head"])
def test_fused_equals_naive_past_one_query_block(name):
    """At n = 150 the far attentions cut the rows into several query blocks, each with its own
    mask per row (made where it is read, forward and backward)."""
    n = 150
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, 97:] = False
    mask[2, 20:60] = False
    crf = crf_on(ROW_TOPOLOGIES[name], gamma=2)
    structure = engine_structure(crf, mask)
    projections = projections_of(crf, structure, 0)
    naive = outputs_and_gradients(head_kernels.naive, projections, structure)
    for kernel_name in ("fused (CPU flash op)", "fused (materialised)"):
        assert_all_close(outputs_and_gradients(KERNELS[kernel_name], projections, structure), naive, kernel_name)
