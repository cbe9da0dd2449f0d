"""μP's factors (``inference.MupScales``) are finite positive numbers, and the engine takes
them only as a ``MupScales``: a bad one is refused by name where it is made or passed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import graphs
import inference
from inference import MupScales

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = ("temperature", "attention", "ternary_message", "topic_message", "topic_logits")


@given(field=st.sampled_from(FIELDS), value=st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf]))
def test_a_factor_that_is_not_finite_and_positive_is_refused_by_name(field, value):
    values = dict.fromkeys(FIELDS, 1.0) | {field: value}
    with pytest.raises(ValueError, match=rf"MupScales.{field} must be a finite number > 0"):
        MupScales(**values)


@given(field=st.sampled_from(FIELDS), value=st.sampled_from(["1", True, None, [1.0]]))
def test_a_factor_that_is_not_a_number_is_refused_by_name(field, value):
    values = dict.fromkeys(FIELDS, 1.0) | {field: value}
    with pytest.raises(TypeError, match=rf"MupScales.{field} must be a real number"):
        MupScales(**values)


@pytest.mark.parametrize(
    ("arguments", "error", "words"),
    [
        ((3, 0, 0), ValueError, "rank must be a finite number > 0"),  # was ZeroDivisionError
        ((0, 2, 0), ValueError, "labels must be a finite number > 0"),  # was all-zero factors
        ((-3, 2, 0), ValueError, "labels must be a finite number > 0"),  # was negative factors
        ((4, 2, -1), ValueError, "global_labels must be a finite number >= 0"),
        (("4", 2, 0), TypeError, "labels must be a real number"),
    ],
)
def test_at_refuses_sizes_that_are_not_positive_by_name(arguments, error, words):
    with pytest.raises(error, match=words):
        MupScales.at(*arguments)


def test_relative_to_needs_a_mupscales():
    with pytest.raises(TypeError, match="base must be a MupScales, got int"):
        MupScales.at(4, 2, 0).relative_to(5)  # was AttributeError


@pytest.mark.parametrize("value", [5, {"temperature": 1.0}, "reconstruction"])
def test_the_engine_refuses_mup_scales_that_are_not_a_mupscales(value):
    """They failed at the first forward with an AttributeError (``'int' object has no
    attribute 'ternary_message'``)."""
    crf = graphs.CRF(vocab_size=7, labels=3, channels=2, rank=2)
    with pytest.raises(TypeError, match="mup_scales must be an inference.MupScales or None"):
        inference.MeanField(crf, mup=True, mup_scales=value)


def test_fractional_base_widths_still_give_scales():
    scales = MupScales.at(4, 2, 0).relative_to(MupScales.at(0.5, 0.25, 0.125))
    assert scales.temperature == 1.0 and scales.ternary_message == 8.0


def test_numpy_numbers_are_real_numbers_and_numpy_bools_are_not():
    import numpy as np

    assert inference.MupScales.at(np.int64(8), np.float32(2.0)) == inference.MupScales.at(8, 2.0)
    with pytest.raises(TypeError, match="labels must be a real number"):
        inference.MupScales.at(np.bool_(True), 2)
