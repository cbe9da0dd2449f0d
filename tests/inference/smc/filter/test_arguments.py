"""Bad input to the filter is refused: bad, absurd or non-finite constructor arguments
(the limits themselves are accepted), absurd step and batch counts before anything is
allocated, and weights that are all -inf or NaN."""

import math

import pytest
import torch

from inference import SMC


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_particles=0), "num_particles must be an integer >= 1"),
        (dict(num_particles=4, resample="best"), "unknown resampler 'best'"),
        (dict(num_particles=4, ess_threshold=1.5), "ess_threshold"),
        (dict(num_particles=4, relaxation="soft"), "unknown relaxation"),
        (dict(num_particles=4, temperature=0.0), "temperature"),
        (dict(num_particles=4, record_ancestors=1), "record_ancestors must be True or False"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SMC(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_particles=10**12), r"num_particles must be an integer >= 1 and <= 16777216 \(the limit\)"),
        (dict(num_particles=2**24 + 1), r"num_particles .* <= 16777216"),
        (dict(num_particles="4"), "num_particles"),
        (dict(num_particles=4, temperature=math.inf), r"temperature must be a finite number in \[1e-06, 1e\+06\]"),
        (dict(num_particles=4, temperature=math.nan), "temperature must be a finite number"),
        (dict(num_particles=4, temperature=-1.0), "temperature must be a finite number"),
        (dict(num_particles=4, temperature=1e-300), "temperature must be a finite number"),
        (dict(num_particles=4, temperature="1"), "temperature must be a finite number"),
        (dict(num_particles=4, temperature=None), "temperature must be a finite number"),
        (dict(num_particles=4, ess_threshold=math.nan), r"ess_threshold must be a number in \[0, 1\]"),
        (dict(num_particles=4, ess_threshold="0.5"), "ess_threshold must be a number"),
        (dict(num_particles=4, resample=["systematic"]), "unknown resampler"),
        (dict(num_particles=4, relaxation=["soft"]), "unknown relaxation"),
        (dict(num_particles=4, generator=17), "generator must be a torch.Generator or None"),
    ],
)
def test_absurd_or_non_finite_arguments_are_refused(kwargs, match):
    # SMC(10**12) and temperature=inf were accepted (the latter gave NaN particles)
    with pytest.raises(ValueError, match=match):
        SMC(**kwargs)


def test_the_limits_themselves_are_accepted():
    smc = SMC(2**24, temperature=1e-6)
    assert smc.num_particles == 2**24 and SMC(4, temperature=1e6).temperature == 1e6


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda smc, init, step: smc.filter(init, step, 10**12),
            r"num_steps must be an integer >= 0 and <= 2147483648",
        ),
        (lambda smc, init, step: smc.filter(init, step, 3, batch_size=0), r"batch_size must be an integer >= 1"),
        (lambda smc, init, step: smc.filter(init, step, 3, batch_size="2"), r"batch_size must be an integer"),
        (lambda smc, init, step: smc.filter(init, step, 3, batch_size=2**23), r"batch_size x num_particles"),
    ],
)
def test_filter_refuses_absurd_steps_and_batches_before_running(call, match):
    calls = []

    def init(batch):
        calls.append(batch)
        return torch.zeros(batch, 2**9)

    def step(t, particles):
        return particles, torch.zeros_like(particles)

    with pytest.raises(ValueError, match=match):
        call(SMC(2**9), init, step)
    assert calls == []  # refused before init allocated anything


@pytest.mark.parametrize(
    "increment,match",
    [(torch.full((1, 4), -math.inf), "all log-weights -inf"), (torch.tensor([[0.0, math.nan, 0.0, 0.0]]), "NaN")],
)
def test_degenerate_weights_raise(increment, match):
    with pytest.raises(ValueError, match=match):
        SMC(4).filter(lambda B: torch.zeros(B, 4), lambda t, x: (x, increment), num_steps=1)
