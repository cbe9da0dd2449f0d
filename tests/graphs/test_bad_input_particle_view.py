"""``ParticleView.init`` (and its bootstrap guide's) checks the embeddings it starts from:
a wrong width, rank, dtype, emptiness, NaN or a numpy array were taken silently (NaN
particles, or a bare matmul error at the first step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs

WIDTH = 4


@pytest.mark.parametrize(
    ("embeddings", "error", "words"),
    [
        (torch.ones(3, 5), ValueError, r"embeddings must have shape \[n, 4\] or \[B, n, 4\] \(width\)"),
        (torch.ones(1, 2, 3, 4), ValueError, r"embeddings must have shape"),
        (torch.ones(4), ValueError, r"embeddings must have shape"),
        (torch.ones(0, 4), ValueError, r"non-empty"),
        (torch.ones(2, 0, 4), ValueError, r"non-empty"),
        (torch.ones(3, 4, dtype=torch.long), TypeError, r"floating torch.Tensor .* got torch.int64"),
        (np.zeros((3, 4)), TypeError, r"floating torch.Tensor .* got ndarray"),
        ([[0.0] * 4] * 3, TypeError, r"floating torch.Tensor .* got list"),
    ],
)
def test_embeddings_of_a_wrong_type_or_shape_are_refused_by_name(embeddings, error, words):
    view = graphs.ParticleView(WIDTH)
    with pytest.raises(error, match=words):
        view.init({}, embeddings)
    with pytest.raises(error, match=words):
        view.bootstrap_guide().init({}, embeddings)


@given(
    value=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    where=st.tuples(st.integers(0, 1), st.integers(0, 2), st.integers(0, WIDTH - 1)),
)
def test_non_finite_embeddings_are_refused_by_name(value, where):
    embeddings = torch.zeros(2, 3, WIDTH)
    embeddings[where] = value
    with pytest.raises(ValueError, match=r"embeddings contains NaN or Inf"):
        graphs.ParticleView(WIDTH).init({}, embeddings)


def test_good_embeddings_start_the_particles():
    view, state = graphs.ParticleView(WIDTH), {}
    view.init(state, torch.ones(2, 3, WIDTH))
    assert state["x"].shape == (6, WIDTH) and view.num_tokens == 3
