"""The parts of a filter step against numpy: weighing (``LogWeights``), the records and the
log-evidence read off them (``Trace``), the decision, and the restart after resampling; and
the resampling of tempered SMC's particle systems (``Systems.resample``) on weights whose
answer is certain."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference import SMC
from inference.smc.filter_state import LogWeights, Trace
from inference.smc.resamplers import RESAMPLERS
from inference.smc.tempered.tempering import Systems

pytestmark = pytest.mark.usefixtures("one_thread")


def oracle(increments: np.ndarray, pattern: np.ndarray):
    """Sequential importance sampling with resets, in numpy float64: ``(log Z [B], ESS [T, B],
    final normalised log-weights [B, N], d log Z / d increments [T, B, N])``. ``pattern [T, B]``
    says where a filter resamples (its weights become uniform after the step)."""
    T, B, N = increments.shape
    log_w = np.full((B, N), -math.log(N))
    log_z, ess, gradient = np.zeros(B), np.zeros((T, B)), np.zeros((T, B, N))
    segment_start = np.zeros(B, dtype=int)
    for t in range(T):
        joint = log_w + increments[t]
        total = np.log(np.exp(joint - joint.max(-1, keepdims=True)).sum(-1)) + joint.max(-1)
        log_z += total
        log_w = joint - total[:, None]
        ess[t] = 1 / np.exp(2 * log_w).sum(-1)
        for b in range(B):
            if pattern[t, b] or t == T - 1:  # log Z's segment ends: its increments' gradient is the weights now
                gradient[segment_start[b] : t + 1, b] = np.exp(log_w[b])
                segment_start[b] = t + 1
            if pattern[t, b]:
                log_w[b] = -math.log(N)
    return log_z, ess, log_w, gradient


def weigh_all(increments: torch.Tensor, pattern: torch.Tensor):
    """Drive ``LogWeights`` and ``Trace`` step by step as ``SMC`` does, resampling where
    ``pattern`` says."""
    T, B, N = increments.shape
    trace = Trace(T, B, N, increments.device, increments.dtype, "reuse")
    log_weights = LogWeights(B, N, increments.device, increments.dtype, systematic=False)
    for t in range(T):
        log_weights.weigh(increments[t], trace, t)
        chosen = pattern[t, :, None].to(increments.dtype)
        trace.choices.append(chosen)
        log_weights.restart(chosen)
    resampled = trace.resampled()
    log_evidence, normaliser = trace.log_evidence(resampled, validate=True)
    return log_evidence, trace.ess, log_weights.normalised(normaliser), resampled


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 8)),
    seed=st.integers(0, 2**16),
    grad=st.booleans(),
)
def test_weighing_and_the_evidence_match_sequential_importance_sampling(sizes, seed, grad):
    T, B, N = sizes
    rng = np.random.default_rng(seed)
    increments = rng.uniform(-30, 30, size=(T, B, N))
    pattern = rng.random((T, B)) < 0.5
    exact_log_z, exact_ess, exact_log_w, exact_gradient = oracle(increments, pattern)
    inputs = torch.tensor(increments, requires_grad=grad)  # with autograd: no step works in place
    log_evidence, ess, log_w, resampled = weigh_all(inputs, torch.tensor(pattern))
    np.testing.assert_allclose(log_evidence.detach().numpy(), exact_log_z, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(ess.numpy(), exact_ess, rtol=1e-10)
    np.testing.assert_allclose(log_w.detach().numpy(), exact_log_w, rtol=1e-12, atol=1e-10)
    assert np.array_equal(resampled.numpy(), pattern)
    if grad:
        (gradient,) = torch.autograd.grad(log_evidence.sum(), inputs)
        np.testing.assert_allclose(gradient.numpy(), exact_gradient, rtol=1e-10, atol=1e-12)


def test_the_decision_compares_the_ess_with_the_threshold_times_n():
    ess = torch.tensor([[1.0], [4.9], [5.0], [10.0]], dtype=torch.float64)
    chosen = SMC(10, ess_threshold=0.5)._decide(ess, None)
    assert chosen.dtype == torch.float64
    assert chosen.flatten().tolist() == [1.0, 1.0, 0.0, 0.0]  # ESS / N < 0.5


def test_zero_weight_everywhere_is_reported_with_its_step_and_filter():
    increments = torch.zeros(3, 2, 4, dtype=torch.float64)
    increments[1, 1] = -math.inf
    with pytest.raises(ValueError, match=r"every particle has zero weight.*first at step 1, in filters \[1\]"):
        weigh_all(increments, torch.zeros(3, 2, dtype=torch.bool))


def systems(log_w: torch.Tensor) -> Systems:
    """Systems ``[S, P]`` whose labels and heads name their particle (particle p is all p)."""
    S, P = log_w.shape
    z = torch.arange(P)[None, :, None].expand(S, P, 3).clone()
    h = torch.arange(P)[None, :, None, None].expand(S, P, 2, 3).clone()
    zeros = torch.zeros(S, P, dtype=log_w.dtype)
    beta = torch.full((S,), 0.5, dtype=log_w.dtype)
    return Systems(z, h, None, zeros, zeros, zeros, None, log_w, torch.zeros(S, dtype=log_w.dtype), beta)


@pytest.mark.parametrize("method", RESAMPLERS)
def test_systems_resample_below_the_threshold_only(method):
    P = 6
    uniform = torch.full((P,), -math.log(P), dtype=torch.float64)
    one_heavy = torch.full((P,), -1e4, dtype=torch.float64)  # exp underflows to exactly 0
    one_heavy[4] = 0.0
    state = systems(torch.stack([uniform, one_heavy]))
    ess = torch.reciprocal((2 * state.log_w).exp().sum(-1))  # [S]: P and 1
    state.resample(ess, P / 2, method, torch.Generator().manual_seed(0))
    # the uniform system keeps every particle and weight; the other holds particle 4 alone
    assert torch.equal(state.z[0], torch.arange(P)[:, None].expand(P, 3))
    assert torch.equal(state.log_w[0], uniform)
    assert (state.z[1] == 4).all() and (state.h[1] == 4).all()
    assert torch.equal(state.log_w[1], torch.full((P,), -math.log(P), dtype=torch.float64))
