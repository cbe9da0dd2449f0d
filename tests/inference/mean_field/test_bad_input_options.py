"""Bad settings of a ``MeanField`` are refused by name when the engine is built: nothing is
read as something else (a switch given as text, a number given as a bool)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference

pytestmark = pytest.mark.usefixtures("one_thread")


def small_crf() -> graphs.CRF:
    return graphs.CRF(vocab_size=7, labels=3, channels=2, rank=2)


not_a_bool = st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False), st.just("false"))


@settings(max_examples=30, deadline=None)
@given(flag=st.sampled_from(["mup", "span"]), value=not_a_bool)
def test_a_switch_that_is_not_a_bool_is_refused_by_name(flag, value):
    """``bool("false")`` is True: a switch given as text, a number or None would turn μP or
    the adaptive span on or off silently."""
    with pytest.raises(TypeError, match=rf"{flag} must be True or False \(a bool\)"):
        inference.MeanField(small_crf(), **{flag: value})


def test_the_switches_as_bools_are_taken():
    engine = inference.MeanField(small_crf(), mup=True, span=True)
    assert engine.options.mup is True and engine.options.adaptive_span is True


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"halting": "exit", "exit_threshold": True}, TypeError, "exit_threshold must be a real number"),
        ({"halting": "act", "act_epsilon": "0.5"}, TypeError, "act_epsilon must be a real number"),
        ({"halting": "act", "act_epsilon": None}, TypeError, "act_epsilon must be a real number"),
        ({"span": True, "span_max": "64"}, ValueError, "span_max must be an integer >= 1"),
        ({"span": True, "span_max": True}, ValueError, "span_max must be an integer >= 1"),
        ({"span": True, "span_ramp": 2.5}, ValueError, "span_ramp must be an integer >= 1"),
        ({"span": True, "span_ramp": 0}, ValueError, "span_ramp must be an integer >= 1"),
        ({"span": True, "span_max": 2**40}, ValueError, "span_max must be an integer >= 1 and <= 1048576"),
    ],
)
def test_halting_and_span_numbers_of_a_wrong_type_are_refused_by_name(options, error, words):
    """True was taken as an exit threshold of 1 and 2.5 as a ramp; text failed in a comparison
    with Python's own words, naming no argument."""
    with pytest.raises(error, match=words):
        inference.MeanField(small_crf(), **options)


@pytest.mark.parametrize("crf", [5, None, "crf", graphs.factors.Pairwise(3)])
def test_an_engine_on_something_other_than_a_crf_is_refused_by_name(crf):
    """It failed with an AttributeError (``'int' object has no attribute 'labels'``)."""
    with pytest.raises(TypeError, match="crf must be a graphs.CRF, got"):
        inference.MeanField(crf)


def test_numpy_switches_and_numbers_are_taken():
    import numpy as np

    crf = graphs.CRF(vocab_size=10, labels=4, channels=1, rank=2)
    engine = inference.MeanField(crf, halting="exit", exit_threshold=np.float32(0.5), mup=np.bool_(True))
    assert engine.mup and engine.exit_threshold == 0.5
    with pytest.raises(TypeError, match="exit_threshold must be a real number"):
        inference.MeanField(crf, halting="exit", exit_threshold=np.bool_(True))
