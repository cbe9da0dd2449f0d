"""Exact (inference.reference.exact) against brute force: log Z and marginals by enumeration of
every assignment, gradients as marginals, plans and chunks, raw Pyro models, extreme potentials
in float64, and refusals."""

import copy
import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pyro import poutine

import graphs
import inference
from tests import oracles
from tests.strategies import scaled_crfs, tiny_crfs

pytestmark = pytest.mark.usefixtures("keep_global_rng")


# ---- Exact ------------------------------------------------------------------------


def enumerated_log_z(crf, tokens, mask):
    """log Z of each sentence by a float64 log-sum-exp over every assignment (the oracle
    builds its own float64 tables from the parameters)."""
    return [oracles.full_enumeration_log_z(crf, tokens[b].tolist(), mask[b].tolist()) for b in range(len(tokens))]


@settings(max_examples=60, deadline=None)
@given(data=scaled_crfs())
def test_exact_log_partition_is_float64_and_right_at_extreme_potentials(data):
    crf, tokens, mask = data
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(tokens, mask)
    assert log_z.dtype == torch.float64
    for found, expected in zip(log_z.tolist(), enumerated_log_z(crf, tokens, mask)):
        assert found == pytest.approx(expected, rel=1e-10, abs=1e-9)


def enumerated_label_marginals(crf, tokens):
    """log Z and ``[N, d]`` label marginals of one unpadded sentence ``[1, n]``: every joint
    assignment (z, h, g) scored by ``crf.log_potential`` in float64, then log-sum-exp."""
    crf = copy.deepcopy(crf).double()
    n = tokens.shape[1]
    N, C, G = crf.topology.num_nodes(n), crf.channels, crf.global_labels
    arcs = crf.arc_mask(torch.ones(1, n, dtype=torch.bool))[0]
    heads = [arcs[i].nonzero().flatten().tolist() or [0] for i in range(N)]
    zs = torch.tensor(list(itertools.product(range(crf.labels), repeat=N)))
    hs = torch.tensor(list(itertools.product(*(heads * C)))).view(-1, C, N)
    gs = torch.tensor(list(itertools.product(range(G), repeat=n))) if G else torch.zeros(1, 0, dtype=torch.long)
    z = zs.repeat_interleave(len(hs) * len(gs), 0)
    h = hs.repeat_interleave(len(gs), 0).repeat(len(zs), 1, 1)
    g = gs.repeat(len(zs) * len(hs), 1) if G else None
    with torch.no_grad():
        scores = crf.log_potential(tokens.expand(len(z), n), z, h, g)
    log_z = scores.logsumexp(0)
    weights = (scores - log_z).exp()
    marginals = torch.zeros(N, crf.labels, dtype=torch.float64)
    for i in range(N):
        marginals[i].index_add_(0, z[:, i], weights)
    return log_z.item(), marginals


@pytest.mark.parametrize("potential", [1.0, 100.0, 1e4])
@pytest.mark.parametrize("topology", ["star()", "window(1)"])
def test_exact_marginals_at_extreme_potentials_equal_enumeration(potential, topology):
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=4, labels=2, channels=1, rank=2, global_labels=2, topology=topology)
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(potential)
    tokens = torch.tensor([[0, 3, 1]])
    with torch.no_grad():
        post = inference.Exact(crf).marginals(tokens)
    assert post.z.dtype == torch.float32 and post.log_partition.dtype == torch.float32  # the CRF's dtype
    log_z, z = enumerated_label_marginals(crf, tokens)
    with torch.no_grad():
        wide = inference.Exact(crf).log_partition(tokens)  # the float64 value the Posterior's is cast from
    assert wide.dtype == torch.float64 and wide[0].item() == pytest.approx(log_z, rel=1e-10)
    assert post.log_partition[0].item() == pytest.approx(log_z, rel=1e-6)
    torch.testing.assert_close(post.z[0].double(), z, atol=1e-6, rtol=0)  # float32 probabilities


