"""torch.compile(model, fullgraph=True) compiles every model kind's forward without a graph
break, and the compiled model gives the eager model's logits. Slow (a compile
takes 20-120 s per model on 2 cores): `make test-slow`."""

from __future__ import annotations

import pytest
import torch

from probformer.models.baselines import Transformer, TransformerConfig
from probformer.models.folded_context import FoldedContext, FoldedContextConfig
from probformer.models.particle_transformer import ParticleConfig, ParticleTransformer
from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig
from probformer.models.swarmformer import SwarmConfig, SwarmFormer

MODELS = {
    "pt (naive kernel)": lambda: ProbabilisticTransformer(
        PTConfig(vocab_size=20, labels=16, channels=2, rank=4, iterations=2, dropout=0.0, kernel="naive")
    ),
    "pt (fused kernel)": lambda: ProbabilisticTransformer(  # rank 32 over 16 labels: at the label rank
        PTConfig(vocab_size=20, labels=16, channels=2, rank=32, iterations=2, dropout=0.0, kernel="fused")
    ),
    "particle_transformer": lambda: ParticleTransformer(ParticleConfig(vocab_size=20)),
    "transformer": lambda: Transformer(TransformerConfig(vocab_size=20)),
    "swarmformer": lambda: SwarmFormer(SwarmConfig(vocab_size=20)),
    "folded_context": lambda: FoldedContext(FoldedContextConfig(vocab_size=20)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_every_kind_compiles_without_graph_breaks(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    tokens = torch.randint(0, 20, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # a graph break raises instead of splitting
    with torch.no_grad():
        expected, got = model(tokens, mask), compiled(tokens, mask)
    logits = lambda out: out[0] if isinstance(out, tuple) else getattr(out, "logits", out)  # noqa: E731
    torch.testing.assert_close(logits(got)[mask], logits(expected)[mask], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("ternary_form", ["shared", "low_rank"])
def test_the_naive_kernel_trains_compiled_without_graph_breaks(ternary_form):
    """Training goes through the naive kernel's written-out backward passes
    (``inference.mean_field.kernels.null_softmax``): compiled with fullgraph=True, the loss and every gradient
    equal eager's."""
    torch.manual_seed(0)
    config = PTConfig(
        vocab_size=20,
        labels=16,
        channels=2,
        rank=4,
        iterations=3,
        dropout=0.0,
        kernel="naive",
        ternary_form=ternary_form,
    )
    model = ProbabilisticTransformer(config).train()
    tokens = torch.randint(0, 20, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False

    def loss_and_gradients(run):
        model.zero_grad()
        loss = run(tokens, mask)[0][mask].square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected, expected_grads = loss_and_gradients(model)
    torch._dynamo.reset()
    got, got_grads = loss_and_gradients(torch.compile(model, fullgraph=True))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(got_grads) == len(expected_grads) > 0
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
