"""Pyro's own variational inference on a CRF: the mean-field guide.

``mean_field_guide(crf, tokens, mask)`` returns a Pyro guide with one
``Categorical(logits=pyro.param(...))`` per latent site of ``crf.model`` (labels,
heads, globals), enumerated in parallel so that ``TraceEnum_ELBO`` computes the ELBO
exactly. (``TraceMeanField_ELBO`` rejects discrete guides; see research/ppl-apis.md.)
This is the slow reference ``MeanField`` is checked and timed against.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch

__all__ = ["mean_field_guide"]


def mean_field_guide(crf, tokens, mask=None):
    tokens, mask = crf.check_inputs(tokens, mask)
    B, n = tokens.shape
    N = crf.topology.num_nodes(n)
    arcs = crf.arc_mask(mask)
    sites = {f"z_{i}": (crf.labels, None) for i in range(N)}
    sites.update({f"g_{i}": (crf.global_labels, None) for i in range(n if crf.global_labels else 0)})
    for c in range(crf.channels):
        for i in range(N):
            legal = arcs[:, i]
            if legal.any():  # the model's head sites (rows without a legal head: uniform dummies)
                sites[f"h_{c}_{i}"] = (N, torch.where(legal | ~legal.any(-1, keepdim=True), 0.0, -math.inf))

    def guide(*args, **kwargs):
        with pyro.plate("batch", B, dim=-1):
            for name, (size, allowed) in sites.items():
                logits = pyro.param(f"q_{name}", torch.zeros(B, size))
                if allowed is not None:
                    logits = logits + allowed
                pyro.sample(name, dist.Categorical(logits=logits), infer={"enumerate": "parallel"})

    return guide
