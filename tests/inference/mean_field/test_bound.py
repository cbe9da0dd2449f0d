"""The ELBO (inference.mean_field.bound) stays below log Z: against brute force in the shared
ternary form (written here from U, V and the bias), at extreme potentials, and counting the
shared form's bias."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import inference
from inference.mean_field.engine import MeanField
from inference.mean_field.kernels import head_kernels
from tests.builders import shared_crf
from tests.oracles import group_of
from tests.strategies import scaled_crfs

pytestmark = pytest.mark.usefixtures("keep_global_rng")


# ---- Exact ------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(data=scaled_crfs())
def test_mean_field_elbo_stays_below_exact_log_partition_at_extreme_potentials(data):
    crf, tokens, mask = data
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(tokens, mask)
        elbo32 = MeanField(crf, iterations=20, schedule="sequential")(tokens, mask).elbo
        elbo64 = MeanField(crf.double(), iterations=20, schedule="sequential")(tokens, mask).elbo
    assert torch.isfinite(log_z).all()
    # the float64 ELBO to float64 rounding; the float32 one to its own rounding (at large
    # potentials mean field is nearly exact, so it sits within rounding of log Z)
    assert (elbo64 <= log_z + 1e-9 * log_z.abs().clamp_min(1)).all(), (elbo64, log_z)
    assert (elbo32.double() <= log_z + 1e-5 * log_z.abs().clamp_min(1)).all(), (elbo32, log_z)


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
