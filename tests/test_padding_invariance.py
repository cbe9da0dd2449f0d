"""Padding invariance as a law: a sentence's answer is the same alone, padded, or in a batch
with longer sentences, for every model kind, every engine and every diagnostic. Exact
equality where the maths allows, float64 round-off otherwise; Gibbs (a Markov chain over
the whole batch) to its Monte-Carlo error.

Each property draws a batch (random lengths, padding, companions) and compares every row
with the same sentence run alone at its own length. Written once, parametrised over the
kinds in ``probformer.models.registry.KINDS`` and the engines.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from probformer.diagnostics import diversity, ess, pareto_k, report
from probformer.diagnostics.probe import layer_metrics
from probformer.diagnostics.trace_measures import measure
from probformer.models import registry
from tests.builders import TINY_CONFIGS, VOCAB, last_is_head


@pytest.fixture(scope="module", params=sorted(registry.KINDS))
def model(request):
    assert set(TINY_CONFIGS) == set(registry.KINDS)  # a new kind must join the law
    torch.manual_seed(0)
    built = registry.build(request.param, TINY_CONFIGS[request.param]).double().eval()
    return request.param, built


@st.composite
def batches(draw, max_length=7, max_batch=3, max_padding=3):
    """``(tokens [B, n], mask [B, n], lengths)``: B sentences of random real lengths,
    right-padded (causal models need padding at the end) to the longest plus extra padding;
    padded positions hold junk ids (they must not matter)."""
    lengths = draw(st.lists(st.integers(1, max_length), min_size=1, max_size=max_batch))
    n = max(lengths) + draw(st.integers(0, max_padding))
    rows = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)) for _ in lengths]
    tokens = torch.tensor(rows)
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return tokens, mask, lengths


def alone(tokens, mask, row):
    """Sentence ``row`` of a batch, alone at its own length: ``(tokens [1, l], mask [1, l])``."""
    real = tokens[row][mask[row]][None]
    return real, torch.ones_like(real, dtype=torch.bool)


def assert_same(batched, single, what, rtol=1e-9, atol=1e-10):
    """Equal to float64 round-off, NaN where the other is NaN."""
    batched, single = np.asarray(batched, dtype=float), np.asarray(single, dtype=float)
    assert batched.shape == single.shape, (what, batched.shape, single.shape)
    np.testing.assert_allclose(batched, single, rtol=rtol, atol=atol, equal_nan=True, err_msg=what)


# ---- every model kind: outputs, every measured diagnostic, the report, the probe --------------


def logits_of(model, tokens, mask):
    with torch.no_grad():
        out = model(tokens, mask)
    return out[0] if isinstance(out, tuple) else out


@given(batches())
@settings(max_examples=8)
def test_every_model_kind_answers_a_sentence_the_same_alone_padded_or_batched(model, batch):
    kind, net = model
    tokens, mask, lengths = batch
    logits = logits_of(net, tokens, mask)
    measured = measure(net, tokens, mask)
    for row, length in enumerate(lengths):
        one_tokens, one_mask = alone(tokens, mask, row)
        assert_same(logits[row, :length], logits_of(net, one_tokens, one_mask)[0], f"{kind} logits")
        single = measure(net, one_tokens, one_mask)
        assert set(measured.variables) == set(single.variables)
        for name, (dims, values) in measured.variables.items():
            value = values[row]
            if "token" in dims or "particle" in dims:  # per token: the real tokens only
                value = value[..., :length]
            assert_same(value, single.variables[name][1][0], f"{kind} {name}")


def test_k_hat_of_a_long_padded_sentence_is_its_own(model):
    """The issue's case through every kind: 22 real tokens padded to 26 next to a 26-token
    sentence: finite k-hat (>= 21 draws), the same as the sentence alone."""
    kind, net = model
    tokens = torch.arange(52).view(2, 26) % VOCAB
    mask = torch.ones(2, 26, dtype=torch.bool)
    mask[1, 22:] = False
    batched, single = measure(net, tokens, mask), measure(net, *alone(tokens, mask, 1))
    for name in ("received_pareto_k", "smc_pareto_k"):
        if name in single.variables:
            value = single.variables[name][1][0]
            assert np.isfinite(value).any(), (kind, name)
            assert_same(batched.variables[name][1][1], value, f"{kind} {name}")


@given(batches(max_batch=2))
@settings(max_examples=4)
def test_the_report_and_the_trainers_probe_are_padding_invariant(model, batch):
    kind, net = model
    tokens, mask, lengths = batch
    row = int(np.argmin(lengths))  # the shortest sentence, padded the most
    one_tokens, one_mask = alone(tokens, mask, row)
    padded_tokens, padded_mask = tokens[row : row + 1], mask[row : row + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        padded_stats, single_stats = (
            report(net, t, m)["sample_stats"] for t, m in ((padded_tokens, padded_mask), (one_tokens, one_mask))
        )
    for name in single_stats.data_vars:
        value = padded_stats[name].values
        if "token" in padded_stats[name].dims or "particle" in padded_stats[name].dims:
            value = value[..., : lengths[row]]
        assert_same(value, single_stats[name].values, f"{kind} report {name}")
    padded_probe, single_probe = (
        layer_metrics(net, padded_tokens, padded_mask),
        layer_metrics(net, one_tokens, one_mask),
    )
    assert padded_probe.keys() == single_probe.keys()
    for field, value in single_probe.items():
        assert_same(padded_probe[field], value, f"{kind} probe {field}")


# ---- every engine --------------------------------------------------------------------------------


def tiny_crf(embedding=False):
    torch.manual_seed(1)
    source = dict(embedding_size=3) if embedding else dict(vocab_size=VOCAB)
    return graphs.CRF(labels=2, channels=1, rank=2, global_labels=2, topology="full", **source).double()


DETERMINISTIC_ENGINES = {
    "Exact": lambda crf: inference.Exact(crf),
    "MeanField naive": lambda crf: inference.MeanField(crf, iterations=3, kernel="naive"),
    "MeanField fused": lambda crf: inference.MeanField(crf, iterations=3, kernel="fused"),
}


def node_rows(post, row, length, crf):
    """The marginals of sentence ``row``'s real tokens (and virtual nodes): z, h, g."""
    n = post.z.shape[1] - crf.topology.extra_nodes
    nodes = list(range(length)) + list(range(n, post.z.shape[1]))
    found = {"z": post.z[row, nodes], "h": post.h[row][:, nodes][:, :, nodes]}
    if post.g is not None:
        found["g"] = post.g[row, :length]
    for name in ("log_partition", "elbo"):
        if getattr(post, name) is not None:
            found[name] = getattr(post, name)[row]
    return {name: value.detach() for name, value in found.items()}


