"""probformer: transformers from inference.

Models (the Probabilistic Transformer, the Particle Transformer, baselines),
μP, diagnostics, data, training, export and the CLI, built on ``graphs``
(declarations) and ``inference`` (engines).

Names are imported on first use, so ``probformer.load`` of an exported model works
where pyro, numpyro, jax, arviz and networkx are not installed.
"""

import importlib

__version__ = "0.1.0"

_HOMES = {
    "PTConfig": "probformer.models.probabilistic_transformer",
    "ProbabilisticTransformer": "probformer.models.probabilistic_transformer",
    "ParticleConfig": "probformer.models.particle_transformer",
    "ParticleTransformer": "probformer.models.particle_transformer",
    "SwarmConfig": "probformer.models.swarmformer",
    "SwarmFormer": "probformer.models.swarmformer",
    "FoldedContextConfig": "probformer.models.folded_context",
    "FoldedContext": "probformer.models.folded_context",
    "RecallTask": "probformer.training.recall",
    "TaskHead": "probformer.models.blocks",
    "PTLayer": "probformer.models.pt_layer",
    "TransformerConfig": "probformer.models.baselines",
    "Transformer": "probformer.models.baselines",
    "export": "probformer.deploy",
    "load": "probformer.deploy",
    "save_pretrained": "probformer.models.pretrained",
    "from_pretrained": "probformer.models.pretrained",
    "PretrainedMixin": "probformer.models.pretrained",
}
_MODULES = ("models", "training", "deploy", "diagnostics", "mup")
__all__ = sorted(_HOMES) + list(_MODULES)


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"probformer.{name}")
    else:
        raise AttributeError(f"module 'probformer' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
