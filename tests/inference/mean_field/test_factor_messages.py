"""MeanField on declared templates (Pairwise, user factors; inference.mean_field.factor_messages):
fixed-point equations written here, user messages as hand-written gradients, ELBO <= Exact's
log Z, and the templates' parameters trained."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from graphs.factors import Pairwise
from tests import oracles


class SameAsNext(graphs.Factor):
    """w per pair of neighbouring real tokens with equal labels; E_q = w sum_i q_i . q_{i+1}."""

    def __init__(self, weight=1.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(float(weight)))

    def log_potential(self, z, tokens, mask):
        n = tokens.shape[1]
        return self.weight * ((z[:, 1:n] == z[:, : n - 1]) & mask[:, 1:]).to(self.weight.dtype).sum(-1)

    def expected_log_potential(self, q, tokens, mask):
        n = tokens.shape[1]
        return self.weight * ((q[:, 1:n] * q[:, : n - 1]).sum(-1) * mask[:, 1:]).sum(-1)


class NoExpectation(graphs.Factor):
    def log_potential(self, z, tokens, mask):
        return (z[:, 0] == 1).double() * 0.3


class LengthBias(graphs.Factor):
    """log phi = w * (real tokens): reads no label. ``trainable=False``: a plain float w, so
    the potential needs no gradient at all."""

    def __init__(self, weight, trainable):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(weight, dtype=torch.float64)) if trainable else weight

    def log_potential(self, z, tokens, mask):
        return self.weight * mask.sum(-1).double()

    def expected_log_potential(self, q, tokens, mask):
        return self.weight * mask.sum(-1).double()


def chain_crf(d=3, weight=0.8, seed=0):
    """unary + chain Pairwise + SameAsNext, ternary zero on a chain (one head, no potential):
    the label updates are then the three messages alone."""
    torch.manual_seed(seed)
    crf = graphs.CRF(
        vocab_size=6, labels=d, channels=1, rank=1, topology="chain()", factors=[Pairwise(d), SameAsNext(weight)]
    ).double()
    with torch.no_grad():
        crf.ternary_u.zero_()
    return crf


def test_mean_field_fixed_point_satisfies_the_update_equations_written_here():
    crf = chain_crf()
    tokens = torch.tensor([[1, 4, 2, 5, 0]])
    engine = inference.MeanField(crf, iterations=60, schedule="sequential")
    with torch.no_grad():
        q = engine(tokens).z[0]
    S, P, w = crf.unary.detach()[tokens[0]], crf.factors[0].table.detach()[1], crf.factors[1].weight.item()
    n = tokens.shape[1]
    for i in range(n):  # arcs i -> i - 1: table[1][z_i, z_{i-1}]; SameAsNext: w (q_{i-1} + q_{i+1})
        logits = S[i].clone()
        if i > 0:
            logits += P @ q[i - 1] + w * q[i - 1]
        if i < n - 1:
            logits += P.T @ q[i + 1] + w * q[i + 1]
        torch.testing.assert_close(q[i], logits.softmax(-1), atol=1e-9, rtol=0)


def test_user_factor_message_is_the_gradient_written_by_hand():
    crf = chain_crf()
    tokens, mask = torch.tensor([[1, 4, 2]]), torch.tensor([[True, True, True]])
    q = torch.rand(1, 3, 3, dtype=torch.float64).softmax(-1)
    terms = inference.mean_field.factor_messages.FactorTerms([crf.factors[1]], tokens, mask, 3)
    w = crf.factors[1].weight.item()
    expected = w * torch.stack([q[0, 1], q[0, 0] + q[0, 2], q[0, 1]])
    torch.testing.assert_close(terms.message(q)[0], expected)


@settings(max_examples=12)
@given(
    topology=st.sampled_from(["full", "window(1)", "causal"]),
    pair_topology=st.sampled_from(["chain()", "window(1)", "full"]),
    global_labels=st.sampled_from([0, 2]),
    seed=st.integers(0, 2**16),
    schedule=st.sampled_from(["async", "parallel", "sequential"]),
)
def test_mean_field_elbo_with_extra_templates_is_below_exact_log_z(
    topology, pair_topology, global_labels, seed, schedule
):
    torch.manual_seed(seed)
    crf = graphs.CRF(
        vocab_size=5,
        labels=2,
        channels=1,
        rank=2,
        global_labels=global_labels,
        topology=topology,
        factors=[Pairwise(2, pair_topology, gamma=1), SameAsNext(1.5)],
    ).double()
    tokens = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(tokens, mask)
        post = inference.MeanField(crf, iterations=6, schedule=schedule)(tokens, mask)
    assert (post.elbo <= log_z + 1e-9).all()
    if schedule == "sequential":  # coordinate ascent never decreases the ELBO
        steps = post.trace["elbo_steps"]
        assert (steps[1:] >= steps[:-1] - 1e-9).all()


def test_mean_field_with_extra_templates_trains_their_parameters():
    crf = chain_crf().float()
    post = inference.MeanField(crf, iterations=3)(torch.tensor([[1, 4, 2]]))
    post.elbo.sum().backward()
    assert crf.factors[0].table.grad.abs().sum() > 0 and crf.factors[1].weight.grad.abs() > 0


def test_a_user_factor_without_expectation_is_refused_by_mean_field_and_accepted_by_exact():
    crf = graphs.CRF(vocab_size=4, labels=2, factors=[NoExpectation()])
    with pytest.raises(ValueError, match=r"MeanField cannot compile factor 'noexpectation0' \(NoExpectation\)"):
        inference.MeanField(crf)
    with pytest.raises(ValueError, match="engines that can: Exact, Gibbs"):
        inference.MeanField(crf)
    with torch.no_grad():
        assert torch.isfinite(inference.Exact(crf).log_partition(torch.tensor([[1, 2]]))).all()
    inference.Gibbs(crf)  # Gibbs needs log_potential alone


@settings(max_examples=10, deadline=None)
@given(
    weight=st.floats(-3.0, 3.0),
    trainable=st.booleans(),
    grad=st.booleans(),
    topology=st.sampled_from(["chain()", "full", "window(1) | root()"]),
    lengths=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_a_factor_that_reads_no_label_adds_its_constant_to_the_mean_field_elbo(
    weight, trainable, grad, topology, lengths, seed
):
    torch.manual_seed(seed)
    plain = graphs.CRF(vocab_size=5, labels=2, channels=1, rank=2, topology=topology).double()
    bias = LengthBias(weight, trainable)
    crf = graphs.CRF(vocab_size=5, labels=2, channels=1, rank=2, topology=topology, factors=[bias]).double()
    crf.load_state_dict(plain.state_dict(), strict=False)
    tokens = torch.randint(0, 5, (len(lengths), 3))
    mask = torch.arange(3)[None] < torch.tensor(lengths)[:, None]
    constant = torch.tensor([weight * length for length in lengths], dtype=torch.float64)
    log_z = torch.tensor(
        [oracles.brute_force(plain, t, m)[0] for t, m in zip(tokens.tolist(), mask.tolist())], dtype=torch.float64
    )
    engine, reference = (inference.MeanField(c, iterations=4, schedule="sequential") for c in (crf, plain))
    with torch.set_grad_enabled(grad):
        post, expected = engine(tokens, mask), reference(tokens, mask)
    # the message is zero: the same q as without the factor, and the ELBO gains the constant
    torch.testing.assert_close(post.z, expected.z)
    torch.testing.assert_close(post.elbo, expected.elbo + constant)
    assert (post.elbo <= log_z + constant + 1e-9).all()  # below the log Z of brute force
    if grad and trainable:
        post.elbo.sum().backward()
        torch.testing.assert_close(crf.factors[0].weight.grad, torch.tensor(float(sum(lengths)), dtype=torch.float64))