def test_exact_refuses_bad_arguments_clearly():
    with pytest.raises(TypeError, match="crf must be a graphs.CRF, got NoneType"):
        inference.Exact(None)
    crf = graphs.CRF(vocab_size=4, labels=2)
    for bad in ("x", 2.5, True, 0):
        with pytest.raises(ValueError, match="max_configurations must be >= 1"):
            inference.Exact(crf, max_configurations=bad)


@settings(max_examples=60)
@given(data=tiny_crfs())
def test_log_partition_and_marginals_equal_brute_force(data):
    crf, tokens, mask = data
    exact = inference.Exact(crf)
    with torch.no_grad():
        log_z = exact.log_partition(tokens, mask)
        post = exact.marginals(tokens, mask)
    B, n = tokens.shape
    N = crf.topology.num_nodes(n)
    assert log_z.shape == (B,)
    assert post.z.shape == (B, N, crf.labels) and post.h.shape == (B, crf.channels, N, N)
    for b in range(B):
        expected_log_z, zm, hm, gm = oracles.brute_force(crf, tokens[b].tolist(), mask[b].tolist())
        assert log_z[b].item() == pytest.approx(expected_log_z, abs=1e-4)
        assert post.log_partition[b].item() == pytest.approx(expected_log_z, abs=1e-4)
        torch.testing.assert_close(post.z[b].double(), zm, atol=1e-4, rtol=0)  # float32, as log Z
        torch.testing.assert_close(post.h[b].double(), hm, atol=1e-4, rtol=0)
        if crf.global_labels:
            torch.testing.assert_close(post.g[b].double(), gm, atol=1e-4, rtol=0)
    # marginals are distributions over existing variables, zero elsewhere
    nodes = crf.node_mask(mask)
    torch.testing.assert_close(post.z.sum(-1), nodes.float())
    has_head = crf.arc_mask(mask).any(-1)
    torch.testing.assert_close(post.h.sum(-1), has_head[:, None].expand_as(post.h[..., 0]).float())
    assert (post.h[crf.arc_mask(mask)[:, None].expand_as(post.h).logical_not()] == 0).all()


