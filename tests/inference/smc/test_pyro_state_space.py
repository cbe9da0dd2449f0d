"""Pyro models under SMC (inference.smc.pyro_state_space): the same model runs under Pyro's
SMCFilter and this engine, dict or tensor state, data broadcast over the batch, and a clear
error for an empty or non-tensor state."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference import SMC
from tests.builders import lgssm
from tests.oracles import kalman

# ---- an exact oracle: the Kalman filter -----------------------------------------------


class PyroLGSSM:
    """The 1-D LGSSM as a Pyro model object (SMCFilter's interface)."""

    def __init__(self, a, q, h, r):
        self.a, self.q, self.h, self.r = a, q, h, r

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(self.a * state["x"], self.q**0.5))
        pyro.sample("y", dist.Normal(self.h * state["x"], self.r**0.5), obs=y)


class PyroBootstrapGuide:
    """SMCFilter needs a guide: proposing from the transition makes it a bootstrap filter."""

    def __init__(self, a, q):
        self.a, self.q = a, q

    def init(self, state):
        pyro.sample("x_init", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))

    def step(self, state, y=None):
        pyro.sample("x", dist.Normal(self.a * state["x"], self.q**0.5))


def test_the_same_pyro_model_runs_under_smcfilter_and_this_engine():
    ys, A, Q, H, R, m0, P0 = lgssm(1, seed=2, steps=20)
    exact_means, exact_log_z = kalman(ys, A, Q, H, R, m0, P0)
    a, q, h, r = A.item(), Q.item(), H.item(), R.item()
    model = PyroLGSSM(a, q, h, r)
    seeds = 16
    g = torch.Generator().manual_seed(3)
    ours = SMC(2000, generator=g).filter(model, ys[:, 0].expand(seeds, -1), batch_size=seeds)
    our_means = (ours.log_weights.exp() * ours.particles["x"]).sum(1)
    se = our_means.std() / math.sqrt(seeds)
    assert abs(our_means.mean().item() - exact_means[-1].item()) < 3 * se.item() + 1e-3
    assert abs(ours.log_evidence.mean().item() - exact_log_z) < 3 * ours.log_evidence.std().item() / 4 + 1e-2

    pyro.set_rng_seed(0)
    theirs = []
    guide = PyroBootstrapGuide(a, q)
    for _ in range(seeds):
        smc = pyro.infer.SMCFilter(model, guide, num_particles=2000, max_plate_nesting=0)
        smc.init()
        for y in ys[:, 0]:
            smc.step(y)
        theirs.append(smc.get_empirical()["x"].mean)
    theirs = torch.stack(theirs)
    both_se = math.sqrt(se.item() ** 2 + (theirs.std().item() / math.sqrt(seeds)) ** 2)
    assert abs(theirs.mean().item() - our_means.mean().item()) < 3 * both_se + 1e-3


def test_a_single_pyro_filter_with_unbatched_data():
    ys = lgssm(1, seed=4, steps=5)[0][:, 0]
    result = SMC(50, generator=torch.Generator().manual_seed(0)).filter(PyroLGSSM(0.9, 0.5, 1.0, 0.3), ys)
    assert result.log_evidence.shape == (1,) and result.particles["x"].shape == (1, 50)


class RandomWalk:
    """A Pyro model object (SMCFilter's interface): x_t = x_{t-1} + noise, y_t ~ N(x_t, 1)."""

    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(state["x"], 0.5))
        pyro.sample("y", dist.Normal(state["x"], 1.0), obs=y)


def test_one_sequence_of_data_is_broadcast_to_every_filter():
    ys = torch.tensor([[0.3, -0.2, 0.5, 1.0]], dtype=torch.float64)  # [1, T]

    def run(data):
        torch.manual_seed(0)
        return SMC(64, generator=torch.Generator().manual_seed(1)).filter(RandomWalk(), data, batch_size=3)

    broadcast, explicit = run(ys), run(ys.expand(3, -1))
    assert broadcast.log_evidence.shape == (3,)
    torch.testing.assert_close(broadcast.log_evidence, explicit.log_evidence, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"data must have shape \[batch_size=3, T, ...\] or \[1, T, ...\]"):
        SMC(8).filter(RandomWalk(), torch.zeros(2, 4, dtype=torch.float64), batch_size=3)


def test_tensor_and_dict_states_give_the_same_filter():
    increments = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(2))

    def run(as_dict):
        def init(B):
            x = torch.zeros(B, 16)
            return {"x": x} if as_dict else x

        def step(t, particles):
            return particles, increments[t]

        return SMC(16, generator=torch.Generator().manual_seed(3)).filter(init, step, num_steps=5, batch_size=2)

    as_tensor, as_dict = run(False), run(True)
    torch.testing.assert_close(as_tensor.log_evidence, as_dict.log_evidence, rtol=0, atol=0)
    assert torch.equal(as_tensor.ancestors, as_dict.ancestors) and set(as_dict.particles) == {"x"}


@pytest.mark.parametrize(
    "state,error,match",
    [
        ({}, ValueError, "init returned an empty state"),
        ([1.0, 2.0], TypeError, r"init must return particles as a tensor \[B, N, ...\] or a dict of them"),
        ({"x": 3.0}, TypeError, r"init: state\['x'\] must be a tensor \[B, N, ...\], got float"),
        ({"x": torch.zeros(4)}, TypeError, r"state\['x'\] must be a tensor \[B, N, ...\]"),
    ],
)
def test_an_empty_or_non_tensor_state_is_refused_by_name(state, error, match):
    with pytest.raises(error, match=match):
        SMC(4).filter(lambda B: state, lambda t, x: (x, torch.zeros(1, 4)), num_steps=1)


