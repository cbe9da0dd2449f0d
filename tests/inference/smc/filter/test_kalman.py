"""The SMC filter (inference.smc.filter) against an exact oracle, the Kalman filter
(tests/oracles.py): the bias-corrected log-evidence and the filtering means at the last step
agree within three standard errors, and the log-evidence error shrinks with more particles."""

import math

import pytest
import torch

from inference import SMC
from tests.builders import lgssm
from tests.inference.smc.filter.bootstrap import bootstrap
from tests.oracles import kalman


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
