"""Inputs on another device than the model (or a mask on another device than its tokens)
are refused by name in every model and engine, before any operation meets the two: they
failed inside torch with "Tensor on device meta is not on the expected device cpu!". The
meta device stands in here for a GPU the inputs were not moved to."""

from __future__ import annotations

import pytest
import torch

import graphs
import inference
import probformer

V = 11


def models():
    torch.manual_seed(0)
    small = {"vocab_size": V, "dropout": 0.0}
    return {
        "pt": probformer.ProbabilisticTransformer(
            probformer.PTConfig(**small, labels=4, channels=2, rank=2, iterations=1)
        ),
        "particle": probformer.ParticleTransformer(
            probformer.ParticleConfig(**small, width=8, heads=2, layers=2, ffn_width=16, max_length=16)
        ),
        "swarm": probformer.SwarmFormer(
            probformer.SwarmConfig(**small, width=8, heads=2, layers=2, ffn_width=16, clusters=2, max_length=16)
        ),
        "folded": probformer.FoldedContext(
            probformer.FoldedContextConfig(
                vocab_size=V, width=8, heads=2, local_layers=1, global_layers=1, ffn_width=16, segment=3
            )
        ),
        "transformer": probformer.Transformer(
            probformer.TransformerConfig(**small, width=8, heads=2, layers=2, ffn_width=16, max_length=16)
        ),
    }


MODELS = models()
TOKENS = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
MASK = torch.ones(2, 6, dtype=torch.bool)


@pytest.mark.parametrize("kind", list(MODELS))
def test_tokens_on_another_device_than_the_model_are_refused_by_name(kind):
    model = MODELS[kind].eval()
    with pytest.raises(ValueError, match=r"tokens must be on the model's device cpu, got meta"):
        model(TOKENS.to("meta"), MASK.to("meta"))
    with pytest.raises(ValueError, match=r"mask must be on the tokens' device cpu, got meta"):
        model(TOKENS, MASK.to("meta"))
    with torch.no_grad():
        model(TOKENS, MASK)  # the same inputs on the model's device run


def test_a_stream_chunk_on_another_device_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tokens must be on the model's device cpu, got meta"):
        list(MODELS["folded"].eval().stream([TOKENS.to("meta")]))


def test_the_engines_refuse_tokens_and_embeddings_on_another_device_by_name():
    crf = graphs.CRF(vocab_size=V, labels=3, channels=2, rank=2)
    with pytest.raises(ValueError, match=r"tokens must be on the model's device cpu, got meta"):
        inference.MeanField(crf)(TOKENS.to("meta"))
    with pytest.raises(ValueError, match=r"tokens must be on the model's device cpu, got meta"):
        inference.Exact(graphs.CRF(vocab_size=V, labels=2, topology="chain()")).log_partition(TOKENS.to("meta"))
    with pytest.raises(ValueError, match=r"mask must be on the tokens' device cpu, got meta"):
        inference.MeanField(crf)(TOKENS, MASK.to("meta"))
    embedded = graphs.CRF(embedding_size=5, labels=3)
    with pytest.raises(ValueError, match=r"embeddings must be on the model's device cpu, got meta"):
        inference.MeanField(embedded)(embeddings=torch.randn(2, 6, 5, device="meta"))
    with pytest.raises(ValueError, match=r"mask must be on the embeddings' device cpu, got meta"):
        inference.MeanField(embedded)(embeddings=torch.randn(2, 6, 5), mask=MASK.to("meta"))
    with pytest.raises(ValueError, match=r"hidden must be on the model's device cpu, got meta"):
        probformer.PTLayer(5, labels=3, channels=1, rank=2)(torch.randn(2, 6, 5, device="meta"))


def test_a_model_on_meta_takes_meta_inputs():
    """No device is refused as such: inputs on the model's own device pass."""
    with torch.device("meta"):
        crf = graphs.CRF(vocab_size=V, labels=3, channels=2, rank=2)
    assert crf.check_inputs(TOKENS.to("meta"))[0].device.type == "meta"
