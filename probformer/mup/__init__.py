"""μP for the Probabilistic Transformer: the parametrisation lives with the models
(``probformer.models.mup``); this package adds the tools that check it:
``probformer.mup.coord_check`` and ``probformer.mup.neighbourhood`` (``python -m
probformer.mup coord-check | neighbourhood``)."""

from probformer.models.mup import (  # noqa: F401
    GROUPS,
    PARADIGMS,
    base_shape,
    base_width,
    engine_scales,
    initialise,
    param_groups,
    roles,
    widen,
    width_multiplier,
)

__all__ = [
    "PARADIGMS",
    "GROUPS",
    "base_shape",
    "base_width",
    "width_multiplier",
    "engine_scales",
    "widen",
    "initialise",
    "param_groups",
    "roles",
]
