"""TemperedSMC (inference.smc.tempered.sampler) against exact answers: Z-hat unbiased, log Z
and marginals close to Exact on enumerable CRFs, and refusals by name."""

import copy
import math

import pytest
import torch

import graphs
import inference
from inference.smc.tempered.sampler import TemperedSMC
from tests.builders import tempered_case as make_case

pytestmark = pytest.mark.usefixtures("one_thread")


REPLICATES = 50


@pytest.mark.parametrize("kind", ["global", "pairwise", "user", "virtual"])
def test_log_z_unbiased_and_marginals_match_exact(kind):
    crf, tokens, mask = make_case(kind)
    exact = inference.Exact(crf)(tokens, mask)
    result = TemperedSMC(crf, num_particles=128, replicates=REPLICATES, seed=0).run(tokens, mask)
    ratios = (result.replicate_log_partition - exact.log_partition).exp()  # [R, B] Z-hat / Z
    standard_error = ratios.std(0) / math.sqrt(REPLICATES)
    assert ((ratios.mean(0) - 1).abs() < 3 * standard_error).all(), (ratios.mean(0), standard_error)
    assert (result.log_partition - exact.log_partition).abs().max() < 0.05
    posterior = result.posterior
    for name in ["z", "h"] + (["g"] if crf.global_labels else []):
        difference = (getattr(posterior, name) - getattr(exact, name)).abs().max()
        assert difference < 0.02, (name, difference)
    assert result.betas[0].eq(0).all() and result.betas[-1].eq(1).all()
    assert (result.betas.diff(dim=0) >= 0).all()
    assert result.ess.shape == (result.steps, REPLICATES, 2)
    assert torch.allclose(result.log_weights.exp().sum(-1), torch.ones(REPLICATES, 2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["global", "pairwise", "user", "virtual"])
def test_a_half_precision_crf_gives_what_a_float32_crf_with_its_parameters_gives(kind, dtype):
    """The target is compiled in float32 (a half table cannot hold the forbidden arcs' score,
    and its rounding would enter every weight): the run is the float32 CRF's, from the same
    proposal and seed, and the Posterior is in the CRF's dtype."""
    crf, tokens, mask = make_case(kind)
    half = crf.to(dtype)
    wide = copy.deepcopy(half).float()  # the same parameters, each exactly representable in both
    with torch.no_grad():
        proposal = inference.MeanField(wide, iterations=4)(tokens, mask)
    runs = [
        TemperedSMC(c, num_particles=16, replicates=4, seed=0).run(tokens, mask, proposal=proposal)
        for c in (half, wide)
    ]
    found, expected = runs
    # a Pairwise sums its half-precision table in its own dtype: only its rounding differs
    tolerance = dict(rtol=1e-3, atol=1e-3) if kind == "pairwise" else dict(rtol=0, atol=0)
    torch.testing.assert_close(found.log_partition, expected.log_partition, **tolerance)
    for name in ["z", "h"] + (["g"] if crf.global_labels else []):
        value = getattr(found.posterior, name)
        assert value.dtype == dtype, name
        torch.testing.assert_close(value, getattr(expected.posterior, name).to(dtype), **tolerance)


# ---- bad input ------------------------------------------------------------------------------


def test_a_crf_it_cannot_compile_is_refused_by_name():
    memory = graphs.CRF(vocab_size=5, labels=2, global_labels=4, global_memory="product_key")
    with pytest.raises(ValueError, match="TemperedSMC cannot compile"):
        TemperedSMC(memory)

    class NoPotential(graphs.Factor):
        pass

    crf = graphs.CRF(vocab_size=5, labels=2, factors=[NoPotential()])
    with pytest.raises(ValueError, match="nopotential0.*log_potential"):
        TemperedSMC(crf)
    with pytest.raises(TypeError, match="crf must be a graphs.CRF"):
        TemperedSMC(object())


def test_a_proposal_of_the_wrong_shape_or_values_is_refused():
    crf, tokens, mask = make_case("global")
    exact = inference.Exact(crf)(tokens, mask)
    engine = TemperedSMC(crf, num_particles=4, replicates=2, seed=0)
    wrong = inference.Posterior(z=exact.z[:, :2], h=exact.h, g=exact.g)
    with pytest.raises(ValueError, match=r"proposal.z must be a tensor of shape \[2, 4, 3\]"):
        engine.run(tokens, mask, proposal=wrong)
    missing = inference.Posterior(z=exact.z, h=exact.h, g=None)
    with pytest.raises(ValueError, match="proposal.g"):
        engine.run(tokens, mask, proposal=missing)
    poisoned = inference.Posterior(z=exact.z.clone().fill_(math.nan), h=exact.h, g=exact.g)
    with pytest.raises(ValueError, match="proposal.z must hold finite"):
        engine.run(tokens, mask, proposal=poisoned)
    with pytest.raises(TypeError, match="proposal must be an inference.Posterior"):
        engine.run(tokens, mask, proposal=exact.z)


def test_non_finite_weights_are_refused():
    class Overflow(graphs.Factor):
        def log_potential(self, z, tokens, mask):
            return torch.full((z.shape[0],), math.inf, dtype=torch.float64)

    crf = graphs.CRF(vocab_size=5, labels=2, factors=[Overflow()]).double()
    tokens = torch.tensor([[1, 2]])
    exact_free = inference.Posterior(z=torch.full((1, 2, 2), 0.5), h=torch.tensor([[[[0.0, 1.0], [1.0, 0.0]]]]))
    with pytest.raises(ValueError, match="non-finite importance weights"):
        TemperedSMC(crf, num_particles=4, replicates=2).run(tokens, proposal=exact_free)


@pytest.mark.parametrize(
    "name,value,error",
    [
        ("num_particles", 0, ValueError),
        ("replicates", 1.5, TypeError),
        ("target_ess", 1.0, ValueError),
        ("resample", "best", ValueError),
        ("resample_threshold", 0.0, ValueError),
        ("rounds", 0, ValueError),
        ("proposal_floor", -0.1, ValueError),
        ("pilot", "yes", TypeError),
    ],
)
def test_bad_arguments_are_named(name, value, error):
    crf = graphs.CRF(vocab_size=5, labels=2)
    with pytest.raises(error, match=name):
        TemperedSMC(crf, **{name: value})


def test_a_user_factor_without_expectation_needs_an_explicit_proposal():
    class Bonus(graphs.Factor):
        def log_potential(self, z, tokens, mask):
            return (z[:, 0] == z[:, 1]).double()

    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=5, labels=2, factors=[Bonus()]).double()
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="default proposal, MeanField, cannot compile"):
        TemperedSMC(crf, num_particles=8, replicates=2).run(tokens)
    uniform = inference.Posterior(z=torch.full((1, 3, 2), 0.5), h=torch.full((1, 1, 3, 3), 0.5))
    result = TemperedSMC(crf, num_particles=64, replicates=16, seed=0).run(tokens, proposal=uniform)
    error = (result.log_partition - inference.Exact(crf).log_partition(tokens)).abs()
    assert (error < 4 * result.standard_error).all() and (result.standard_error < 0.05).all()


