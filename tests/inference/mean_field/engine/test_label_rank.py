"""A rank above the label count: ``MeanField`` computes with the same ternary tensor ``T``
at rank d (``projections.at_label_rank``). Oracles: the reference algorithm (logits and the
gradients of U and V), the mean-field update equations written from ``T``
(``tests/oracles.py``, every ternary form), and the same engine at the declared rank (every
kernel, schedule, form and topology, values and gradients), a path this folder checks
against its oracles at d >= r."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference.mean_field.engine as engine_module
from inference import MeanField
from tests import oracles
from tests.reference_pt import reference_logits

FORMS = {"low_rank": {}, "shared": {}, "cp": {}, "tucker": {"ternary_blocks": 2}}


def crf_at(form: str, rank: int, topology: str, labels: int = 3, seed: int = 0, scale: float = 1.0):
    """A float64 CRF of ``form``, every parameter (the shared form's head bias included)
    drawn at ``scale``."""
    crf = graphs.CRF(
        vocab_size=6,
        labels=labels,
        channels=2,
        rank=rank,
        global_labels=2,
        topology=topology,
        gamma=2,
        ternary_form=form,
        **FORMS[form],
    ).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in crf.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return crf


@pytest.mark.parametrize("kernel", ["naive", "fused"])
def test_a_rank_above_the_label_count_gives_the_reference_logits_and_gradients(kernel):
    torch.manual_seed(5)
    d, r, h, n = 3, 7, 2, 6
    crf = graphs.CRF(vocab_size=20, labels=d, channels=h, rank=r, topology="full", gamma=2).double()
    tokens = torch.randint(0, 20, (2, n))
    mask = torch.arange(n)[None] < torch.tensor([[n], [4]])
    weights = torch.randn(2, n, d, dtype=torch.float64)
    factors = (crf.ternary_u, crf.ternary_v)
    ours = MeanField(crf, iterations=3, weights="reference", kernel=kernel)(tokens, mask).logits
    our_grads = torch.autograd.grad((ours * weights)[mask].sum(), factors)
    U, V = crf.ternary_u.permute(0, 2, 3, 1), crf.ternary_v.permute(0, 2, 3, 1)  # the reference's layout
    theirs = reference_logits(crf.unary[tokens].detach(), mask, U, V, 3, d)
    their_grads = torch.autograd.grad((theirs * weights)[mask].sum(), factors)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-10, rtol=1e-10)
    for mine, reference in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, reference, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("form", ["shared", "cp", "tucker"])
@pytest.mark.parametrize("topology", ["full", "segments(2)", "window(1) | root()"])
def test_every_ternary_form_above_the_labels_converges_to_the_update_equations(form, topology):
    crf = crf_at(form, rank=5, topology=topology, scale=0.4)  # a contraction: one fixed point
    tokens = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 0]])
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    with torch.no_grad():
        post = MeanField(crf, iterations=60, schedule="sequential")(tokens, mask)
    assert post.trace["max_delta"][-1].max() < 1e-10
    for b in range(2):
        update = oracles.mean_field_update(crf, tokens[b].tolist(), mask[b].tolist(), post.z[b])
        torch.testing.assert_close(post.z[b], update, atol=1e-9, rtol=0)


def _run(crf, tokens, mask, direction, options):
    crf.zero_grad()
    post = MeanField(crf, **options)(tokens, mask)
    ((post.logits * direction).sum() + post.elbo.sum()).backward()
    return [post.logits.detach(), post.elbo.detach(), post.h.detach()] + [p.grad.clone() for p in crf.parameters()]


@settings(max_examples=40, deadline=None)
@given(
    form=st.sampled_from(sorted(FORMS)),
    kernel=st.sampled_from(["naive", "fused"]),
    schedule=st.sampled_from(["async", "parallel", "sequential", "macaron"]),
    topology=st.sampled_from(["full", "causal", "window(2)", "segments(3)", "full | root()", "clusters(2)"]),
    n=st.integers(1, 8),
    seed=st.integers(0, 1000),
)
def test_the_label_rank_equals_the_declared_rank_in_values_and_gradients(form, kernel, schedule, topology, n, seed):
    if kernel == "fused" and schedule == "sequential":
        kernel = "naive"  # the fused kernel refuses the sequential schedule
    crf = crf_at(form, rank=5, topology=topology, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6, (2, n), generator=generator)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, max(1, n // 2) :] = False
    direction = torch.randn(2, crf.topology.num_nodes(n), 3, generator=generator, dtype=torch.float64)
    options = dict(iterations=2, schedule=schedule, kernel=kernel, weights="reference")
    at_label_rank = _run(crf, tokens, mask, direction, options)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "at_label_rank", lambda u, v: (u, v))  # the declared rank
        declared = _run(crf, tokens, mask, direction, options)
    for mine, theirs in zip(at_label_rank, declared, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-9, rtol=1e-9)
