import pytest
import torch
from hypothesis import given, settings

import graphs
import inference
from tests import oracles
from tests.strategies import tiny_crfs


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
        monkeypatch.setattr("inference.exact._MAX_BUCKET", 2**7)  # a few sentences per chunk at most
        chunked = inference.Exact(crf).marginals(tokens, mask)
    torch.testing.assert_close(chunked.log_partition, whole.log_partition, rtol=1e-12, atol=0)
    torch.testing.assert_close(chunked.z, whole.z)
    torch.testing.assert_close(chunked.h, whole.h)


def test_refuses_a_plan_whose_largest_bucket_is_too_large_before_computing():
    crf = graphs.CRF(vocab_size=5, labels=4, channels=1)
    with pytest.raises(ValueError, match=r"factor of \d+ entries per sentence, above the limit"):
        inference.Exact(crf, max_configurations=2**40).log_partition(torch.zeros(1, 12, dtype=torch.long))
