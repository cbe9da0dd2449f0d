"""Embeddings in: CRF(embedding_size=D) reads x [B, n, D] through unary [D, d];
one-hot embeddings with the token-id CRF's table give exactly its posterior."""

import pytest
import torch
import torch.nn.functional as F

import graphs
import inference


def twin_crfs(vocab=7, **kwargs):
    torch.manual_seed(0)
    by_id = graphs.CRF(vocab_size=vocab, labels=4, channels=2, rank=2, global_labels=3, **kwargs)
    by_embedding = graphs.CRF(embedding_size=vocab, labels=4, channels=2, rank=2, global_labels=3, **kwargs)
    by_embedding.load_state_dict(by_id.state_dict())
    return by_id, by_embedding


@pytest.mark.parametrize("kernel", ["naive", "fused"])
@pytest.mark.parametrize("mup", [False, True])
@pytest.mark.parametrize("topology", ["full", "window(1) | star()"])
def test_one_hot_embeddings_give_exactly_the_token_posterior(kernel, mup, topology):
    by_id, by_embedding = twin_crfs(topology=topology)
    tokens = torch.tensor([[1, 6, 3, 0], [2, 5, 4, 4]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    one_hot = F.one_hot(tokens, 7).float()
    options = dict(iterations=3, kernel=kernel, mup=mup)
    with torch.no_grad():
        expected = inference.MeanField(by_id, **options)(tokens, mask)
        found = inference.MeanField(by_embedding, **options)(embeddings=one_hot, mask=mask)
    assert torch.equal(found.z, expected.z) and torch.equal(found.logits, expected.logits)
    assert torch.equal(found.g, expected.g) and torch.equal(found.elbo, expected.elbo)


def test_embedding_unary_is_x_times_the_table_and_gradients_reach_the_embeddings():
    _, crf = twin_crfs()
    x = torch.randn(2, 3, 7, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, True]])
    table = crf.embedding_table(x, mask)
    expected = torch.einsum("bnD,Dd->bnd", x, crf.unary) * mask[..., None]
    torch.testing.assert_close(table, expected)
    z = inference.MeanField(crf, iterations=2)(embeddings=x, mask=mask).z
    (z * torch.arange(4.0)).sum().backward()  # rows of z sum to 1: weight the labels
    assert x.grad is not None and x.grad[0].abs().sum() > 0


def test_embedding_and_token_inputs_are_refused_where_they_do_not_belong():
    by_id, by_embedding = twin_crfs()
    with pytest.raises(ValueError, match="give exactly one of vocab_size .* and embedding_size"):
        graphs.CRF(vocab_size=5, embedding_size=5, labels=2)
    with pytest.raises(ValueError, match="this CRF reads embeddings .* pass embeddings="):
        inference.MeanField(by_embedding)(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="this CRF reads token ids"):
        inference.MeanField(by_id)(embeddings=torch.zeros(1, 2, 7))
    with pytest.raises(ValueError, match=r"embeddings must have shape \[batch, length, 7\]"):
        inference.MeanField(by_embedding)(embeddings=torch.zeros(1, 2, 5))
    with pytest.raises(TypeError, match="embeddings must be a floating"):
        inference.MeanField(by_embedding)(embeddings=torch.zeros(1, 2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="this CRF reads embeddings"):
        inference.Exact(by_embedding).log_partition(torch.tensor([[1, 2]]))


class EmbeddingGate(graphs.Factor):
    """A user factor that reads the embeddings: label 1 scores the first coordinate of x_i."""

    def log_potential(self, z, inputs, mask):
        n = inputs.shape[1]
        return ((z[:, :n] == 1) * inputs[..., 0] * mask).sum(-1)

    def expected_log_potential(self, q, inputs, mask):
        n = inputs.shape[1]
        return (q[:, :n, 1] * inputs[..., 0] * mask).sum(-1)


def test_exact_on_one_hot_embeddings_equals_exact_on_token_ids():
    by_id, by_embedding = twin_crfs(topology="window(1)")
    tokens = torch.tensor([[1, 6, 3], [2, 5, 4]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        expected = inference.Exact(by_id)(tokens, mask)
        found = inference.Exact(by_embedding)(embeddings=F.one_hot(tokens, 7).float(), mask=mask)
    assert torch.equal(found.log_partition, expected.log_partition) and torch.equal(found.z, expected.z)


def test_mean_field_elbo_on_embeddings_with_extra_factors_is_below_exact_log_z():
    torch.manual_seed(3)
    crf = graphs.CRF(
        embedding_size=5,
        labels=2,
        channels=1,
        rank=2,
        topology="window(1)",
        factors=[graphs.factors.Pairwise(2, "chain()"), EmbeddingGate()],
    ).double()
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        log_z = inference.Exact(crf).log_partition(embeddings=x, mask=mask)
        post = inference.MeanField(crf, iterations=30, schedule="sequential")(embeddings=x, mask=mask)
    assert (post.elbo <= log_z + 1e-9).all()


@pytest.mark.slow  # JAX compiles the sampler and the callback: ~10 s idle
def test_gibbs_on_embeddings_with_a_user_factor_agrees_with_exact():
    torch.manual_seed(4)
    crf = graphs.CRF(embedding_size=4, labels=2, channels=1, rank=2, topology="window(1)", factors=[EmbeddingGate()])
    x = 2 * torch.randn(2, 3, 4)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        exact = inference.Exact(crf)(embeddings=x, mask=mask)
    result = inference.Gibbs(crf, num_samples=1500, num_warmup=200, seed=1).sample(embeddings=x, mask=mask)
    p = exact.z.double()
    se = torch.sqrt((p * (1 - p)).clamp(min=0) / result.effective_sample_size.z).clamp(min=1e-6)
    assert ((result.marginals.z - p).abs() / se).max() < 4 and result.rhat < 1.05
