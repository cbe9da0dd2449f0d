"""probformer: transformers from inference.

Models (the Probabilistic Transformer, the Particle Transformer, baselines),
μP, diagnostics, data, training, export and the CLI, built on ``graphs``
(declarations) and ``inference`` (engines).
"""

__version__ = "0.1.0"
