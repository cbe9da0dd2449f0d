"""The bootstrap particle filter of a linear-Gaussian state-space model (tests/builders.py's
``lgssm``) as the init/step callables ``SMC.filter`` takes: particles drawn from the prior
and moved by the transition, weighted by the observation density."""

import torch


def bootstrap(ys, A, Q, H, R, m0, P0, N, generator, means=None):
    """init/step callables of the bootstrap filter for the LGSSM."""
    dim = len(m0)
    q, r = torch.linalg.cholesky(Q), torch.distributions.MultivariateNormal(torch.zeros(dim, dtype=R.dtype), R)

    def init(B):
        return m0 + torch.randn(B, N, dim, generator=generator, dtype=torch.float64) @ torch.linalg.cholesky(P0).T

    def step(t, x):
        x = x @ A.T + torch.randn(x.shape, generator=generator, dtype=torch.float64) @ q.T
        increment = r.log_prob(ys[t] - x @ H.T)
        if means is not None:
            means.append(x)
        return x, increment

    return init, step
