"""The shared ternary form (``graphs.ternary``, "shared"): one U, V per channel for every
distance group plus a bias per group and channel on the head logits.

Oracles: log Z by brute force written here from U, V and the bias (not from the CRF's
factors); the ELBO below it; the naive kernel (materialised P) for the fused one; a
low-rank CRF holding the same tables per group for the shared projection path."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from inference.mean_field.kernels import head_kernels
from tests.builders import shared_crf
from tests.oracles import group_of

torch.set_num_threads(1)


def brute_force_log_z(crf, tokens: list[int], gamma: int) -> float:
    """log Z of one unpadded sentence: sum over every labelling, heads summed out per
    (node, channel) from T[k, c, a, b] = U[c, a] . V[c, b] + bias[k, c]."""
    n = len(tokens)
    N = crf.topology.num_nodes(n)
    arcs = crf.topology.mask(n)
    U, V, bias = crf.shared_u.detach(), crf.shared_v.detach(), crf.shared_bias.detach()
    total = []
    for z in itertools.product(range(crf.labels), repeat=N):
        score = sum(crf.unary[tokens[i], z[i]].item() for i in range(n))
        for i in range(N):
            for c in range(crf.channels):
                heads = [j for j in range(N) if arcs[i, j]]
                if heads:
                    arc = [(U[c, z[i]] @ V[c, z[j]] + bias[group_of(i, j, n, gamma), c]).item() for j in heads]
                    score += math.log(sum(math.exp(a) for a in arc))
        total.append(score)
    top = max(total)
    return top + math.log(sum(math.exp(s - top) for s in total))


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(["full", "full | root()", "star()", "window(1)"]), st.integers(0, 10**6), st.integers(2, 4))
def test_exact_log_z_equals_brute_force_and_bounds_the_elbo(topology, seed, n):
    crf = shared_crf(labels=2, gamma=1, topology=topology, seed=seed, bias_std=2.0)
    tokens = torch.randint(0, 7, (1, n), generator=torch.Generator().manual_seed(seed))
    log_z = inference.Exact(crf).log_partition(tokens)
    assert log_z.item() == pytest.approx(brute_force_log_z(crf, tokens[0].tolist(), gamma=1), abs=1e-9)
    for schedule in ("async", "sequential"):
        elbo = inference.MeanField(crf, iterations=3, schedule=schedule, weights="crf")(tokens).elbo
        assert (elbo <= log_z + 1e-9).all()


def batch(size=3, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 7, (size, length), generator=generator)
    lengths = torch.randint(1, length + 1, (size,), generator=generator)
    lengths[0] = length
    return tokens, torch.arange(length)[None] < lengths[:, None]


def outputs(engine, tokens, mask):
    """The label marginals, the ELBO, and every parameter's gradient of a loss reading both."""
    posterior = engine(tokens, mask)
    probe = torch.randn(posterior.z.shape, generator=torch.Generator().manual_seed(1), dtype=posterior.z.dtype)
    loss = (posterior.logits * probe).sum() + posterior.elbo.sum()
    grads = torch.autograd.grad(loss, list(engine.crf.parameters()))
    return posterior.logits, posterior.elbo, grads


