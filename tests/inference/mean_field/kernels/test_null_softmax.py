"""The null softmax (inference.mean_field.kernels.null_softmax) equals a softmax over an
explicit null column, in values and gradients of any subset of its outputs (float64)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.builders import assert_grads_close as _assert_grads_close
from tests.builders import assert_outputs_close as _assert_outputs_close
from tests.builders import weighted_loss as _weighted_loss
from tests.oracles import explicit_null_softmax as _explicit_null_softmax
from tests.strategies import HEAD_PROBLEMS

pytestmark = pytest.mark.usefixtures("keep_global_rng")


# random head-logit problems: sentences of n nodes, logits up to ~scale, a share of illegal arcs


@settings(max_examples=60, deadline=None)
@given(**HEAD_PROBLEMS, outputs=st.sets(st.sampled_from(["probs", "lse"]), min_size=1))
def test_null_softmax_equals_a_softmax_over_an_explicit_null_column(seed, n, scale, illegal, outputs):
    """The naive kernel's head distribution (the null logit 0 never materialised, backward
    written out) against the definition; values and gradients of either output, float64."""
    from inference.mean_field.kernels.null_softmax import softmax_with_null

    generator = torch.Generator().manual_seed(seed)
    B, C = 2, 3
    logits = scale * torch.randn(B, C, n, n, generator=generator, dtype=torch.float64)
    legal = torch.rand(B, 1, n, n, generator=generator) >= illegal
    has_head = legal[:, 0].any(-1)
    logits = logits.masked_fill(~legal, -math.inf)
    names = ["probs", "lse"]
    weights = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in [(B, C, n, n), (B, C, n)]]
    true_logits, mine = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    expected = _explicit_null_softmax(true_logits, has_head)
    _weighted_loss(expected, names, weights, outputs).backward()
    results = softmax_with_null(mine, has_head)
    _weighted_loss(results, names, weights, outputs).backward()
    _assert_outputs_close(results, expected, rtol=1e-12, atol=1e-13)
    _assert_grads_close([mine], [true_logits], rtol=1e-9, atol=1e-12)
    with torch.no_grad():  # the no-grad path is the same forward
        _assert_outputs_close(softmax_with_null(logits, has_head), expected, rtol=1e-12, atol=1e-13)
