"""torch.compile(model, fullgraph=True) compiles every model kind's forward without a graph
break (issue 19), and the compiled model gives the eager model's logits. Slow (a compile
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
    "pt (fused kernel)": lambda: ProbabilisticTransformer(
        PTConfig(vocab_size=20, labels=16, channels=2, rank=4, iterations=2, dropout=0.0, kernel="fused")
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
