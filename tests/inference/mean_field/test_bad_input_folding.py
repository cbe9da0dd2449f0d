"""``inference.Folded`` refuses what is not its input by name: ``Folded(5)`` and
``stream(..., state=5)`` raised AttributeError, ``push_segment`` with no state raised
AttributeError, with no mask a bare torch error, and it read float ids as their integer
parts and took any ``yielded``, moving ``state.position`` backwards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs
import inference
from probformer.models.folded_context import FoldedStreamState

LENGTH, VOCAB = 3, 9


def folded():
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=VOCAB, labels=4, topology=graphs.topology.segments(LENGTH))
    return inference.Folded(inference.MeanField(crf, iterations=2))


FOLDED = folded()
TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])
MASK = torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize("engine", [5, None, graphs.CRF(vocab_size=VOCAB, labels=4)])
def test_folded_of_what_is_not_a_mean_field_is_refused_by_name(engine):
    with pytest.raises(TypeError, match="Folded needs an inference.MeanField"):
        inference.Folded(engine)


@pytest.mark.parametrize("state", [5, "state", {}, FoldedStreamState()])
def test_a_stream_state_of_another_type_is_refused_by_name(state):
    with pytest.raises(TypeError, match=r"state must be a FoldState or None \(a fresh stream\)"):
        list(FOLDED.stream([TOKENS], state=state))


@pytest.mark.parametrize("state", [None, 5, FoldedStreamState()])
def test_push_segment_needs_a_state_it_can_update(state):
    with pytest.raises(TypeError, match=r"state must be a FoldState \(FoldState\(\) for a fresh stream\)"):
        FOLDED.push_segment(TOKENS, MASK, state)


@pytest.mark.parametrize(
    ("tokens", "mask", "error", "words"),
    [
        (TOKENS.float() + 0.5, MASK, TypeError, "tokens must have an integer dtype"),
        (TOKENS, MASK.long(), TypeError, "mask must be a torch.bool tensor"),
        (TOKENS[0], MASK[0], ValueError, r"tokens must have shape \[batch, length\]"),
        (TOKENS + VOCAB, MASK, ValueError, r"token ids must lie in \[0, 9\) \(vocab_size\)"),
    ],
)
def test_push_segment_refuses_bad_tokens_by_name(tokens, mask, error, words):
    with pytest.raises(error, match=words):
        FOLDED.push_segment(tokens, mask, inference.FoldState())


@given(yielded=st.one_of(st.integers(max_value=-1), st.integers(min_value=4), st.floats(0, 3), st.booleans()))
def test_a_bad_yielded_is_refused_by_name(yielded):
    state = inference.FoldState()
    with pytest.raises(ValueError, match=r"yielded must be an integer in \[0, 3\]"):
        FOLDED.push_segment(TOKENS, MASK, state, yielded)
    assert state.position == 0


def test_a_fresh_state_without_a_mask_gives_the_streams_first_segment():
    state = inference.FoldState()
    with torch.no_grad():
        got = FOLDED.push_segment(TOKENS, None, state)
        expected = next(iter(FOLDED.stream([TOKENS])))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert state.position == LENGTH and state.memory_logits is not None


def test_a_stream_state_is_built_by_keyword_only():
    """The states share their pending fields from one base, which come first: a positional
    argument would fill a pending field where the memory was meant, so none is accepted."""
    memory = torch.zeros(1, 2, 3)
    with pytest.raises(TypeError):
        inference.FoldState(memory)
    with pytest.raises(TypeError):
        FoldedStreamState(memory)
    assert inference.FoldState(memory_logits=memory).memory_logits is memory
    assert FoldedStreamState(memory=memory).memory is memory
