"""The fused kernel's fast path against answers written here.

``inference.mean_field.kernels.fused.far_attention``: the far attentions in query blocks that skip fully masked keys,
and the op's own causal mode past ``NATIVE_CAUSAL_FROM`` (forced here at small n), against
a masked softmax materialised from the definition, for outputs, lse and every gradient
(the key bias's included), on both sides, with and without a token mask, and with padding
keys. ``inference.mean_field.kernels.fused.message_assembly``: parts written into one tensor against their plain
sum. ``head_kernels.fused`` against the materialised messages at lengths that make several
query blocks, for every topology kind (unmasked, causal, masked, windowed, virtual nodes).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from inference.mean_field.kernels import head_kernels
from inference.mean_field.kernels.fused import far_attention
from inference.mean_field.kernels.fused.message_assembly import Part, assemble
from inference.mean_field.kernels.head_kernels import HeadStructure

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/inference/conftest.py


def far_reference(q, k, v, key_bias, scale, shift, side, token_mask):
    """The definition: row i over keys j <= i - shift (left) or j >= i + shift (right), and
    token_mask[i, j], and not absent (a key bias of ``ABSENT``: padding); rows with no key
    get out = 0 (their lse is not compared)."""
    n = q.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i - shift) if side == "left" else (j >= i + shift)
    if token_mask is not None:
        allowed = allowed & token_mask
    allowed = allowed & (key_bias > far_attention.ABSENT / 2).permute(0, 2, 1)[:, :, None, :]  # [B, C, n, n]
    scores = scale * torch.einsum("bicr,bjcr->bcij", q, k) + key_bias.permute(0, 2, 1)[:, :, None, :]
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = scores.logsumexp(-1)
    probs = torch.where(allowed, (scores - lse[..., None]).exp(), 0.0)
    return torch.einsum("bcij,bjcr->bicr", probs, v), lse, allowed.any(-1)


def values_and_gradients(fn, tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse, has_key = fn(*leaves)
    generator = torch.Generator().manual_seed(1)
    d_out = torch.randn(out.shape, generator=generator, dtype=out.dtype)
    d_lse = torch.randn(lse.shape, generator=generator, dtype=lse.dtype)
    lse = torch.where(has_key, lse, 0.0)  # a row with no key: its lse is the sinks', not compared
    loss = (out * d_out).sum() + (lse * d_lse).sum()
    return [out, lse, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("native", [False, True], ids=["blocks", "op's causal mode"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "token mask"])
@pytest.mark.parametrize("n, shift", [(3, 4), (9, 1), (150, 4), (200, 2)])
def test_far_attention_equals_its_definition(native, side, masked, n, shift, monkeypatch):
    if native:  # small n through the op's causal mode (masked sides always take the blocks)
        monkeypatch.setattr(far_attention, "NATIVE_CAUSAL_FROM", 1)
    torch.manual_seed(n + shift)
    B, C, r = 2, 2, 3
    q, k, v = (2 * torch.randn(B, n, C, r, dtype=torch.float64) for _ in range(3))
    key_bias = torch.randn(B, n, C, dtype=torch.float64)
    key_bias[1, n // 2 :] = far_attention.ABSENT  # padding keys
    token_mask = torch.rand(n, n) < 0.6 if masked else None
    has_key = far_reference(q, k, v, key_bias, 0.7, shift, side, token_mask)[2]

    def ours(*t, flash):
        out, lse = far_attention.far_attention(*t, 0.7, shift, side, token_mask, flash=flash)
        return out, lse, has_key

    def reference(*t):
        return far_reference(*t, 0.7, shift, side, token_mask)

    expected = values_and_gradients(reference, [q, k, v, key_bias])
    for flash in (True, False):  # the CPU op and the materialised path of other devices
        got = values_and_gradients(lambda *t, f=flash: ours(*t, flash=f), [q, k, v, key_bias])
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_far_attention_without_the_op_equals_its_definition():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 80, 2, 3, dtype=torch.float64) for _ in range(3))
    key_bias = torch.randn(2, 80, 2, dtype=torch.float64)
    for side in ("left", "right"):
        has_key = far_reference(q, k, v, key_bias, 1.3, 3, side, None)[2]
        got = values_and_gradients(
            lambda *t, s=side, h=has_key: (*far_attention.far_attention(*t, 1.3, 3, s, None, flash=False), h),
            [q, k, v, key_bias],
        )
        expected = values_and_gradients(lambda *t, s=side: far_reference(*t, 1.3, 3, s, None), [q, k, v, key_bias])
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_far_attention_refuses_an_unknown_side():
    x = torch.zeros(1, 4, 1, 2)
    with pytest.raises(ValueError, match="side must be 'left' or 'right'"):
        far_attention.far_attention(x, x, x, x[..., 0], 1.0, 2, "up")


@settings(max_examples=30, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(1, 6), st.integers(0, 6), st.booleans()),
        min_size=1,
        max_size=6,
    )
)
def test_assemble_equals_the_sum_of_padded_parts(layout):
    """Each slot is the sum of its parts, zero elsewhere, in values and in gradients."""
    torch.manual_seed(len(layout))
    B, N, S, C, r = 2, 12, 4, 2, 3
    sources = [torch.randn(B, N, C, r, dtype=torch.float64) for _ in range(2)]
    weight = torch.rand(B, N, C, 1, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (*sources, weight)]
    parts, expected = [], torch.zeros(B, N, S, C, r, dtype=torch.float64)
    for index, (slot, row, length, source_row, weighted) in enumerate(layout):
        length = min(length, N - row, N - source_row)
        if length < 1:
            continue
        source = leaves[index % 2]
        parts.append(Part(slot, row, length, source, source_row, leaves[2] if weighted else None, source_row))
        value = source[:, source_row : source_row + length]
        if weighted:
            value = weight[:, source_row : source_row + length] * value
        expected = (
            expected
            + torch.nn.functional.pad(value, (0, 0, 0, 0, row, N - row - length))[:, :, None]
            * (torch.arange(S) == slot).to(value)[None, None, :, None, None]
        )
    if not parts:
        return
    got = assemble(parts, S, N)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    direction = torch.randn(B, N, S, C, r, dtype=torch.float64)
    ours = torch.autograd.grad((got * direction).sum(), leaves, allow_unused=True)
    theirs = torch.autograd.grad((expected * direction).sum(), leaves, allow_unused=True)
    for a, b in zip(ours, theirs, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def structure_of(crf, mask):
    n = mask.shape[1]
    return HeadStructure(
        n=n,
        gamma=crf.gamma,
        cuts=crf.distance_cuts,
        groups=crf.distance_groups(n),
        arcs=crf.arc_mask(mask),
        nodes=crf.node_mask(mask),
        token_arcs=crf.topology.mask(n)[:n, :n],
        band=crf.topology.band,
        topology=crf.topology,
    )


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
    assert stacked.shape == (2, N, 2, crf.num_groups, 2, 3) and stacked.is_contiguous()


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


@pytest.mark.parametrize("topology", ["causal", "window(2)", "chain()", "causal | root()"])
def test_mean_field_projecting_only_the_used_groups_equals_naive(topology):
    """MeanField with the fused kernel projects onto the groups with arcs alone: its label
    marginals, head marginals and parameter gradients equal the naive kernel's (all groups)."""
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=11, labels=4, channels=2, rank=3, topology=topology, gamma=3).double()
    tokens = torch.randint(0, 11, (2, 140))
    mask = torch.ones(2, 140, dtype=torch.bool)
    mask[1, 90:] = False
    results = []
    for kernel in ("fused", "naive"):
        crf.zero_grad()
        engine = inference.MeanField(crf, iterations=2, kernel=kernel)
        posterior = engine(tokens, mask)
        posterior.logits.square().sum().backward()
        results.append([posterior.z, posterior.h, *(p.grad.clone() for p in crf.parameters() if p.grad is not None)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
