"""μP for the Probabilistic Transformer: the parametrisation lives with the models
(``probformer.models.mup_parametrization``); this package adds the tools that check it:
``probformer.mup.coord_check`` and ``probformer.mup.neighbourhood`` (``probformer mup
coord-check | neighbourhood``, or ``python -m probformer.mup ...``).

The parametrisation's names are re-exported on first use (not at import), so that the
command line can build its ``mup`` verbs (probformer.mup.commands) without importing torch."""

import importlib

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


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'probformer.mup' has no attribute {name!r}")
    value = getattr(importlib.import_module("probformer.models.mup_parametrization"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