@pytest.mark.parametrize("topo", ["full", "causal", "star()", "clusters(1)", "segments(2)"])
@pytest.mark.parametrize("global_labels", [0, 2])
def test_log_partition_equals_full_enumeration_of_every_assignment(topo, global_labels):
    torch.manual_seed(1)
    crf = graphs.CRF(vocab_size=4, labels=2, channels=1, rank=2, global_labels=global_labels, topology=topo)
    tokens = torch.tensor([[0, 3, 1], [2, 1, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(tokens, mask)
    for b in range(2):
        expected = oracles.full_enumeration_log_z(crf, tokens[b].tolist(), mask[b].tolist())
        assert log_z[b].item() == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("gamma", [[2], [3], [2, 4], []])
def test_log_partition_with_distance_buckets_equals_full_enumeration(gamma):
    """gamma as cut points: Exact against the enumeration,
    whose distance groups are written in tests/oracles.py; mean field stays below it."""
    torch.manual_seed(3)
    crf = graphs.CRF(vocab_size=4, labels=2, channels=1, rank=2, gamma=gamma)
    tokens = torch.tensor([[0, 3, 1, 2], [2, 1, 0, 0]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(tokens, mask)
        elbo = inference.MeanField(crf, iterations=6).forward(tokens, mask).elbo
    for b in range(2):
        expected = oracles.full_enumeration_log_z(crf, tokens[b].tolist(), mask[b].tolist())
        assert log_z[b].item() == pytest.approx(expected, abs=1e-4)
        assert elbo[b].item() <= expected + 1e-4


def test_gradient_of_log_partition_is_the_unary_marginal():
    torch.manual_seed(2)
    crf = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=2, topology="window(1)")
    tokens = torch.tensor([[0, 1, 2, 3]])
    exact = inference.Exact(crf)
    exact.log_partition(tokens).sum().backward()
    with torch.no_grad():
        z = exact.marginals(tokens).z[0]
    torch.testing.assert_close(crf.unary.grad[:4], z, atol=1e-5, rtol=0)


def test_refuses_inputs_too_large_to_enumerate():
    crf = graphs.CRF(vocab_size=5, labels=4, channels=1)
    with pytest.raises(ValueError, match=r"9 nodes \(sentence length n=9 \+ 0 virtual\) with labels=4"):
        inference.Exact(crf).log_partition(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="max_configurations must be >= 1"):
        inference.Exact(crf, max_configurations=0)


def test_bad_input_is_refused_before_enumeration():
    crf = graphs.CRF(vocab_size=5, labels=2)
    with pytest.raises(ValueError, match="vocab_size"):
        inference.Exact(crf).marginals(torch.tensor([[9, 1]]))


def test_batch_in_chunks_gives_the_same_log_partition_and_marginals(monkeypatch):
    with torch.random.fork_rng():  # leave the global RNG as later tests expect it
        torch.manual_seed(3)
        crf = graphs.CRF(vocab_size=5, labels=2, channels=2, rank=2, global_labels=2, topology="window(1)")
        tokens = torch.randint(0, 5, (5, 3))
    mask = torch.tensor([[True, True, True]] * 3 + [[True, False, True], [True, False, False]])
    with torch.no_grad():
        whole = inference.Exact(crf).marginals(tokens, mask)
        monkeypatch.setattr("inference.reference.exact._MAX_BUCKET", 2**7)  # a few sentences per chunk at most
        chunked = inference.Exact(crf).marginals(tokens, mask)
    torch.testing.assert_close(chunked.log_partition, whole.log_partition, rtol=1e-12, atol=0)
    torch.testing.assert_close(chunked.z, whole.z)
    torch.testing.assert_close(chunked.h, whole.h)


def test_refuses_a_plan_whose_largest_bucket_is_too_large_before_computing():
    crf = graphs.CRF(vocab_size=5, labels=4, channels=1)
    with pytest.raises(ValueError, match=r"factor of \d+ entries per sentence, above the limit"):
        inference.Exact(crf, max_configurations=2**40).log_partition(torch.zeros(1, 12, dtype=torch.long))


# ---- any enumerable Pyro function ------------------------------------------


def hmm_case(seed=0, T=4, d=3, V=5, B=2):
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(d, generator=gen).softmax(-1)
    trans = torch.randn(d, d, generator=gen).softmax(-1)
    emit = torch.randn(d, V, generator=gen).softmax(-1)
    data = torch.randint(0, V, (B, T), generator=gen)

    def hmm(data):
        with pyro.plate("sequences", data.shape[0], dim=-1):
            x = None
            for t in pyro.markov(range(data.shape[1])):
                x = pyro.sample(f"x_{t}", dist.Categorical(init if x is None else trans[x]))
                pyro.sample(f"y_{t}", dist.Categorical(emit[x]), obs=data[:, t])

    return hmm, data, (init, trans, emit)


def test_exact_of_a_raw_pyro_hmm_equals_the_sum_over_every_path():
    hmm, data, (init, trans, emit) = hmm_case()
    B, T = data.shape
    d = init.shape[0]
    exact = inference.Exact(hmm)
    log_z, marginals = exact.log_partition(data), exact.marginals(data)
    assert log_z.shape == (B,) and log_z.dtype == torch.float64
    for b in range(B):
        weights, paths = [], list(itertools.product(range(d), repeat=T))
        for x in paths:
            p = init[x[0]].double() * emit[x[0], data[b, 0]]
            for t in range(1, T):
                p = p * trans[x[t - 1], x[t]] * emit[x[t], data[b, t]]
            weights.append(p)
        weights = torch.stack(weights)
        assert log_z[b].item() == pytest.approx(weights.sum().log().item(), abs=1e-6)
        for t in range(T):
            expected = torch.zeros(d, dtype=torch.float64).index_add_(0, torch.tensor([x[t] for x in paths]), weights)
            torch.testing.assert_close(marginals[f"x_{t}"][b].double(), expected / expected.sum(), atol=1e-5, rtol=0)
    assert set(marginals) == {f"x_{t}" for t in range(T)}


def test_exact_of_a_function_with_nested_plates_multiplies_over_the_inner_plate():
    """A mixture: per row one cluster c, then M observations all from cluster c. log Z per
    row = log sum_c p(c) prod_m N(x_m | mu_c, 1)."""
    weights = torch.tensor([0.2, 0.5, 0.3])
    means = torch.tensor([-1.0, 0.0, 2.0])
    data = torch.tensor([[0.1, -0.3, 0.4, 0.0], [2.1, 1.7, 2.5, 1.9]])

    def mixture(data):
        with pyro.plate("rows", data.shape[0], dim=-2):
            c = pyro.sample("c", dist.Categorical(weights))
            with pyro.plate("observations", data.shape[1], dim=-1):
                pyro.sample("x", dist.Normal(means[c], 1.0), obs=data)

    log_z = inference.Exact(mixture).log_partition(data)
    normal = torch.distributions.Normal(means.double()[:, None, None], 1.0)
    expected = (weights.double().log()[:, None] + normal.log_prob(data.double()).sum(-1)).logsumexp(0)
    torch.testing.assert_close(log_z, expected, atol=1e-5, rtol=0)
    posterior = inference.Exact(mixture).marginals(data)["c"]
    torch.testing.assert_close(
        posterior.reshape(2, 3).double(),
        (weights.double().log()[:, None] + normal.log_prob(data.double()).sum(-1) - expected).exp().T,
        atol=1e-5,
        rtol=0,
    )


def test_exact_of_a_function_without_plate_is_a_scalar():
    def coin_pair():
        a = pyro.sample("a", dist.Bernoulli(0.3))
        b = pyro.sample("b", dist.Bernoulli(0.6))
        pyro.factor("agree", torch.where(a == b, 1.5, 0.0))

    log_z = inference.Exact(coin_pair).log_partition()
    expected = math.log(0.3 * 0.6 * math.exp(1.5) + 0.7 * 0.4 * math.exp(1.5) + 0.3 * 0.4 + 0.7 * 0.6)
    assert log_z.shape == () and log_z.item() == pytest.approx(expected, abs=1e-6)
    a = inference.Exact(coin_pair).marginals()["a"]
    on = 0.3 * (0.6 * math.exp(1.5) + 0.4)
    torch.testing.assert_close(
        a.double(), torch.tensor([1 - on / math.exp(expected), on / math.exp(expected)]).double()
    )


def test_exact_refuses_what_it_cannot_enumerate():
    def continuous():
        pyro.sample("x", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="site 'x' is latent but not enumerable"):
        inference.Exact(continuous).log_partition()
    with pytest.raises(TypeError, match=r"crf must be a graphs.CRF, got NoneType \(Exact also takes a Pyro function"):
        inference.Exact(None)
    hmm, data, _ = hmm_case(T=3)
    with pytest.raises(ValueError, match=r"site 'x_1' enumerates to 9 .* above max_configurations=4"):
        inference.Exact(hmm, max_configurations=4).log_partition(data)


@pytest.mark.parametrize("scaled", ["poutine.scale", "tensor scale", "subsampled plate"])
def test_exact_refuses_a_scaled_site_by_name_where_it_would_sum_it_unscaled(scaled):
    """A scale (a tempered likelihood, or a subsampled plate's size / subsample) would be read
    unscaled by the sum and scaled by Pyro's marginals: refused, with the way to write it."""
    data = torch.tensor([0.5, 1.5, 2.5, 1.0])

    def model():
        z = pyro.sample("z", dist.Bernoulli(0.5))
        if scaled == "subsampled plate":
            with pyro.plate("data", 4, subsample=torch.tensor([0, 1])):
                pyro.sample("y", dist.Normal(z, 1.0), obs=data[:2])
        else:
            with poutine.scale(scale=3.0 if scaled == "poutine.scale" else torch.tensor([3.0])):
                pyro.sample("y", dist.Normal(z, 1.0), obs=data[0])

    for ask in (lambda e: e.log_partition(), lambda e: e.marginals()):
        with pytest.raises(ValueError, match=r"site 'y' is scaled by .*pyro.factor\(name, scale \* log_prob\)"):
            ask(inference.Exact(model))

    def tempered():  # what the message says to write: the tempered model, summed by hand below
        z = pyro.sample("z", dist.Bernoulli(0.5))
        pyro.factor("y", 3.0 * dist.Normal(z, 1.0).log_prob(data[0]))

    terms = [3.0 * dist.Normal(float(z), 1.0).log_prob(data[0]).item() for z in (0, 1)]
    expected = math.log(0.5 * math.exp(terms[0]) + 0.5 * math.exp(terms[1]))
    assert inference.Exact(tempered).log_partition().item() == pytest.approx(expected, abs=1e-6)


@given(st.lists(st.booleans(), min_size=1, max_size=5), st.floats(0.05, 0.95))
def test_exact_of_pyros_missing_data_idiom_sums_only_the_observed_terms(observed, prior):
    """obs_mask: a masked-out observation becomes an enumerated latent that nothing reads;
    log Z is log p(observed y) written here (it was log 2 too high per missing value)."""
    y = torch.tensor([float(k % 2) for k in range(len(observed))])
    seen = torch.tensor(observed)

    def model():
        x = pyro.sample("x", dist.Bernoulli(prior))
        with pyro.plate("data", len(observed)):
            pyro.sample("y", dist.Bernoulli(0.2 + 0.6 * x), obs=y, obs_mask=seen)

    def likelihood(x):
        return math.prod((0.2 + 0.6 * x) if v else (0.8 - 0.6 * x) for v, o in zip(y.tolist(), observed) if o)

    expected = math.log((1 - prior) * likelihood(0) + prior * likelihood(1))
    assert inference.Exact(model).log_partition().item() == pytest.approx(expected, abs=1e-6)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(2, 3), st.integers(2, 4), st.integers(0, 2**16))
def test_exact_of_an_overridden_crf_model_under_a_mask_keeps_its_latents_priors(n, labels, extra, seed):
    """A CRF model that adds, under ``poutine.mask(False)``, a latent nothing reads and a
    factor: the masked factor drops out and the latent sums to one (as in Pyro's obs_mask
    idiom), so log Z and the label marginals are the plain CRF's, enumerated independently
    here. The latent's prior was masked too, which added log(extra) to log Z."""
    torch.manual_seed(seed)

    class MaskedExtra(graphs.CRF):
        def model(self, tokens, mask=None):
            super().model(tokens, mask)
            with poutine.mask(mask=False):
                pyro.sample("extra", dist.Categorical(logits=torch.zeros(extra)))
                pyro.factor("bonus", torch.full((), 5.0))

    crf = MaskedExtra(vocab_size=5, labels=labels, topology="full")
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_()
    tokens = torch.randint(0, 5, (1, n))
    expected_log_z, expected_marginals = enumerated_label_marginals(crf, tokens)
    with torch.no_grad():
        posterior = inference.Exact(crf).marginals(tokens)
    assert posterior.log_partition.item() == pytest.approx(expected_log_z, abs=1e-5)
    assert torch.allclose(posterior.z[0].double(), expected_marginals, atol=1e-5)


def test_exact_of_a_crf_model_masked_whole_sums_uniform_latents_to_log_one():
    """Every factor masked out and every latent a uniform prior: the total mass is 1."""

    class MaskedWhole(graphs.CRF):
        def model(self, tokens, mask=None):
            with poutine.mask(mask=False):
                super().model(tokens, mask)

    crf = MaskedWhole(vocab_size=4, labels=2, global_labels=2)
    log_z = inference.Exact(crf).log_partition(torch.tensor([[1, 2, 3]]))
    assert log_z.item() == pytest.approx(0.0, abs=1e-12)