@pytest.mark.parametrize("embedding", [False, True], ids=["token ids", "embeddings"])
@pytest.mark.parametrize("engine", sorted(DETERMINISTIC_ENGINES))
@given(batch=batches(max_length=4))
@settings(max_examples=6)
def test_every_engine_answers_a_sentence_the_same_alone_padded_or_batched(engine, embedding, batch):
    tokens, mask, lengths = batch
    crf = tiny_crf(embedding)
    run = DETERMINISTIC_ENGINES[engine](crf)
    if embedding:  # the same law with embeddings in: junk (NaN too) at padded positions
        inputs = torch.randn(*tokens.shape, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        inputs = inputs.masked_fill(~mask[..., None], math.nan)
        call = lambda x, m: run(embeddings=x, mask=m)  # noqa: E731
        single_inputs = lambda row: inputs[row][mask[row]][None]  # noqa: E731
    else:
        inputs, call = tokens, (lambda x, m: run(x, m))
        single_inputs = lambda row: alone(tokens, mask, row)[0]  # noqa: E731
    batched = call(inputs, mask)
    for row, length in enumerate(lengths):
        single = call(single_inputs(row), torch.ones(1, length, dtype=torch.bool))
        got, want = node_rows(batched, row, length, crf), node_rows(single, 0, length, crf)
        assert got.keys() == want.keys()
        for name in want:
            assert_same(got[name], want[name], f"{engine} {name}")


LENGTH_TOPOLOGIES = {
    "star(wrap=True)": "star(wrap=True)",
    "window(1) | star(wrap=True)": "window(1) | star(wrap=True)",
    "a function of n": last_is_head,
}


LENGTH_ENGINES = {
    "Exact": inference.Exact,
    "MeanField": lambda crf: inference.MeanField(crf, iterations=3, kernel="naive"),
    "MeanField fused": lambda crf: inference.MeanField(crf, iterations=3, kernel="fused"),
}


@pytest.mark.parametrize("topology", sorted(LENGTH_TOPOLOGIES))
@pytest.mark.parametrize("engine", sorted(LENGTH_ENGINES))
@given(batch=batches(max_length=4))
@settings(max_examples=6, deadline=None)
def test_a_topology_of_the_sentence_length_answers_a_sentence_the_same_alone_or_padded(topology, engine, batch):
    """star(wrap=True) closes its ring between a sentence's first and last tokens, and a
    function of n is called with the sentence's length: in a padded batch both read the
    batch's length instead, so a sentence lost its closing arc (or got another function's
    arcs) when padded, and its answer changed."""
    tokens, mask, lengths = batch
    torch.manual_seed(1)
    crf = graphs.CRF(vocab_size=VOCAB, labels=2, channels=1, rank=2, topology=LENGTH_TOPOLOGIES[topology]).double()
    run = LENGTH_ENGINES[engine](crf)
    batched = run(tokens, mask)
    for row, length in enumerate(lengths):
        single = run(alone(tokens, mask, row)[0], torch.ones(1, length, dtype=torch.bool))
        got, want = node_rows(batched, row, length, crf), node_rows(single, 0, length, crf)
        for name in want:
            assert_same(got[name], want[name], f"{engine} {topology} {name}")


@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), padding=st.integers(0, 3))
def test_a_wrapped_stars_padded_rows_have_the_arcs_written_by_hand(lengths, padding):
    """Each row: its ring i <-> i + 1, the closing arc between its first and last tokens,
    every token <-> the relay (node n); nothing else, nothing on padding."""
    n = max(lengths) + padding
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    arcs = graphs.topology.parse("star(wrap=True)").arcs(mask)
    for row, length in enumerate(lengths):
        expected = set()
        for i in range(length):
            expected |= {(i, n), (n, i)}
            if i + 1 < length:
                expected |= {(i, i + 1), (i + 1, i)}
        if length > 1:
            expected |= {(0, length - 1), (length - 1, 0)}
        assert set(map(tuple, arcs[row].nonzero().tolist())) == expected