def test_a_mean_field_proposal_with_confidence_exit_runs_every_iteration():
    """Its call without a confidence is refused at inference (no token could exit), and the
    sampler gave the caller no way to pass one: the proposal is its q after every iteration."""
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=6, labels=2, channels=1, rank=2).double()
    tokens = torch.tensor([[1, 2, 3]])
    exiting = inference.MeanField(crf, iterations=3, halting="exit").eval()
    plain = inference.MeanField(crf, iterations=3).eval()
    runs = [TemperedSMC(crf, num_particles=8, replicates=2, proposal=p, seed=0).run(tokens) for p in (exiting, plain)]
    assert torch.equal(runs[0].log_partition, runs[1].log_partition)


def test_a_proposal_that_draws_one_labelling_reports_no_standard_error():
    """A mean field collapsed on a labelling p barely holds: every draw was that labelling,
    tempering jumped from 0 to 1, log Z came out 59 nats below Exact's with a standard error
    of 0. The error is NaN now, with a warning naming the sentence."""
    torch.manual_seed(3)
    crf = graphs.CRF(vocab_size=6, labels=2, channels=1, rank=2, topology="full", gamma=1)
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(8.0)
    tokens = torch.tensor([[1, 2, 3, 5]])
    with pytest.warns(UserWarning, match=r"one labelling in sentence\(s\) \[0\]"):
        result = TemperedSMC(crf, num_particles=64, replicates=4, seed=0).run(tokens)
    exact = inference.Exact(crf).log_partition(tokens)
    assert result.one_labelling.tolist() == [True] and math.isnan(result.standard_error[0])
    assert (exact - result.log_partition).item() > 10  # what the NaN stands for: far off, unseen
