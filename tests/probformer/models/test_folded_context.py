"""FoldedContext: streaming equals the whole computation, constant state, causality,
the reach of the folded and the windowed model, and the recall task."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.models.folded_context import FoldedContext, FoldedContextConfig, FoldedStreamState
from probformer.training.corpus import IGNORE
from probformer.training.recall import RecallTask


def model(folded=True, segment=4, seed=0, **overrides):
    torch.manual_seed(seed)
    keys = dict(vocab_size=20, width=16, heads=2, local_layers=1, global_layers=2, ffn_width=32, segment=segment)
    return FoldedContext(FoldedContextConfig(folded=folded, **{**keys, **overrides})).eval()


@settings(max_examples=30, deadline=None)
@given(
    segment=st.integers(1, 6),
    total=st.integers(1, 30),
    sizes=st.lists(st.integers(1, 9), max_size=8),
    pad=st.integers(0, 7),
    seed=st.integers(0, 100),
)
def test_streamed_equals_the_whole_computation(segment, total, sizes, pad, seed):
    net = model(segment=segment, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 20, (2, total), generator=generator)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, max(1, total - pad) :] = False
    chunks, start = [], 0
    for size in sizes + [total]:
        if start < total:
            chunks.append((tokens[:, start : start + size], mask[:, start : start + size]))
            start += size
    with torch.no_grad():
        whole, _ = net(tokens, mask)
        pieces = list(net.stream(chunks))
    assert [p.shape[1] for p in pieces[:-1]] == [segment] * (len(pieces) - 1)
    streamed = torch.cat(pieces, 1)
    torch.testing.assert_close(streamed[mask], whole[mask], atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    segment=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    seed=st.integers(0, 100),
)
def test_calls_that_share_a_state_yield_what_one_call_yields(segment, sizes, seed):
    """One call per chunk (as a generator feeds a stream): a call that ended on a partial
    segment cleared it, so the next call lost those tokens and started its own segment at
    position 0 against the older memory (wrong logits, no error)."""
    net = model(segment=segment, seed=seed).double()
    total = sum(sizes)
    tokens = torch.randint(0, 20, (2, total), generator=torch.Generator().manual_seed(seed))
    state, pieces, start = FoldedStreamState(), [], 0
    with torch.no_grad():
        whole, _ = net(tokens)
        for size in sizes:
            pieces += list(net.stream([tokens[:, start : start + size]], state))
            start += size
    assert state.position == total
    torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-12, rtol=0)


def test_the_stream_state_has_no_length_sized_axis():
    net = model(segment=5)
    state = FoldedStreamState()
    tokens = torch.randint(0, 20, (3, 601))
    seen = 0
    with torch.no_grad():
        for piece in net.stream((tokens[:, i : i + 13] for i in range(0, 601, 13)), state):
            seen += piece.shape[1]
            for name, tensor in state.tensors().items():
                assert max(tensor.shape) <= max(5, 16, 3), (name, tensor.shape)
    assert seen == 601 and state.position == 601
    assert state.pending_tokens.shape[1] == state.pending_yielded == 601 % 5  # yielded; waits to be completed


@pytest.mark.parametrize("folded", [True, False])
def test_causal(folded):
    net = model(folded)
    tokens = torch.randint(0, 20, (2, 17))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 20
    with torch.no_grad():
        before, after = net(tokens)[0], net(changed)[0]
    torch.testing.assert_close(before[:, :9], after[:, :9], atol=0, rtol=0)
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_the_windowed_model_reach_is_bounded_and_the_folded_one_is_not():
    segment, layers = 4, 3  # windowed: each block looks back segment - 1 tokens
    reach = layers * (segment - 1)
    tokens = torch.randint(0, 20, (1, 40))
    changed = tokens.clone()
    changed[0, 0] = (changed[0, 0] + 1) % 20
    with torch.no_grad():
        windowed = model(False, segment).double()
        folded = model(True, segment).double()  # the influence shrinks ~5x a segment at init
        w_before, w_after = windowed(tokens)[0], windowed(changed)[0]
        f_before, f_after = folded(tokens)[0], folded(changed)[0]
    assert not torch.allclose(w_before[0, reach], w_after[0, reach])
    torch.testing.assert_close(w_before[0, reach + 1 :], w_after[0, reach + 1 :], atol=0, rtol=0)
    assert ((f_before[0, 36:] - f_after[0, 36:]).abs() > 1e-12).any()  # nine segments on


def test_folded_and_windowed_have_the_same_parameters():
    folded, windowed = model(True), model(False)
    assert [(n, p.shape) for n, p in folded.named_parameters()] == [
        (n, p.shape) for n, p in windowed.named_parameters()
    ]


def test_gradients_flow_back_through_the_memory():
    net = model(segment=3).train()
    tokens = torch.randint(0, 20, (2, 12))
    logits, _ = net(tokens)
    logits[:, -1].sum().backward()
    grad = net.embedding.weight.grad
    assert torch.isfinite(grad).all() and grad[tokens[:, 0]].abs().sum() > 0


def test_refusals():
    with pytest.raises(ValueError, match="folded"):
        list(model(False).stream([torch.zeros(1, 4, dtype=torch.long)]))
    with pytest.raises(ValueError, match="segment"):
        FoldedContextConfig(vocab_size=5, segment=0)
    with pytest.raises(ValueError, match="divisible"):
        FoldedContextConfig(vocab_size=5, width=10, heads=3)
    net = model()
    with pytest.raises(ValueError, match="batch size 2"):
        list(net.stream([torch.zeros(2, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)]))
    with pytest.raises(ValueError, match="token ids"):
        list(net.stream([torch.full((1, 3), 99)]))


@pytest.mark.parametrize("folded", [True, False])
@given(mask=st.lists(st.booleans(), min_size=2, max_size=9))
@settings(max_examples=30, deadline=None)
def test_padding_before_a_real_token_is_refused_and_padding_at_the_end_runs(folded, mask):
    """A row whose real tokens are not all first sat at other positions in its segments and
    gave other logits (by 1.2 and more), silently."""
    mask = torch.tensor([mask]) | (torch.arange(len(mask)) == 0)  # one real token at least
    tokens = torch.randint(0, 20, mask.shape)
    net = model(folded, segment=3)
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        with pytest.raises(ValueError, match="padding at its end"):
            net(tokens, mask)
    else:
        net(tokens, mask)


@pytest.mark.parametrize("distance", [1, 5, 40])
def test_recall_batches_put_the_key_at_the_query(distance):
    task = RecallTask(keys=5, fillers=7, offset=3)
    tokens, targets = task.batch(64, distance, torch.Generator().manual_seed(distance))
    assert tokens.shape == (64, task.length(distance)) and tokens.max() < task.vocab_size
    rows, query = (targets != IGNORE).nonzero(as_tuple=True)
    assert rows.tolist() == list(range(64))  # one scored position per sequence
    keys = targets[rows, query]
    assert (tokens[rows, query] == task.query_marker).all()
    assert (tokens[rows, query + 1] == keys).all()  # the next token is the key again
    assert (tokens[rows, query - distance] == keys).all()
    assert (tokens[rows, query - distance - 1] == task.key_marker).all()
    assert ((keys >= task.fillers + 2) & (keys < task.vocab_size)).all()
    with pytest.raises(ValueError, match="distance"):
        task.batch(2, 0)
    with pytest.raises(ValueError, match="keys"):
        RecallTask(keys=0)


def test_a_stream_with_a_real_token_after_padding_is_refused():
    """forward refused it; a stream (within a chunk, or a row padded in one segment and real in
    the next) computed other logits silently."""
    net = model(segment=2)
    tokens = torch.randint(0, 20, (1, 4))
    inside = torch.tensor([[True, False, True, True]])
    with pytest.raises(ValueError, match="padding at its end, across the chunks"):
        list(net.stream([(tokens, inside)]))
    across = FoldedStreamState()
    list(net.stream([(tokens[:, :2], torch.tensor([[True, False]]))], across))
    with pytest.raises(ValueError, match="padding at its end, across the chunks"):
        list(net.stream([(tokens[:, 2:], torch.tensor([[True, True]]))], across))
