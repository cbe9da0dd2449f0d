"""The trainable models, each in one file with the same shape (a config dataclass, the
model, a task head): the Probabilistic Transformer, the Particle Transformer, the
BERT-style / Universal-Transformer baselines, SwarmFormer and FoldedContext, built
from the shared blocks in ``probformer.models.blocks`` and the μP parametrisation in
``probformer.models.mup_parametrization``."""
