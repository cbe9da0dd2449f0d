"""graphs: declare factor graphs (the PT CRF, topologies) as data and as Pyro models.

``graphs`` never imports ``inference`` or ``probformer``.
"""

from graphs import topology
from graphs.crf import CRF, GLOBAL_MEMORIES, TERNARY_FORMS, distance_groups

__all__ = ["CRF", "GLOBAL_MEMORIES", "TERNARY_FORMS", "distance_groups", "topology"]

from graphs.particle_view import ParticleView  # noqa: E402

__all__ += ["ParticleView"]