def test_a_pyro_model_that_writes_no_state_or_a_number_is_refused_by_name():
    class Empty:
        def init(self, state):
            pass

        def step(self, state, y=None):
            pass

    class Number(Empty):
        def init(self, state):
            state["x"] = 1.0

    with pytest.raises(ValueError, match="empty state"):
        SMC(4).filter(Empty(), torch.zeros(3))
    with pytest.raises(TypeError, match=r"model state\['x'\] must be a tensor, got float"):
        SMC(4).filter(Number(), torch.zeros(3))


# ---- what init observes weighs the particles it draws -----------------------------------


class InitObserves:
    """z ~ Categorical(prior) in init, which also observes x0 ~ N(means[z], 1) and adds the
    factor log_factor[z]; every step observes y ~ N(means[z], 1) and leaves z as it is."""

    def __init__(self, prior, means, log_factor, x0):
        self.prior, self.means, self.log_factor, self.x0 = prior, means, log_factor, x0

    def init(self, state):
        z = pyro.sample("z", dist.Categorical(self.prior))
        pyro.sample("x0", dist.Normal(self.means[z], 1.0), obs=self.x0)
        pyro.factor("preference", self.log_factor[z])
        state["z"] = z.to(torch.float64)

    def step(self, state, y=None):
        mean = self.means[state["z"].long()]
        pyro.sample("y", dist.Normal(mean, 1.0), obs=y)


@given(st.integers(0, 3), st.integers(0, 1000), st.lists(st.floats(-3, 3), min_size=3, max_size=3))
@settings(max_examples=12, deadline=None)
def test_what_init_observes_and_its_factors_weigh_the_particles(steps, seed, log_factor):
    """Evidence and posterior against the sum over z written here: p(z) exp(f(z)) N(x0; m_z)
    prod_t N(y_t; m_z). Pyro's SMCFilter counts init's observations the same way."""
    g = torch.Generator().manual_seed(seed)
    prior = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    means = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    factor = torch.tensor(log_factor, dtype=torch.float64)
    x0, ys = torch.randn((), generator=g, dtype=torch.float64), torch.randn(steps, generator=g, dtype=torch.float64)
    observed = torch.cat([x0[None], ys])
    joint = [
        math.log(prior[z]) + factor[z].item() + dist.Normal(means[z], 1.0).log_prob(observed).sum().item()
        for z in range(3)
    ]
    exact_log_z = torch.logsumexp(torch.tensor(joint, dtype=torch.float64), 0).item()
    exact_posterior = torch.tensor(joint, dtype=torch.float64).softmax(0)

    pyro.set_rng_seed(seed)
    smc = SMC(num_particles=40_000, ess_threshold=0.0)  # no resampling: plain importance sampling from the prior
    result = smc.filter(InitObserves(prior, means, factor, x0), ys)
    assert result.log_evidence.shape == (1,) and result.ess.shape == (steps, 1)
    assert abs(result.log_evidence.item() - exact_log_z) < 0.05
    weights, z = result.log_weights[0].exp(), result.particles["z"][0].long()
    posterior = torch.stack([weights[z == k].sum() for k in range(3)])
    assert torch.allclose(posterior, exact_posterior, atol=0.02)


def test_a_run_of_no_step_whose_init_gave_zero_weight_everywhere_is_refused():
    model = InitObserves(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3), torch.full((3,), -math.inf), torch.tensor(0.0))
    with pytest.raises(ValueError, match="init returned are NaN, \\+inf or all -inf, in filters \\[0\\]"):
        SMC(num_particles=8, ess_threshold=0.0).filter(model, num_steps=0, batch_size=1)
    unvalidated = SMC(num_particles=8, ess_threshold=0.0, validate=False).filter(model, num_steps=0, batch_size=1)
    assert unvalidated.log_evidence.isnan().all()


class WalkSeenTwice:
    """x_t = x_{t-1} + N(0, q), two observations per step, y_tk ~ N(x_t, r), in a pyro.plate."""

    def __init__(self, q, r, per_step):
        self.q, self.r, self.per_step = q, r, per_step

    def init(self, state):
        state["x"] = pyro.sample("x0", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))

    def step(self, state, y):
        state["x"] = pyro.sample("x", dist.Normal(state["x"], self.q**0.5))
        with pyro.plate("seen", self.per_step, dim=-2):
            pyro.sample("y", dist.Normal(state["x"], self.r**0.5), obs=y.T)


@given(st.integers(0, 1000))
@settings(max_examples=4, deadline=None)
def test_observations_in_a_plate_of_the_models_own_weigh_each_particle_by_its_own_terms(seed):
    """The Kalman filter of the same walk with H = [1, 1]^T is the oracle; the plate's log-prob
    [2, particles] was reshaped across particles before."""
    g = torch.Generator().manual_seed(seed)
    steps, q, r = 6, 0.5, 0.3
    ys = torch.randn(steps, 2, generator=g, dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.float64)
    _, exact_log_z = kalman(
        ys,
        one,
        q * one,
        torch.ones(2, 1, dtype=torch.float64),
        r * torch.eye(2, dtype=torch.float64),
        torch.zeros(1, dtype=torch.float64),
        one,
    )
    pyro.set_rng_seed(seed)
    result = SMC(num_particles=20_000, ess_threshold=0.5).filter(WalkSeenTwice(q, r, 2), ys)
    assert abs(result.log_evidence.item() - exact_log_z) < 0.1
