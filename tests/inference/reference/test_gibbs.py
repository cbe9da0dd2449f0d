"""Gibbs (inference.reference.gibbs): marginals agree with Exact within four standard errors,
reproducible draws, user factors compiled, and refusals."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs
import inference


def case(topology, global_labels, seed):
    torch.manual_seed(seed)
    crf = graphs.CRF(vocab_size=6, labels=2, channels=2, rank=2, global_labels=global_labels, topology=topology)
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(2.0)  # peaked enough that a wrong sampler would show
    tokens = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return crf, tokens, mask


@pytest.mark.parametrize(
    "topology,global_labels,seed",
    [pytest.param("window(1) | star()", 2, 0, marks=pytest.mark.slow), ("causal", 0, 1)],  # the first ~15 s
)
def test_gibbs_marginals_agree_with_exact_within_four_standard_errors(topology, global_labels, seed):
    crf, tokens, mask = case(topology, global_labels, seed)
    with torch.no_grad():
        exact = inference.Exact(crf.double()).marginals(tokens, mask)
    result = inference.Gibbs(crf, num_samples=3000, num_warmup=300, num_chains=4, seed=seed).sample(tokens, mask)
    assert result.rhat < 1.05
    for name in ["z", "h"] + (["g"] if global_labels else []):
        p = getattr(exact, name).detach().double()
        estimate = getattr(result.marginals, name)
        ess = getattr(result.effective_sample_size, name)
        assert estimate.shape == p.shape
        # the standard error under the exact p (an estimate stuck at 0 or 1 still has one)
        se = torch.sqrt((p * (1 - p)).clamp(min=0) / ess).clamp(min=1e-6)  # 1e-6: rounding floor
        z_scores = (estimate - p).abs() / se
        assert z_scores.max() < 4, (name, z_scores.max())
    posterior = result.inference_data.posterior
    assert set(posterior.data_vars) >= {"z", "h"}
    assert posterior["z"].shape == (4, 3000, 2, crf.topology.num_nodes(3))


def test_gibbs_validates_its_arguments():
    crf, _, _ = case("full", 0, 0)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        inference.Gibbs(crf, num_samples=0)
    with pytest.raises(ValueError, match="num_chains"):
        inference.Gibbs(crf, num_chains=0)
    with pytest.raises(ValueError, match="vocab_size"):
        inference.Gibbs(crf).sample(torch.tensor([[99]]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_samples=10**12), r"num_samples must be an integer >= 1 and <= 10000000 \(the limit\)"),
        (dict(num_samples=10**7 + 1), r"num_samples .* <= 10000000"),
        (dict(num_warmup=10**12), r"num_warmup must be an integer >= 0 and <= 10000000"),
        (dict(num_chains=10**12), r"num_chains must be an integer >= 1 and <= 1024"),
        (dict(num_chains=True), r"num_chains must be an integer"),
        (dict(num_samples=2.0), r"num_samples must be an integer"),
        (dict(seed=-1), r"seed must be an integer >= 0 and <= 4294967295"),
        (dict(seed=2**64), r"seed must be an integer"),
        (dict(seed="7"), r"seed must be an integer"),
    ],
)
def test_gibbs_refuses_absurd_counts_naming_the_limit(kwargs, match):
    # num_samples=10**12 reached JAX (RESOURCE_EXHAUSTED allocating 8 TB)
    crf, _, _ = case("full", 0, 0)
    with pytest.raises(ValueError, match=match):
        inference.Gibbs(crf, **kwargs)


def test_gibbs_refuses_a_product_key_memory_by_name():
    """Its keys score and its values message: no CRF factor to sample (it was sampled as a
    dense global factor of the value tables, the keys never read)."""
    memory = graphs.CRF(vocab_size=5, labels=2, global_labels=4, global_memory="product_key")
    with pytest.raises(ValueError, match="a product-key memory is not a CRF factor"):
        inference.Gibbs(memory)


def test_gibbs_refuses_a_run_whose_draws_would_not_fit_before_sampling():
    crf, tokens, mask = case("full", 0, 0)
    # each count within its limit; together 1024 x 10**7 x (per-draw values) > 2**30
    with pytest.raises(ValueError, match=r"num_chains x num_samples x values per draw = 1024 x 10000000 x \d+"):
        inference.Gibbs(crf, num_samples=10**7, num_chains=1024).sample(tokens, mask)


def test_gibbs_draws_are_reproducible_under_a_seed():
    crf, tokens, mask = case("window(1)", 0, 3)
    a = inference.Gibbs(crf, num_samples=50, num_warmup=10, seed=7).sample(tokens, mask)
    b = inference.Gibbs(crf, num_samples=50, num_warmup=10, seed=7).sample(tokens, mask)
    np.testing.assert_array_equal(a.inference_data.posterior["z"].values, b.inference_data.posterior["z"].values)


class SameAsNext(graphs.Factor):
    """A user factor, written here: weight w per pair of neighbouring real tokens with equal
    labels, plus a constant 3e7 per sentence. The constant changes no posterior, but carried
    in float32 it would round Gibbs's conditionals (differences of the summed totals) away."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(float(weight)))
        self.float64_in_jax = []  # what JAX's float64 switch read where Gibbs called this

    def log_potential(self, z, tokens, mask):
        import jax

        self.float64_in_jax.append(jax.config.jax_enable_x64)
        n = tokens.shape[1]
        same = (z[:, 1:n] == z[:, : n - 1]) & mask[:, 1:]
        return self.weight * same.to(self.weight.dtype).sum(-1) + 3e7


