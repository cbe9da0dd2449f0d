"""The tiny source models the export tests export, one maker per kind (the PT with any
topology, schedule or option), ``KINDS`` (one configuration of each kind, the one
``every_export`` exports), ``FILES`` (the file each format writes), the padded batches of
several shapes they are checked on, and the check that an artefact reproduces its source
model within ``TOLERANCE``."""

import torch

import probformer
from probformer.models.baselines import Transformer, TransformerConfig

torch.set_num_threads(1)


VOCAB = 40


TOLERANCE = 1e-5


def pt(topology="full", mup=False, schedule="async", **overrides):
    config = dict(vocab_size=VOCAB, labels=12, channels=2, rank=3, global_labels=3, gamma=1, iterations=2)
    config.update(topology=topology, schedule=schedule, mup=mup, mup_base_width=6 if mup else 0, **overrides)
    torch.manual_seed(0)
    return probformer.ProbabilisticTransformer(probformer.PTConfig(**config)).eval()


def particle():
    torch.manual_seed(0)
    config = probformer.ParticleConfig(
        vocab_size=VOCAB, width=16, heads=2, layers=3, ffn_width=32, max_length=20, resample_every=1, ess_threshold=0.9
    )
    return probformer.ParticleTransformer(config).eval()


def transformer(norm="pre", universal=False):
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=VOCAB, width=16, heads=2, layers=2, ffn_width=32, max_length=20, norm=norm, universal=universal
    )
    return Transformer(config).eval()


def batches(seed=0):
    """Random batches of several shapes; every row but the first is padded at random."""
    generator = torch.Generator().manual_seed(seed)
    for size, length in [(1, 1), (3, 6), (4, 13), (2, 20)]:
        tokens = torch.randint(0, VOCAB, (size, length), generator=generator)
        lengths = torch.randint(1, length + 1, (size,), generator=generator)
        lengths[0] = length
        yield tokens, torch.arange(length)[None, :] < lengths[:, None]


def assert_reproduces(model, artefact):
    for tokens, mask in batches():
        with torch.no_grad():
            expected, found = model(tokens, mask)[0], artefact(tokens, mask)
        assert found.shape == expected.shape and found.dtype == expected.dtype
        assert (found - expected).abs().max().item() <= TOLERANCE


def swarm():
    torch.manual_seed(0)
    config = probformer.SwarmConfig(vocab_size=VOCAB, width=16, heads=2, layers=3, ffn_width=32, max_length=20)
    return probformer.SwarmFormer(config).eval()


def folded(folded=True):
    torch.manual_seed(0)
    config = probformer.FoldedContextConfig(
        vocab_size=VOCAB, width=16, heads=2, ffn_width=32, segment=4, local_layers=1, global_layers=1, folded=folded
    )
    return probformer.FoldedContext(config).eval()


KINDS = {
    # rank 16 over 12 labels: traced at the label rank (projections.at_label_rank); traced at a
    # rank below the labels: docs/export.md's snippets (4 over 16) and the slow variants below
    "probabilistic_transformer": lambda: pt("window(2) | star(wrap=True)", mup=True, rank=16),
    "particle_transformer": particle,
    "transformer": lambda: transformer("post", universal=True),
    "swarmformer": swarm,
    "folded_context": folded,
}


FILES = {"torch": "model", "exported": "model.pt2", "onnx": "model.onnx"}
