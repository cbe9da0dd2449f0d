"""Sequential Monte Carlo: the batched particle filter (``filter``; the state a run carries,
``filter_state``), the resamplers, a Pyro model's callables (``pyro_state_space``) and the
tempered sampler for CRFs (``tempered/``: the sampler, its target, its steps and moves)."""

import importlib

__all__ = ["SMC", "SMCResult"]


def __getattr__(name: str):
    # the filter imports Pyro: loaded on first use, as inference's own engines are
    if name in __all__:
        return getattr(importlib.import_module("inference.smc.filter"), name)
    raise AttributeError(f"module 'inference.smc' has no attribute {name!r}")
