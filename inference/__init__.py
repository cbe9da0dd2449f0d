"""inference: engines that compute marginals of ``graphs`` models.

One room per engine:

    mean_field/     MeanField (engine), its update (schedules), its bound (bound), and
                    kernels/ for the head (attention) kernels: naive, fused, flex, shared
    smc/            SMC (filter), the resamplers, TemperedSMC (tempered) for CRFs
    reference/      the oracles: Exact (Pyro enumeration), Gibbs (NumPyro), Pyro SVI

and beside them what every engine shares: ``posterior`` (one Posterior contract),
``declaration`` (what an engine compiles of a CRF, or refuses) and ``arviz_interop``.
``inference`` never imports ``probformer``.

The numerical core a trained model runs (``mean_field``, ``posterior``) imports torch
alone; the engines built on Pyro, NumPyro or ArviZ are imported on first use, so an
exported model loads where those are not installed.
"""

import importlib

from inference.mean_field import factor_messages
from inference.mean_field.engine import MeanField, MessageWeights, MupScales
from inference.mean_field.folding import Folded, FoldState
from inference.posterior import Posterior

_LAZY = {
    "Exact": "inference.reference.exact",
    "Gibbs": "inference.reference.gibbs",
    "GibbsResult": "inference.reference.gibbs",
    "SMC": "inference.smc.filter",
    "SMCResult": "inference.smc.filter",
    "TemperedSMC": "inference.smc.tempered.sampler",
    "TemperedSMCResult": "inference.smc.tempered.sampler",
    "mean_field_guide": "inference.reference.svi",
}

__all__ = ["Posterior", "factor_messages", "MeanField", "MessageWeights", "MupScales", "Folded", "FoldState", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'inference' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
