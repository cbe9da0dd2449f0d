"""The SMC filter (inference.smc.filter) against the Kalman filter (tests/oracles.py):
log-evidence and filtering means, resampling thresholds, relaxed and soft resampling, no host
read per step, zero-weight particles and bad filters, and refusals."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from inference import SMC
from inference.smc.filter import RESAMPLERS
from tests.builders import lgssm
from tests.oracles import kalman

# ---- an exact oracle: the Kalman filter -----------------------------------------------


def bootstrap(ys, A, Q, H, R, m0, P0, N, generator, means=None):
    """init/step callables of the bootstrap filter for the LGSSM."""
    dim = len(m0)
    q, r = torch.linalg.cholesky(Q), torch.distributions.MultivariateNormal(torch.zeros(dim, dtype=R.dtype), R)

    def init(B):
        return m0 + torch.randn(B, N, dim, generator=generator, dtype=torch.float64) @ torch.linalg.cholesky(P0).T

    def step(t, x):
        x = x @ A.T + torch.randn(x.shape, generator=generator, dtype=torch.float64) @ q.T
        increment = r.log_prob(ys[t] - x @ H.T)
        if means is not None:
            means.append(x)
        return x, increment

    return init, step


@pytest.mark.parametrize("dim", [1, 4])
def test_log_evidence_and_filtering_means_match_the_kalman_filter(dim):
    ys, A, Q, H, R, m0, P0 = lgssm(dim)
    exact_means, exact_log_z = kalman(ys, A, Q, H, R, m0, P0)
    seeds, N = 24, 1000
    g = torch.Generator().manual_seed(0)
    smc = SMC(N, resample="systematic", ess_threshold=0.5, generator=g)
    states = []
    result = smc.filter(*bootstrap(ys, A, Q, H, R, m0, P0, N, g, states), num_steps=len(ys), batch_size=seeds)
    estimates = result.log_evidence  # one independent filter per seed
    # Z-hat is unbiased, log Z-hat is not: asymptotically normal with mean log Z - var / 2 (at
    # dim 4 the bias, ~0.6, is about 3 standard errors of the mean). The estimate of log Z
    # is mean + var / 2, with the standard error of both terms (var of a sample variance:
    # 2 var^2 / (n - 1) for normal samples)
    variance = estimates.var()
    corrected = estimates.mean() + variance / 2
    se = torch.sqrt(variance / seeds + variance**2 / (2 * (seeds - 1)))
    assert abs(corrected.item() - exact_log_z) < 3 * se.item() + 1e-3, (corrected, se, exact_log_z)
    # filtering mean at the last step: weighted particle mean, averaged over the seeds
    weights = result.log_weights.exp()
    final = (weights[..., None] * result.particles).sum(1)  # [seeds, dim]
    mean_se = final.std(0) / math.sqrt(seeds)
    assert ((final.mean(0) - exact_means[-1]).abs() < 3 * mean_se + 1e-3).all()
    assert result.ess.shape == (len(ys), seeds) and result.ancestors.shape == (len(ys), seeds, N)


def test_log_evidence_error_shrinks_with_more_particles():
    ys, A, Q, H, R, m0, P0 = lgssm(1, seed=1)
    _, exact_log_z = kalman(ys, A, Q, H, R, m0, P0)
    errors = {}
    for N in (100, 10_000):
        g = torch.Generator().manual_seed(1)
        result = SMC(N, generator=g).filter(*bootstrap(ys, A, Q, H, R, m0, P0, N, g), num_steps=len(ys), batch_size=8)
        errors[N] = (result.log_evidence - exact_log_z).abs().mean().item()
    assert errors[10_000] < errors[100] / 3, errors


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


# ---- bad input ---------------------------------------------------------------------


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


def test_compiled_filter_equals_eager_under_a_fixed_generator():
    ys, A, Q, H, R, m0, P0 = lgssm(1, seed=5, steps=6)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        result = SMC(64, generator=g).filter(*bootstrap(ys, A, Q, H, R, m0, P0, 64, g), num_steps=6, batch_size=3)
        return result.log_evidence, result.particles

    compiled = torch.compile(run)
    (eager_z, eager_x), (compiled_z, compiled_x) = run(11), compiled(11)
    torch.testing.assert_close(compiled_z, eager_z)
    torch.testing.assert_close(compiled_x, eager_x)


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on every operator that reads a tensor's value on the host (.item(), bool(),
    .tolist() of a device tensor): on CUDA each is a synchronisation."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise AssertionError(f"host synchronisation: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", RESAMPLERS)
def test_filter_reads_nothing_on_the_host_per_step(method, monkeypatch):
    """no host sync in a filter step. With validate=False a run reads nothing on
    the host; with validate=True it reads once, after the last step."""
    g = torch.Generator().manual_seed(0)
    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(self.shape)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)

    def init(B):
        return torch.randn(B, 16, generator=g)

    def step(t, x):
        x = 0.9 * x + torch.randn(x.shape, generator=g)
        return x, -0.5 * (x - 1.0) ** 2

    with _NoHostSync():
        result = SMC(16, resample=method, ess_threshold=0.9, generator=g, validate=False).filter(init, step, 6, 3)
    assert reads == [] and bool(result.resampled.any())  # it did resample (read outside the mode)
    with _NoHostSync():
        SMC(16, resample=method, ess_threshold=0.9, generator=g).filter(init, step, 6, 3)
    assert len(reads) == 1


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