@pytest.mark.parametrize("topology", sorted(LENGTH_TOPOLOGIES))
def test_every_kernel_reads_each_rows_arcs_on_a_topology_of_the_sentence_length(topology):
    """The fused and flex kernels read each row's own token table: on a padded batch of mixed
    lengths their label logits (and the fused kernel's ELBO and gradients) are the naive kernel's."""
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0], [2, 0, 0, 0, 0]])
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] + [False] * 4])
    results = {}
    for kernel in ("naive", "fused", "flex"):
        torch.manual_seed(1)
        crf = graphs.CRF(vocab_size=VOCAB, labels=2, channels=2, rank=2, topology=LENGTH_TOPOLOGIES[topology]).double()
        engine = inference.MeanField(crf, iterations=3, kernel=kernel)
        assert engine.resolved_kernel(tokens.shape[1] + crf.topology.extra_nodes, tokens.device) == kernel
        with torch.set_grad_enabled(kernel != "flex"):  # flex trains on CUDA only
            post = engine(tokens, mask)
        results[kernel] = [post.logits]
        if kernel != "flex":
            (post.logits.sum() + post.elbo.sum()).backward()
            results[kernel] += [post.elbo, *(p.grad for p in crf.parameters())]
    for kernel in ("fused", "flex"):
        for got, want in zip(results[kernel], results["naive"]):
            assert_same(got.detach(), want.detach(), f"{kernel} {topology}")


def test_gibbs_answers_each_sentence_of_a_padded_batch_as_exact_answers_it_alone():
    """Gibbs runs one chain over the whole batch, so its draws depend on the batch; its answer
    for each sentence must still be that sentence's exact answer alone (the engines' law
    above), to a few Monte-Carlo standard errors. One run: JAX compiles per shape."""
    crf = tiny_crf()
    tokens = torch.tensor([[1, 4, 2, 7], [5, 3, 9, 9]])
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    batched = inference.Gibbs(crf, num_samples=600, num_warmup=100, num_chains=2, seed=3).sample(tokens, mask)
    for row, length in enumerate([4, 2]):
        exact = inference.Exact(crf)(*alone(tokens, mask, row))
        for name in ("z", "g"):
            got, want = getattr(batched.marginals, name)[row, :length], getattr(exact, name)[0].double()
            error = getattr(batched.standard_error, name)[row, :length]
            assert ((got - want).abs() <= 5 * error + 0.01).all(), (name, got, want)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.integers(0, 3))