CASES = [  # (topology, schedule, global labels)
    ("full", "async", 0),
    ("full", "parallel", 0),
    ("full | root()", "macaron", 2),
    ("star()", "async", 2),
    ("window(2) | root()", "parallel", 0),
]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("topology, schedule, global_labels", CASES)
def test_fused_equals_naive_with_bias(topology, schedule, global_labels, dtype, tolerance):
    crf = shared_crf(labels=4, rank=3, gamma=2, topology=topology, global_labels=global_labels).to(dtype)
    tokens, mask = batch(length=11)
    found = {}
    for kernel in ("naive", "fused"):
        engine = inference.MeanField(crf, iterations=3, schedule=schedule, kernel=kernel, weights="reference")
        found[kernel] = outputs(engine, tokens, mask)
    (logits, elbo, grads), (logits_f, elbo_f, grads_f) = found["naive"], found["fused"]
    torch.testing.assert_close(logits_f, logits, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(elbo_f, elbo, atol=tolerance * 10, rtol=tolerance)
    for grad, grad_f in zip(grads, grads_f):
        torch.testing.assert_close(grad_f, grad, atol=tolerance * 10, rtol=tolerance)


def per_group_copy(crf, rank_extra: bool):
    """A low-rank CRF holding the shared form per group: with ``rank_extra`` the exact
    rank r + 1 equivalent (the bias in a last column), else the plain U, V copies."""
    folded_u, folded_v = crf.ternary_factors()
    rank = folded_u.shape[-1] if rank_extra else crf.rank
    low_rank = graphs.CRF(
        vocab_size=7,
        labels=crf.labels,
        channels=crf.channels,
        rank=rank,
        gamma=crf.gamma,
        topology=crf.topology,
        global_labels=crf.global_labels,
    ).double()
    K = crf.num_groups
    with torch.no_grad():
        low_rank.unary.copy_(crf.unary)
        if crf.global_labels:
            low_rank.binary.copy_(crf.binary)
        if rank_extra:
            low_rank.ternary_u.copy_(folded_u)
            low_rank.ternary_v.copy_(folded_v)
        else:
            low_rank.ternary_u.copy_(crf.shared_u.expand(K, -1, -1, -1))
            low_rank.ternary_v.copy_(crf.shared_v.expand(K, -1, -1, -1))
    return low_rank


@pytest.mark.parametrize("schedule", ["async", "parallel", "macaron", "sequential"])
@pytest.mark.parametrize("topology", ["full", "star()"])
def test_shared_projections_equal_the_per_group_form(schedule, topology):
    """bias 0: exactly the low-rank form with U, V copied into every group (same logits);
    any bias, CRF weights: the rank r + 1 form (same marginals and ELBO; label logits may
    differ by a constant per node, the bias's message, which no softmax sees)."""
    crf = shared_crf(labels=3, rank=2, gamma=1, topology=topology, global_labels=2, bias_std=0.0)
    tokens, mask = batch(length=6)
    options = dict(iterations=2, schedule=schedule, kernel="naive", weights="reference")
    shared, copied = (inference.MeanField(c, **options)(tokens, mask) for c in (crf, per_group_copy(crf, False)))
    torch.testing.assert_close(shared.logits, copied.logits, atol=1e-12, rtol=0)
    if schedule == "parallel":
        # the Jacobi start (zero projections: no label information) keeps the bias, a potential
        # on the heads alone, where the rank r + 1 form's last column is zeroed with the rest
        return
    with torch.no_grad():
        crf.shared_bias.normal_()
    options["weights"] = "crf"
    shared, folded = (inference.MeanField(c, **options)(tokens, mask) for c in (crf, per_group_copy(crf, True)))
    torch.testing.assert_close(shared.z, folded.z, atol=1e-12, rtol=0)
    torch.testing.assert_close(shared.elbo, folded.elbo, atol=1e-12, rtol=0)


def test_projections_are_shared_and_the_bound_counts_the_bias():
    crf = shared_crf(labels=5, channels=3, rank=4, gamma=3)
    engine = inference.MeanField(crf, kernel="fused")
    query, key = engine.project(torch.rand(2, 6, 5, dtype=torch.float64))
    assert query.shape == key.shape == (2, 6, 1, 3, 4)  # one projection per channel, not per group
    u, v, bias = crf.projection_tables()
    assert bias.shape == (crf.num_groups, 3)
    bound = head_kernels.score_bound(u, v, bias, scale=2.0)
    assert bound.item() == pytest.approx(2 * head_kernels.score_bound(u, v).item() + bias.abs().max().item())
    with torch.no_grad():  # a bias past the float32 limit alone asks for float64
        crf.shared_u.mul_(1e-3)
        crf.shared_bias.fill_(600.0)
    assert engine.fused_compute_dtype(1.0) == torch.float64
    with torch.no_grad():
        crf.shared_bias.fill_(1.0)
    assert engine.fused_compute_dtype(1.0) is None


def test_auto_kernel_keeps_the_shared_form_materialised_up_to_512_nodes():
    cpu = torch.device("cpu")
    if not head_kernels.fused_available(cpu):
        pytest.skip("no CPU flash kernel: auto is always naive here")
    shared = inference.MeanField(shared_crf())
    grouped = inference.MeanField(graphs.CRF(vocab_size=7, labels=3, channels=2, rank=2))
    assert [shared.resolved_kernel(n, cpu) for n in (128, 512, 513)] == ["naive", "naive", "fused"]
    assert [grouped.resolved_kernel(n, cpu) for n in (128, 129)] == ["naive", "fused"]
