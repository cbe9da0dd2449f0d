"""Every engine answers the same call with an ``inference.Posterior``."""

import pytest
import torch

import graphs
import inference
from graphs.factors import Pairwise


@pytest.mark.parametrize("with_gibbs", [False, pytest.param(True, marks=pytest.mark.slow)])  # JAX compiles: slow
def test_every_engine_answers_the_same_call_with_a_posterior(with_gibbs):
    crf = graphs.CRF(vocab_size=5, labels=2, channels=1, topology="window(1)", factors=[Pairwise(2)]).double()
    tokens = torch.tensor([[1, 2, 3]])
    posts = {"Exact": inference.Exact(crf)(tokens), "MeanField": inference.MeanField(crf, iterations=4)(tokens)}
    if with_gibbs:
        posts["Gibbs"] = inference.Gibbs(crf, num_samples=50, num_warmup=10, num_chains=1)(tokens)
    for name, post in posts.items():
        assert isinstance(post, inference.Posterior), name
        assert post.z.shape == (1, 3, 2) and post.h.shape == (1, 1, 3, 3), name
        assert post.g is None, name
    assert posts["Exact"].log_partition is not None and posts["MeanField"].elbo is not None
    assert posts["MeanField"].log_partition is None and posts["Exact"].elbo is None
