"""FoldedContext's bad input, forward and stream: a non-contiguous batch (a transposed or
strided view, whose default mask keeps its strides) gives the logits of its contiguous copy
(it failed with a bare view error); ``stream`` and ``push_segment`` refuse a state of another
type by name (an int or None raised AttributeError) and check a segment's tokens as the
forward does (float ids failed inside the embedding, ids out of range with an IndexError, no
mask with an AttributeError)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probformer
from inference import FoldState
from probformer.models.folded_context import FoldedStreamState


def model() -> probformer.FoldedContext:
    torch.manual_seed(0)
    config = probformer.FoldedContextConfig(
        vocab_size=11, width=8, heads=2, local_layers=1, global_layers=1, ffn_width=16, segment=3
    )
    return probformer.FoldedContext(config).eval()


MODEL = model()
TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])
MASK = torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize("state", [5, "state", FoldState()])
def test_a_stream_state_of_another_type_is_refused_by_name(state):
    with pytest.raises(TypeError, match=r"state must be a FoldedStreamState or None \(a fresh stream\)"):
        list(MODEL.stream([TOKENS], state=state))


@pytest.mark.parametrize("state", [None, 5, FoldState()])
def test_push_segment_needs_a_state_it_can_update(state):
    words = r"state must be a FoldedStreamState \(FoldedStreamState\(\) for a fresh stream\)"
    with pytest.raises(TypeError, match=words):
        MODEL.push_segment(TOKENS, MASK, state)


@pytest.mark.parametrize(
    ("tokens", "mask", "error", "words"),
    [
        (TOKENS.float(), MASK, TypeError, "tokens must have an integer dtype"),
        (TOKENS, MASK.long(), TypeError, "mask must be a torch.bool tensor"),
        (TOKENS + 11, MASK, ValueError, r"token ids must lie in \[0, 11\) \(vocab_size\)"),
    ],
)
def test_push_segment_refuses_bad_tokens_by_name(tokens, mask, error, words):
    with pytest.raises(error, match=words), torch.no_grad():
        MODEL.push_segment(tokens, mask, FoldedStreamState())


@given(yielded=st.one_of(st.integers(max_value=-1), st.integers(min_value=4), st.floats(0, 3), st.booleans()))
def test_a_bad_yielded_is_refused_by_name(yielded):
    with pytest.raises(ValueError, match=r"yielded must be an integer in \[0, 3\]"), torch.no_grad():
        MODEL.push_segment(TOKENS, MASK, FoldedStreamState(), yielded)


def test_push_segment_without_a_mask_gives_the_streams_first_segment():
    with torch.no_grad():
        got = MODEL.push_segment(TOKENS, None, FoldedStreamState())
        expected = next(iter(MODEL.stream([TOKENS])))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), segments=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_strided_batch_gives_the_logits_of_its_contiguous_copy(batch, segments, seed):
    tokens = torch.randint(0, 11, (batch, 6 * segments), generator=torch.Generator().manual_seed(seed))[:, ::2]
    assert not tokens.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(MODEL(tokens)[0], MODEL(tokens.contiguous())[0], rtol=0, atol=0)


def test_a_transposed_mask_is_read_as_its_contiguous_copy():
    tokens = torch.randint(0, 11, (2, 6))
    mask = torch.ones(6, 2, dtype=torch.bool).t()
    with torch.no_grad():
        torch.testing.assert_close(MODEL(tokens, mask)[0], MODEL(tokens)[0], rtol=0, atol=0)
