"""graphs: declare factor graphs (the PT CRF, its factor templates, topologies) as data
and as Pyro models.

``graphs`` never imports ``inference`` or ``probformer``. Importing it imports torch
alone: Pyro is imported when a Pyro model is generated (``CRF.model``,
``ParticleView``), networkx when a topology is drawn as a graph, so the tensors a
trained model needs (potentials, masks, distance groups) run without either.
"""

import importlib

from graphs import factors, ternary, topology
from graphs.crf import CRF, GLOBAL_MEMORIES, TERNARY_FORMS, distance_groups
from graphs.factors import Factor
from graphs.topology import Topology

__all__ = [
    "CRF",
    "Factor",
    "GLOBAL_MEMORIES",
    "TERNARY_FORMS",
    "Topology",
    "distance_groups",
    "factors",
    "ternary",
    "topology",
    "ParticleView",
]

_LAZY = {"ParticleView": "graphs.particle_view"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'graphs' has no attribute {name!r}")
