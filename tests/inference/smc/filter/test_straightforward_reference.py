"""A whole run of the filter with systematic resampling against a straightforward particle
filter written here in float64 (normalised log-weights, ESS = 1 / sum w^2, a binary search
of the positions i + 1 - v): every output agrees, the ancestors and resampling choices
exactly, under the same generator (the reference draws what the filter draws, in its order:
the model's step, then one uniform offset v per filter)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference import SMC

pytestmark = pytest.mark.usefixtures("one_thread")


def model(batch: int, num_particles: int, num_steps: int, seed: int):
    """``(init, step, generator)`` of a 1-D linear-Gaussian model in float64, its observations
    drawn from ``seed``; init and step draw from the returned generator."""
    ys = torch.randn(batch, num_steps, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed + 1)

    def init(B):
        return torch.randn(B, num_particles, generator=generator, dtype=torch.float64)

    def step(t, x):
        x = 0.9 * x + 0.7 * torch.randn(x.shape, generator=generator, dtype=torch.float64)
        # log-weights stay far above the level the filter flushes to zero weight (exp(-354) in float64)
        return x, -0.5 * (ys[:, t, None] - x) ** 2

    return init, step, generator


def reference_filter(init, step, generator, batch: int, num_particles: int, num_steps: int, threshold: float):
    """The filter's outputs, computed one filter at a time, the obvious way."""
    B, N = batch, num_particles
    shift = 62 - (N + 1).bit_length()  # the filter draws v as an integer in units of 2**-shift
    x = init(B)
    log_w = torch.full((B, N), -math.log(N), dtype=torch.float64)  # normalised
    log_z = torch.zeros(B, dtype=torch.float64)
    ess = torch.zeros(num_steps, B, dtype=torch.float64)
    resampled = torch.zeros(num_steps, B, dtype=torch.bool)
    ancestors = torch.arange(N).repeat(num_steps, B, 1)
    for t in range(num_steps):
        x, increment = step(t, x)
        joint = log_w + increment
        total = torch.logsumexp(joint, -1)
        log_z += total
        log_w = joint - total[:, None]
        ess[t] = 1 / log_w.exp().square().sum(-1)
        if threshold == 0:
            continue
        v = torch.randint(2**shift, (B, 1), generator=generator).double() / 2**shift
        for b in range(B):
            if not (threshold == 1 or ess[t, b] < threshold * N):  # 1: always, ESS = N included
                continue
            resampled[t, b] = True
            cumulative = log_w[b].exp().cumsum(0)
            cumulative = cumulative / cumulative[-1]
            positions = (torch.arange(N, dtype=torch.float64) + 1 - v[b]) / N
            last_live = int(torch.nonzero(log_w[b] > -math.inf).max())
            ancestors[t, b] = torch.searchsorted(cumulative, positions).clamp(max=last_live)
            x[b] = x[b, ancestors[t, b]]
            log_w[b] = -math.log(N)
    return log_z, log_w, x, ess, ancestors, resampled


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.tuples(st.integers(1, 4), st.integers(1, 40), st.integers(1, 6)),
    threshold=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    record_ancestors=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_run_equals_a_straightforward_particle_filter(sizes, threshold, record_ancestors, seed):
    B, N, T = sizes
    init, step, generator = model(B, N, T, seed)
    smc = SMC(N, ess_threshold=threshold, generator=generator, record_ancestors=record_ancestors)
    result = smc.filter(init, step, num_steps=T, batch_size=B)
    init, step, generator = model(B, N, T, seed)
    log_z, log_w, x, ess, ancestors, resampled = reference_filter(init, step, generator, B, N, T, threshold)
    assert torch.equal(result.resampled, resampled)
    if record_ancestors or threshold == 0:
        assert torch.equal(result.ancestors, ancestors)
    else:
        assert result.ancestors is None
    assert torch.equal(result.particles, x)  # the same draws moved and gathered alike
    torch.testing.assert_close(result.ess, ess, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(result.log_evidence, log_z, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(result.log_weights, log_w, rtol=1e-10, atol=1e-10)
