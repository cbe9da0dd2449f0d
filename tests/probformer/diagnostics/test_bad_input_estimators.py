"""The estimators read real numbers: booleans (a torch or numpy bool array, a list of
bools) were taken as 0/1 weights, log-weights or hidden states; they are refused by name,
as complex numbers and text are."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from probformer import diagnostics

bool_lists = st.lists(st.booleans(), min_size=1, max_size=40)


def as_each_kind(values):
    return [torch.tensor(values), np.array(values), values]


@given(values=bool_lists)
def test_boolean_weights_are_refused_by_name(values):
    for weights in as_each_kind(values):
        with pytest.raises(TypeError, match=r"weights must hold real numbers, got dtype (torch\.)?bool"):
            diagnostics.ess(weights)
        with pytest.raises(TypeError, match=r"log_weights must hold real numbers, got dtype (torch\.)?bool"):
            diagnostics.ess(log_weights=weights)


@given(values=st.lists(st.booleans(), min_size=30, max_size=40))
def test_boolean_log_weights_for_pareto_k_are_refused_by_name(values):
    for log_weights in as_each_kind(values):
        with pytest.raises(TypeError, match=r"log_weights must hold real numbers"):
            diagnostics.pareto_k(log_weights)


def test_boolean_hidden_states_are_refused_by_name():
    with pytest.raises(TypeError, match=r"hidden must hold real numbers, got dtype torch.bool"):
        diagnostics.diversity(torch.ones(2, 5, 4, dtype=torch.bool))


def test_integer_and_floating_weights_are_still_read():
    assert float(diagnostics.ess(torch.tensor([1, 1, 1, 1]))) == pytest.approx(4.0)
    assert float(diagnostics.ess([1.0, 1.0])) == pytest.approx(2.0)
