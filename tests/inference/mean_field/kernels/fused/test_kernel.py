"""The fused kernel (inference.mean_field.kernels.fused.kernel) against the naive one over
several query blocks and on bounded topologies, and the groups it projects onto."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from inference.mean_field.kernels import head_kernels
from tests.builders import head_structure_of

pytestmark = pytest.mark.usefixtures("one_thread")


def topology_problem(topology: str, n: int, gamma: int, padding: list[int], seed: int):
    torch.manual_seed(seed)
    crf = graphs.CRF(vocab_size=7, labels=3, channels=2, rank=3, topology=topology, gamma=gamma).double()
    mask = torch.ones(len(padding), n, dtype=torch.bool)
    for row, pad in enumerate(padding):
        mask[row, n - min(pad, n - 1) :] = False
    tokens = torch.randint(0, 7, mask.shape)
    structure = inference.MeanField(crf, kernel="naive").structure(tokens, mask)[2]
    N = structure.nodes.shape[1]
    projections = [2 * torch.randn(len(padding), N, crf.num_groups, 2, 3, dtype=torch.float64) for _ in range(4)]
    return structure, projections


def kernel_outputs_and_gradients(kernel, structure, projections):
    leaves = [p.clone().requires_grad_() for p in projections]
    out = kernel(*leaves, 0.8, structure)
    generator = torch.Generator().manual_seed(1)
    loss = sum(
        (t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum()
        for t in (out.forward, out.reverse, out.lse)
    )
    return [out.forward, out.reverse, out.lse, *torch.autograd.grad(loss, leaves)]


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(["window({})", "segments({})", "segments({}, causal=True)", "window({}) | root()"]),
    size=st.integers(1, 40),
    n=st.integers(2, 200),
    gamma=st.integers(1, 3),
    padding=st.lists(st.integers(0, 60), min_size=1, max_size=2),
    seed=st.integers(0, 100),
)
def test_fused_on_bounded_topologies_equals_naive(kind, size, n, gamma, padding, seed):
    """The fused kernel, whose far attentions read only the span's keys, against the naive
    kernel (every arc materialised): messages, lse and the gradients of all projections."""
    structure, projections = topology_problem(kind.format(size), n, gamma, padding, seed)
    got = kernel_outputs_and_gradients(head_kernels.fused, structure, projections)
    expected = kernel_outputs_and_gradients(head_kernels.naive, structure, projections)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("topology", ["window(64)", "segments(48)", "window(20) | clusters(4)"])
def test_fused_at_many_blocks_equals_naive(topology):
    """Lengths that make many query blocks of each span (n = 700), one padded row."""
    structure, projections = topology_problem(topology, 700, 3, [0, 250], 0)
    got = kernel_outputs_and_gradients(head_kernels.fused, structure, projections)
    expected = kernel_outputs_and_gradients(head_kernels.naive, structure, projections)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("topology", ["full", "segments(40)", "window(9) | root()"])
def test_fused_reads_projections_given_as_their_groups(topology):
    """Projections as tuples of their K groups (``project(..., grouped=True)``), key passed as
    value and query as value_rev (the async schedule's sharing): the naive kernel's messages,
    lse and gradients, each group's gradient its own."""
    structure, projections = topology_problem(topology, 150, 3, [0, 40], 0)
    generator = torch.Generator().manual_seed(2)
    results = []
    for grouped in (False, True):
        if grouped:
            leaves = [tuple(g.clone().requires_grad_() for g in p.unbind(2)) for p in projections[:2]]
            kernel, inputs = head_kernels.fused, [g for p in leaves for g in p]
        else:
            leaves = [p.clone().requires_grad_() for p in projections[:2]]
            kernel, inputs = head_kernels.naive, leaves
        query, key = leaves
        out = kernel(query, key, key, query, 0.8, structure)
        generator.manual_seed(2)
        loss = sum(
            (t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum()
            for t in (out.forward, out.reverse, out.lse)
        )
        grads = torch.autograd.grad(loss, inputs)
        if grouped:
            K = len(query)
            grads = [torch.stack(grads[:K], 2), torch.stack(grads[K:], 2)]
        results.append([out.forward, out.reverse, out.lse, *grads])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def structure_of(crf, mask):
    return head_structure_of(crf, mask, with_topology=True)


@pytest.mark.parametrize("topology", ["full", "causal", "window(9)", "segments(40)", "full | root()", "star()"])
def test_fused_equals_naive_over_several_query_blocks(topology):
    """n = 150 makes 3 query blocks of 64 rows: the block masks, the key ranges and the
    message assembly against the naive kernel, values and gradients."""
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=3, topology=topology, gamma=2)
    mask = torch.ones(2, 150, dtype=torch.bool)
    mask[1, 100:] = False
    structure = structure_of(crf, mask)
    N = structure.nodes.shape[1]
    projections = [2 * torch.randn(2, N, crf.num_groups, 2, 3, dtype=torch.float64) for _ in range(4)]
    results = []
    for kernel in (head_kernels.fused, head_kernels.naive):
        leaves = [p.clone().requires_grad_() for p in projections]
        out = kernel(*leaves, 0.8, structure)
        generator = torch.Generator().manual_seed(1)
        loss = sum(
            (t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum()
            for t in (out.forward, out.reverse, out.lse)
        )
        results.append([out.forward, out.reverse, out.lse, *torch.autograd.grad(loss, leaves)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    stacked = head_kernels.fused(*projections, 0.8, structure).stacked
    # stored slot-major, as back_project reads it with one batched GEMM
    assert stacked.shape == (2, N, 2, crf.num_groups, 2, 3) and stacked.permute(2, 3, 0, 1, 4, 5).is_contiguous()


@pytest.mark.parametrize(
    "topology, expected",
    [
        ("full", tuple(range(8))),
        ("causal", (4, 5, 6, 7)),
        ("window(2)", (0, 1, 4, 5)),
        ("causal | root()", (4, 5, 6, 7, 8)),
    ],
)
def test_used_groups_are_the_groups_with_arcs(topology, expected):
    """The groups ``fused`` reads are exactly those holding an arc of the topology (gamma = 3:
    right groups 0-3, left 4-7, virtual 8), by the definition: the distance groups of the arcs."""
    crf = graphs.CRF(vocab_size=5, labels=3, channels=1, rank=2, topology=topology, gamma=3)
    structure = structure_of(crf, torch.ones(1, 20, dtype=torch.bool))
    with_arcs = tuple(sorted(set(structure.groups[structure.arcs[0]].tolist())))
    assert head_kernels.used_groups(structure) == with_arcs == expected
