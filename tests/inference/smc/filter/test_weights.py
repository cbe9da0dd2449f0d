"""Weights at their edges: a filter whose weights go NaN reports NaN evidence and leaves the
batch's other filters untouched; particles of zero weight are never resampled and report
-inf, and a filter with no weight left is refused; the evidence gradient beside a bad
filter equals its finite difference; half-precision particles keep float32 weights."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from inference import SMC


def test_unvalidated_bad_filter_reports_nan_evidence_and_the_others_are_untouched():
    """A filter whose weights go NaN gets log-evidence NaN (never a number); the other
    filters of the batch equal a run without it."""

    def run(poison):
        g = torch.Generator().manual_seed(0)

        def step(t, x):
            increment = -0.5 * x**2
            if poison and t == 2:
                increment = increment.clone()
                increment[1, 3] = math.nan
            return x + torch.randn(x.shape, generator=g), increment

        return SMC(8, generator=g, validate=False).filter(lambda B: torch.randn(B, 8, generator=g), step, 5, 3)

    clean, poisoned = run(False), run(True)
    assert torch.isnan(poisoned.log_evidence[1]) and not torch.isnan(clean.log_evidence).any()
    torch.testing.assert_close(poisoned.log_evidence[[0, 2]], clean.log_evidence[[0, 2]])

    def poisoned_step(t, x):
        increment = torch.zeros(3, 8)
        if t == 2:
            increment[1, 3] = math.nan
        return x, increment

    with pytest.raises(ValueError, match=r"NaN .*: first at step 2, in filters \[1\]"):
        SMC(8).filter(lambda B: torch.zeros(B, 8), poisoned_step, 4, 3)


# ---- zero weight -----------------------------------------------------------------------


def test_particles_of_zero_weight_are_never_resampled_and_report_minus_infinity():
    """Half the particles get a -inf increment: the evidence is log(1/2) exactly, the
    survivors share the weight, and no ancestor is a dead particle."""
    N, B = 8, 64
    dead = torch.arange(N) % 2 == 1
    increment = torch.where(dead, -math.inf, 0.0).expand(B, N)

    def step(t, x):
        return x, increment if t == 0 else torch.zeros(B, N)

    g = torch.Generator().manual_seed(0)
    result = SMC(N, ess_threshold=1.0, generator=g).filter(lambda B: torch.arange(N).expand(B, N), step, 1, B)
    torch.testing.assert_close(result.log_evidence, torch.full((B,), math.log(0.5)))
    assert not dead[result.ancestors[0]].any() and not dead[result.particles].any()
    never = SMC(N, ess_threshold=0.0).filter(lambda B: torch.zeros(B, N), step, 2, B)
    assert torch.isneginf(never.log_weights[:, dead]).all()
    torch.testing.assert_close(never.log_weights[:, ~dead], torch.full((B, N // 2), -math.log(N // 2)))


def test_every_living_particle_killed_is_zero_weight_even_after_earlier_deaths():
    """Particles already at zero weight must not come back when every living one gets a
    -inf increment: the filter has no weight left."""

    def step(t, x):
        increment = torch.zeros(2, 4)
        increment[:, :2] = -math.inf  # step 0: particles 0, 1 die
        if t == 1:
            increment[1] = torch.tensor([0.0, 0.0, -math.inf, -math.inf])  # filter 1: 2, 3 die too
        return x, increment

    with pytest.raises(ValueError, match=r"every particle has zero weight.*first at step 1, in filters \[1\]"):
        SMC(4, ess_threshold=0.0).filter(lambda B: torch.zeros(B, 4), step, 3, 2)
    result = SMC(4, ess_threshold=0.0, validate=False).filter(lambda B: torch.zeros(B, 4), step, 3, 2)
    assert torch.isnan(result.log_evidence[1]) and result.log_evidence[0].item() == pytest.approx(math.log(0.5))


@pytest.mark.parametrize("relaxation", [None, "gumbel-softmax"])
def test_evidence_gradient_equals_its_finite_difference_beside_a_bad_filter(relaxation):
    """Gradients through hard or Gumbel-softmax resampling decided per step, with one filter
    gone bad (validate=False): the good filters' evidence gradient is finite and equals a
    central difference under the same generator (hard resampling choices do not move for a
    small step; the soft mixture is differentiable). Backward used to fail with hard
    resampling: the saved gather index was a view of the ancestors record that later steps
    write. (Straight-through's gradient is a surrogate, not the forward's derivative.)"""

    def evidence(theta):
        g = torch.Generator().manual_seed(0)

        def step(t, x):
            x = x + theta
            increment = -0.5 * (x - 1.0) ** 2
            if t == 2:
                increment = increment.clone()
                increment[1, 3] = math.nan
            return x, increment

        smc = SMC(8, ess_threshold=0.9, relaxation=relaxation, generator=g, validate=False)
        init = lambda B: torch.randn(B, 8, generator=g, dtype=torch.float64)  # noqa: E731
        result = smc.filter(init, step, 5, 3)
        assert torch.isnan(result.log_evidence[1]) and result.resampled.any() and not result.resampled.all()
        return result.log_evidence[[0, 2]].sum()

    theta = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    evidence(theta).backward()
    eps = 1e-6
    with torch.no_grad():
        difference = (evidence(theta + eps) - evidence(theta - eps)) / (2 * eps)
    assert torch.isfinite(theta.grad)
    torch.testing.assert_close(theta.grad, difference, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@given(log_weight=st.floats(-12.0, -0.5), n=st.integers(2, 200))
def test_half_precision_particles_keep_their_weights_in_float32(dtype, log_weight, n):
    """One particle at weight 1, the others at exp(log_weight): evidence and ESS written here.
    float16 weights would flush relative weights under about e^-4.85 to 0."""
    increment = torch.full((1, n), log_weight)
    increment[0, 0] = 0.0
    weights = increment.double().exp()
    exact_log_z = (weights.sum() / n).log().item()
    exact_ess = (weights.sum() ** 2 / weights.square().sum()).item()
    result = SMC(num_particles=n, ess_threshold=0.0).filter(
        lambda B: torch.zeros(B, n, 1, dtype=dtype), lambda t, x: (x, increment.to(dtype)), num_steps=1
    )
    assert result.log_weights.dtype == torch.float32 and result.log_evidence.dtype == torch.float32
    tolerance = 1e-2 * abs(log_weight)  # the increments themselves are rounded to the half type
    assert abs(result.log_evidence.item() - exact_log_z) < tolerance
    assert result.ess[0, 0].item() == pytest.approx(exact_ess, rel=5e-2)
