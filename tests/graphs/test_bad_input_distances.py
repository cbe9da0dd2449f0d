"""``graphs.distance_groups`` and the CRF methods built on it (``distance_groups``,
``ternary_table``) take a sentence length n >= 1, a gamma >= 0 and a number of virtual nodes
>= 0, refused by name otherwise: a negative n failed inside torch.arange, 2.5 gave float
groups, 0 an empty table, a negative count of virtual nodes cropped the table and a huge n
was allocated."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import graphs
from graphs.limits import MAX_NODES

bad_lengths = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=MAX_NODES + 1, max_value=2**62),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
)


@given(n=bad_lengths)
def test_a_bad_sentence_length_is_refused_by_name(n):
    with pytest.raises(ValueError, match="sentence length n"):
        graphs.distance_groups(n, 3)


@given(n=bad_lengths)
def test_the_crf_methods_refuse_a_bad_length_by_name(n):
    crf = graphs.CRF(vocab_size=5, labels=2)
    with pytest.raises(ValueError, match="sentence length n"):
        crf.distance_groups(n)
    with pytest.raises(ValueError, match="sentence length n"):
        crf.ternary_table(n)


@pytest.mark.parametrize(("gamma", "error"), [(-1, ValueError), (2.5, TypeError), (True, TypeError), ("3", TypeError)])
def test_a_bad_gamma_is_refused_by_name(gamma, error):
    """gamma=-1 gave negative groups, which index a ternary table from its end."""
    with pytest.raises(error, match="gamma must be an integer >= 0"):
        graphs.distance_groups(4, gamma)


@pytest.mark.parametrize("extra_nodes", [-1, 1.5, True])
def test_a_bad_count_of_virtual_nodes_is_refused_by_name(extra_nodes):
    with pytest.raises(ValueError, match="extra_nodes"):
        graphs.distance_groups(4, 2, extra_nodes=extra_nodes)


@given(n=st.integers(1, 40), gamma=st.integers(0, 6), extra=st.integers(0, 3))
def test_good_arguments_give_the_table_with_groups_in_range(n, gamma, extra):
    groups = graphs.distance_groups(n, gamma, extra)
    assert groups.shape == (n + extra, n + extra)
    assert groups.min() >= 0 and groups.max() <= 2 * (gamma + 1)


def test_numpy_integers_are_integers():
    """A size computed with numpy (np.int64) is an integer, as before the checks: the same table."""
    import numpy as np
    import torch

    expected = graphs.distance_groups(5, 2, extra_nodes=1)
    assert torch.equal(graphs.distance_groups(np.int64(5), np.int32(2), extra_nodes=np.int64(1)), expected)
    with pytest.raises((TypeError, ValueError), match="gamma"):
        graphs.distance_groups(5, np.bool_(True))
