"""probformer: transformers from inference.

Models (the Probabilistic Transformer, the Particle Transformer, baselines),
μP, diagnostics, data, training, export and the CLI, built on ``graphs``
(declarations) and ``inference`` (engines).
"""

from probformer import diagnostics
from probformer.heads import TaskHead
from probformer.particle_transformer import ParticleConfig, ParticleTransformer
from probformer.probabilistic_transformer import ProbabilisticTransformer, PTConfig

__version__ = "0.1.0"
__all__ = ["ParticleConfig", "ParticleTransformer", "ProbabilisticTransformer", "PTConfig", "TaskHead", "diagnostics"]
