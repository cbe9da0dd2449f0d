"""``MeanField.forward``'s ``confidence`` (what ends a token under ``halting="exit"``): a
value that is not a function, and a function whose answer is not a finite ``[B, N]``
floating tensor, are refused by name; a NaN confidence ended every token at once."""

from __future__ import annotations

import pytest
import torch

import graphs
import inference

pytestmark = pytest.mark.usefixtures("one_thread")


def exit_engine() -> inference.MeanField:
    crf = graphs.CRF(vocab_size=7, labels=3, channels=2, rank=2)
    return inference.MeanField(crf, iterations=3, halting="exit").eval()


TOKENS = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])


@pytest.mark.parametrize("confidence", [5, True, torch.ones(2, 4), "max"])
def test_a_confidence_that_is_not_a_function_is_refused_by_name(confidence):
    with pytest.raises(TypeError, match="confidence must be a function of the label logits"):
        exit_engine()(TOKENS, confidence=confidence)


@pytest.mark.parametrize(
    ("function", "error", "words"),
    [
        (lambda logits: logits[..., :2], ValueError, r"confidence\(logits\) must return a tensor \[B, N\] = \(2, 4\)"),
        (lambda logits: [1.0], TypeError, r"confidence\(logits\) must return a floating tensor"),
        (lambda logits: logits.argmax(-1), TypeError, r"confidence\(logits\) must return a floating tensor"),
        (lambda logits: logits.sum(-1) * float("nan"), ValueError, r"confidence\(logits\) contains NaN"),
    ],
)
def test_a_confidence_function_with_a_bad_answer_is_refused_by_name(function, error, words):
    with pytest.raises(error, match=words):
        exit_engine()(TOKENS, confidence=function)


def test_a_good_confidence_and_false_still_run():
    engine = exit_engine()
    confident = engine(TOKENS, confidence=lambda logits: torch.ones(logits.shape[:2]))
    assert (confident.halting["updates"] == 1).all()
    every = engine(TOKENS, confidence=False)
    assert every.halting is None or (every.halting["updates"] == 3).all()
