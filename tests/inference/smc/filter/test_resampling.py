"""Resampling inside the filter: it triggers exactly below the ESS threshold; relaxed
(Gumbel-softmax, straight-through) resampling passes finite gradients and the soft one
approaches the hard one as the temperature falls; not recording the ancestors changes no
other output and no gradient."""

import math

import pytest
import torch

from inference import SMC
from tests.builders import lgssm
from tests.inference.smc.filter.bootstrap import bootstrap

# ---- resampling inside the filter --------------------------------------------------


def test_resampling_triggers_exactly_below_the_threshold():
    N = 8
    log_w = torch.log(torch.tensor([[0.93] + [0.01] * 7, [1 / 8] * 8], dtype=torch.float64))

    def step(t, x):
        return x, log_w

    result = SMC(N, ess_threshold=0.5).filter(lambda B: torch.zeros(B, N), step, num_steps=1, batch_size=2)
    ess = result.ess[0]
    assert result.resampled[0].tolist() == [bool(ess[0] < 4), bool(ess[1] < 4)] == [True, False]
    assert torch.allclose(result.log_weights[0], torch.full((N,), -math.log(N), dtype=torch.float64))
    always = SMC(N, ess_threshold=1.0).filter(lambda B: torch.zeros(B, N), step, num_steps=1, batch_size=2)
    assert always.resampled.all()


# ---- relaxations -------------------------------------------------------------------


@pytest.mark.parametrize("relaxation", ["gumbel-softmax", "straight-through"])
def test_relaxed_resampling_passes_finite_gradients(relaxation):
    N = 16
    theta = torch.tensor(0.7, requires_grad=True)
    g = torch.Generator().manual_seed(0)

    def step(t, x):
        x = x + theta
        return x, -0.5 * (x - 1.0) ** 2

    result = SMC(N, ess_threshold=1.0, relaxation=relaxation, temperature=0.5, generator=g).filter(
        lambda B: torch.randn(B, N, generator=g), step, num_steps=3, batch_size=2
    )
    loss = (result.log_weights.exp() * result.particles).sum()
    loss.backward()
    assert torch.isfinite(theta.grad) and theta.grad != 0


def test_soft_resampling_approaches_hard_as_temperature_falls():
    N = 32
    x0 = torch.randn(1, N, generator=torch.Generator().manual_seed(5))
    log_w = torch.randn(1, N, generator=torch.Generator().manual_seed(6))

    def run(relaxation, tau):
        g = torch.Generator().manual_seed(7)
        smc = SMC(N, ess_threshold=1.0, relaxation=relaxation, temperature=tau, generator=g)
        return smc.filter(lambda B: x0.clone(), lambda t, x: (x, log_w), num_steps=1).particles

    hard = run("straight-through", 1.0)
    errors = [(run("gumbel-softmax", tau) - hard).abs().max().item() for tau in (1.0, 0.1, 0.001)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-3


@pytest.mark.parametrize(
    "resample,relaxation", [("systematic", None), ("multinomial", None), ("systematic", "gumbel-softmax")]
)
def test_unrecorded_ancestors_change_nothing_else(resample, relaxation):
    """record_ancestors=False: the same run (the same draws from the generator) in every
    other output, and the same evidence gradient (autograd saves the gather index of each
    step, which a shared ancestors buffer overwrites)."""
    ys, A, Q, H, R, m0, P0 = lgssm(1, seed=3, steps=8)

    def run(record, theta):
        g = torch.Generator().manual_seed(2)
        init, step = bootstrap(ys, A, Q, H, R, m0, P0, 32, g)
        shifted = lambda t, x: step(t, x + theta)  # noqa: E731
        smc = SMC(32, resample=resample, relaxation=relaxation, ess_threshold=0.5, generator=g, record_ancestors=record)
        return smc.filter(init, shifted, num_steps=8, batch_size=4)

    theta = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    recorded, unrecorded = run(True, theta), run(False, theta)
    assert unrecorded.ancestors is None and recorded.ancestors.shape == (8, 4, 32)
    assert recorded.resampled.any() and not recorded.resampled.all()
    for name in ("log_evidence", "log_weights", "particles", "ess", "resampled"):
        torch.testing.assert_close(getattr(unrecorded, name), getattr(recorded, name), rtol=0, atol=0)
    (gradient,) = torch.autograd.grad(recorded.log_evidence.sum(), theta)
    (unrecorded_gradient,) = torch.autograd.grad(unrecorded.log_evidence.sum(), theta)
    assert torch.isfinite(gradient) and gradient.item() == unrecorded_gradient.item()