@settings(max_examples=10)
def test_smc_filters_are_independent_of_their_batch(steps_of, extra):
    """SMC's weights, evidence and ESS of one filter do not depend on the others in its batch
    (no resampling: the run is deterministic)."""
    num_steps = max(steps_of) + extra
    scale = torch.tensor([float(s) for s in steps_of], dtype=torch.float64)

    def init(batch_size):
        return torch.linspace(-1, 1, 6, dtype=torch.float64).expand(batch_size, 6).clone()

    def step_for(scales):
        return lambda t, x: (x + 0.1, -((x * scales[:, None] * (t + 1)) ** 2) / 10)

    smc = inference.SMC(6, ess_threshold=0.0)
    batched = smc.filter(init, step_for(scale), num_steps, batch_size=len(steps_of))
    for row in range(len(steps_of)):
        single = smc.filter(init, step_for(scale[row : row + 1]), num_steps, batch_size=1)
        assert_same(batched.log_evidence[row], single.log_evidence[0], "log_evidence")
        assert_same(batched.log_weights[row], single.log_weights[0], "log_weights")
        assert_same(batched.ess[:, row], single.ess[:, 0], "ess")


# ---- the diagnostics' functions --------------------------------------------------------------


@given(st.lists(st.floats(-5, 5), min_size=1, max_size=40), st.integers(0, 10))
@settings(max_examples=40)
def test_ess_counts_padding_as_weight_zero(log_weights, padding):
    """Zeros add nothing; only the vectorised sum's order changes (round-off)."""
    real = torch.tensor(log_weights, dtype=torch.float64)
    padded = torch.cat([real, torch.full((padding,), -math.inf, dtype=torch.float64)])
    assert_same(ess(log_weights=padded), ess(log_weights=real), "ess(log_weights)", rtol=1e-14)
    assert_same(ess(padded.exp()), ess(real.exp()), "ess(weights)", rtol=1e-14)


@given(st.lists(st.floats(-6, 6), min_size=1, max_size=40), st.integers(0, 3))
@settings(max_examples=40)
def test_pareto_k_of_the_real_tokens_is_arviz_psislw_with_nan_under_the_minimum(log_weights, seed):
    """The oracle: ArviZ's psislw on the real draws; NaN under MIN_PSIS_DRAWS (21)."""
    import arviz as az

    real = np.asarray(log_weights) + np.random.default_rng(seed).normal(0, 1e-3, len(log_weights))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = pareto_k(torch.tensor(real)).k
        if len(real) < 21:
            assert np.isnan(found)
        else:
            _, expected = az.psislw(real, 1.0)
            assert_same(found, expected, "k-hat", rtol=1e-12, atol=1e-12)


def test_pareto_k_of_a_padded_sentence_is_fitted_on_its_real_tokens_only():
    """The issue's two cases through a model's measures: 10 real tokens give NaN, a 22-token
    sentence padded to 26 gives ArviZ's k-hat of its 22 real tokens."""
    import arviz as az

    from probformer.diagnostics.trace_measures import _pareto_k_per_sentence

    rng = np.random.default_rng(0)
    log_weights = torch.tensor(rng.standard_t(2, size=(1, 2, 26)))  # [L, B, n]
    mask = torch.zeros(2, 26, dtype=torch.bool)
    mask[0, :10], mask[1, :22] = True, True
    k_hat = _pareto_k_per_sentence(log_weights, mask, sentence_dim=1)
    assert np.isnan(k_hat[0, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, expected = az.psislw(log_weights[0, 1, :22].numpy(), 1.0)
    assert k_hat[0, 1] == pytest.approx(float(expected), rel=1e-12)


@given(st.integers(1, 6), st.integers(0, 4), st.integers(0, 2**16))
@settings(max_examples=30)
def test_diversity_of_a_padded_sentence_is_the_sentence_alone(length, padding, seed):
    hidden = torch.randn(1, length + padding, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(length + padding)[None] < length
    junk = hidden.masked_fill(~mask[..., None], 123.0)  # padding holds anything
    padded, single = diversity(junk, mask), diversity(hidden[:, :length])
    for name in ("cosine", "effective_rank", "rank_one_distance"):
        assert_same(getattr(padded, name), getattr(single, name), f"diversity {name}")
