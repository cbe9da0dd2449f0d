"""Folded-context mean field (inference.Folded) on graphs.topology.segments(l).

Oracles: the CRF's exact mean-field update equations (tests/oracles.py) at the folded
fixed point, on the prefix each segment saw; the plain MeanField when one segment holds
the whole input; and the whole-tensor reference against the stream."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from tests import oracles


def segment_crf(length, causal=False, seed=0, global_labels=3, scale=1.0, labels=4):
    torch.manual_seed(seed)
    crf = graphs.CRF(
        vocab_size=9,
        labels=labels,
        channels=2,
        rank=2,
        global_labels=global_labels,
        topology=graphs.topology.segments(length, causal=causal),
    ).double()
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(scale)
    return crf


def split(tokens, mask, sizes):
    """Chunks of the given sizes (the rest in one last chunk)."""
    chunks, start = [], 0
    for size in sizes:
        if start >= tokens.shape[1]:
            break
        chunks.append((tokens[:, start : start + size], mask[:, start : start + size]))
        start += size
    if start < tokens.shape[1]:
        chunks.append((tokens[:, start:], mask[:, start:]))
    return chunks


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 5),
    total=st.integers(1, 23),
    causal=st.booleans(),
    schedule=st.sampled_from(["async", "parallel", "macaron"]),
    mup=st.booleans(),
    sizes=st.lists(st.integers(1, 7), max_size=8),
    pad=st.integers(0, 6),
    seed=st.integers(0, 1000),
)
def test_streamed_equals_the_whole_tensor_computation(length, total, causal, schedule, mup, sizes, pad, seed):
    crf = segment_crf(length, causal, seed)
    folded = inference.Folded(inference.MeanField(crf, iterations=3, schedule=schedule, mup=mup))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 9, (2, total), generator=generator)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, max(1, total - pad) :] = False  # row 1 ends early: padding at its end
    with torch.no_grad():
        whole = folded(tokens, mask)
        pieces = list(folded.stream(split(tokens, mask, sizes)))
    assert [p.shape[1] for p in pieces[:-1]] == [length] * (len(pieces) - 1)
    assert 1 <= pieces[-1].shape[1] <= length
    torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-12, rtol=0)


@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 5), sizes=st.lists(st.integers(1, 7), min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_calls_that_share_a_state_yield_what_the_whole_computation_gives(length, sizes, seed):
    """A call per chunk with one FoldState: a partial segment at the end of a call is kept
    and completed by the next, which yields the whole segment again (later tokens change
    its earlier labels). Each piece is written where state.position says it ends."""
    crf = segment_crf(length, seed=seed)
    folded = inference.Folded(inference.MeanField(crf, iterations=3))
    total = sum(sizes)
    tokens = torch.randint(0, 9, (2, total), generator=torch.Generator().manual_seed(seed))
    state, streamed, start = inference.FoldState(), torch.full((2, total, crf.labels), torch.nan).double(), 0
    with torch.no_grad():
        whole = folded(tokens)
        for size in sizes:
            for piece in folded.stream([tokens[:, start : start + size]], state):
                streamed[:, state.position - piece.shape[1] : state.position] = piece
            start += size
    assert state.position == total
    torch.testing.assert_close(streamed, whole, atol=1e-12, rtol=0)


def test_one_segment_is_the_plain_mean_field():
    crf = segment_crf(length=8, seed=1)
    mean_field = inference.MeanField(crf, iterations=4)
    tokens = torch.randint(0, 9, (3, 8))
    with torch.no_grad():
        torch.testing.assert_close(inference.Folded(mean_field)(tokens), mean_field(tokens).logits)
        torch.testing.assert_close(
            torch.cat(list(inference.Folded(mean_field).stream([tokens])), 1), mean_field(tokens).logits
        )


@pytest.mark.parametrize("causal", [False, True])
def test_fixed_point_satisfies_the_update_equations_on_each_prefix(causal):
    """Converged, segment s's labels are the exact mean-field update of the CRF on the
    tokens of segments 0..s (later segments do not exist yet) at the folded marginals."""
    length, total = 3, 10
    crf = segment_crf(length, causal, seed=5, scale=0.5)  # a contraction: one fixed point
    folded = inference.Folded(inference.MeanField(crf, iterations=60))
    tokens = torch.randint(0, 9, (1, total), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        q_z = folded(tokens).softmax(-1)[0]
    for start in range(0, total, length):
        end = min(start + length, total)
        prefix = tokens[0, :end].tolist()
        update = oracles.mean_field_update(crf, prefix, [True] * end, q_z[:end])
        torch.testing.assert_close(q_z[start:end], update[start:end], atol=1e-9, rtol=0)


def test_later_tokens_never_change_earlier_segments():
    crf = segment_crf(length=4, seed=3)
    folded = inference.Folded(inference.MeanField(crf, iterations=3))
    tokens = torch.randint(0, 9, (2, 14))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 9
    with torch.no_grad():
        before, after = folded(tokens), folded(changed)
        plain = inference.MeanField(crf, iterations=3)
        plain_before, plain_after = plain(tokens).logits, plain(changed).logits
    torch.testing.assert_close(before[:, :8], after[:, :8], atol=0, rtol=0)
    assert not torch.allclose(before[:, 8:], after[:, 8:])
    # the full mean field, by contrast, hears back from later segments
    assert not torch.allclose(plain_before[:, :8], plain_after[:, :8])


def test_the_streaming_state_has_no_length_sized_axis():
    length, total = 5, 403
    crf = segment_crf(length, seed=4, labels=3)
    folded = inference.Folded(inference.MeanField(crf, iterations=2))
    state = inference.FoldState()
    tokens = torch.randint(0, 9, (2, total))
    chunks = (tokens[:, i : i + 7] for i in range(0, total, 7))
    seen = 0
    with torch.no_grad():
        for piece in folded.stream(chunks, state):
            seen += piece.shape[1]
            for name, tensor in state.tensors().items():
                assert max(tensor.shape) <= max(length, 2, crf.labels), (name, tensor.shape)
    assert seen == total and state.position == total
    # the last, partial segment was yielded and waits for the tokens that complete it
    assert state.pending_tokens.shape[1] == state.pending_yielded == total % length


def test_gradients_flow_through_the_memory():
    crf = segment_crf(length=3, seed=6).float()
    folded = inference.Folded(inference.MeanField(crf, iterations=2))
    tokens = torch.randint(0, 9, (2, 9))
    last = torch.cat(list(folded.stream([tokens])), 1)[:, 6:]
    last.sum().backward()
    assert torch.isfinite(crf.unary.grad).all()
    # the first segment's tokens reach the last segment only through two memories
    assert crf.unary.grad[tokens[:, :3].flatten()].abs().sum() > 0


def test_refusals():
    with pytest.raises(ValueError, match="segments"):
        inference.Folded(inference.MeanField(graphs.CRF(vocab_size=5, labels=2, topology="full")))
    crf = segment_crf(3)
    with pytest.raises(ValueError, match="sequential"):
        inference.Folded(inference.MeanField(crf, schedule="sequential"))
    with pytest.raises(ValueError, match="halting"):
        inference.Folded(inference.MeanField(crf, halting="act"))
    folded = inference.Folded(inference.MeanField(crf))
    with pytest.raises(ValueError, match="mask"):
        list(folded.stream([(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))]))
    with pytest.raises(ValueError, match="batch size 2"):
        list(folded.stream([torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long)]))
    with pytest.raises(ValueError, match=r"\[0, 9\)|vocab"):
        list(folded.stream([torch.full((1, 4), 99)]))