# ~10 s idle (the user factor runs in torch through a JAX callback); in make test: the one Gibbs run of a user factor
def test_gibbs_compiles_pairwise_and_user_factors_and_agrees_with_exact():
    torch.manual_seed(6)
    factors = [graphs.factors.Pairwise(2, "chain()"), SameAsNext(1.5)]
    crf = graphs.CRF(vocab_size=6, labels=2, channels=1, rank=2, topology="window(1)", factors=factors)
    with torch.no_grad():
        crf.factors[0].table.mul_(3.0)  # strong enough that ignoring a factor would show
    tokens = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        exact = inference.Exact(crf.double()).marginals(tokens, mask)
    crf.factors[1].float64_in_jax.clear()
    result = inference.Gibbs(crf, num_samples=1500, num_warmup=200, num_chains=4, seed=2).sample(tokens, mask)
    assert result.rhat < 1.05
    # float64 is switched on for Gibbs's own thread only: where XLA calls the factor, it is off
    assert False in crf.factors[1].float64_in_jax
    for name in ("z", "h"):
        p = getattr(exact, name).detach().double()
        se = torch.sqrt((p * (1 - p)).clamp(min=0) / getattr(result.effective_sample_size, name)).clamp(min=1e-6)
        assert ((getattr(result.marginals, name) - p).abs() / se).max() < 4, name
    # the extra factors matter here: without them the label marginals move far
    without = graphs.CRF(vocab_size=6, labels=2, channels=1, rank=2, topology="window(1)").double()
    without.load_state_dict({k: v for k, v in crf.state_dict().items() if not k.startswith("factors.")})
    with torch.no_grad():
        assert (inference.Exact(without).marginals(tokens, mask).z - exact.z).abs().max() > 0.1


def test_gibbs_refuses_a_raw_factor_site_it_would_ignore():
    import pyro

    class Extra(graphs.CRF):
        def model(self, tokens, mask=None):
            super().model(tokens, mask)
            pyro.factor("bonus", torch.full((), 2.0))

    crf = Extra(vocab_size=4, labels=2)
    with pytest.raises(
        ValueError, match=r"Gibbs cannot compile Extra.model: it overrides CRF.model.*engines that can: Exact"
    ):
        inference.Gibbs(crf)
    plain = graphs.CRF(vocab_size=4, labels=2)
    plain.load_state_dict(crf.state_dict())
    tokens = torch.tensor([[1, 2]])
    with torch.no_grad():  # Exact sums the model itself: it includes the site
        with_bonus, without = inference.Exact(crf).log_partition(tokens), inference.Exact(plain).log_partition(tokens)
    assert with_bonus.item() == pytest.approx(without.item() + 2.0, abs=1e-9)


def test_gibbs_of_a_float64_crf_with_large_potentials_keeps_its_precision():
    """3e6 added to every label of every token changes no posterior. JAX computed in float32,
    where DiscreteGibbs's conditionals (differences of the batch's summed potential) lost their
    precision: marginals 6-13 standard errors off. Exact (float64 enumeration) is the oracle."""
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=6, labels=2, channels=1, rank=2, topology="chain()", gamma=1).double()
    tokens, mask = torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.bool)
    with torch.no_grad():
        expected = inference.Exact(crf).marginals(tokens, mask).z
        crf.unary.add_(3e6)
    result = inference.Gibbs(crf, num_samples=1000, num_warmup=200, num_chains=4, seed=0).sample(tokens, mask)
    error = (result.marginals.z - expected).abs()
    assert (error <= 4 * result.standard_error.z + 1e-9).all(), (error, result.standard_error.z)


class NoTwoOnes(graphs.Factor):
    """A hard constraint, written here: log phi = -inf where the first two labels are both 1."""

    def log_potential(self, z, tokens, mask):
        return torch.where((z[:, 0] == 1) & (z[:, 1] == 1), -math.inf, 0.0)


def test_a_user_factors_zero_potential_reaches_jax_as_minus_infinity_not_nan():
    """A batch total of -inf (a labelling the factor forbids) comes back through the two float32
    halves as -inf, as its float64 would, with no NaN (inf - inf) and no warning; a finite total
    beside it in the same call keeps its float64 value."""
    import warnings

    import jax

    from inference.reference.gibbs import _extra_term

    tokens, mask = torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.bool)
    user = _extra_term(NoTwoOnes(), tokens, mask, torch.ones(1, 3, dtype=torch.bool), np.float64)
    z = np.array([[[1, 1, 0]], [[1, 0, 1]]])  # [2 (a vmapped axis), B = 1, N = 3]: forbidden, allowed
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("error")
        totals = np.asarray(jax.vmap(user)(z))
    assert totals.tolist() == [-math.inf, 0.0]


@given(st.floats(-3e38, 3e38, allow_nan=False) | st.sampled_from([-math.inf, math.inf]))
def test_a_float64_total_survives_its_two_float32_halves(total):
    from inference.reference.gibbs import _as_two_float32

    with np.errstate(invalid="raise"):  # no invalid operation (inf - inf) on the way
        parts = _as_two_float32(np.array([total]))
    assert parts.dtype == np.float32 and parts.shape == (1, 2)
    back = float(parts[0, 0]) + float(parts[0, 1])
    if math.isinf(total):
        assert back == total
    else:
        assert abs(back - total) <= 2.0**-47 * abs(total) + 2.0**-149  # float32 alone: 2**-24
