"""inference: engines that compute marginals of ``graphs`` models.

Exact (Pyro enumeration) and Gibbs (NumPyro) are the reference oracles; MeanField and
SMC are the compiled engines. ``inference`` never imports ``probformer``.

The numerical core a trained model runs (``mean_field``, ``head_kernels``,
``halting``, ``folding``, ``posterior``) imports torch alone; the engines built on Pyro,
NumPyro or ArviZ are imported on first use, so an exported model loads where those
are not installed.
"""

import importlib

from inference import factor_messages
from inference.folding import Folded, FoldState
from inference.mean_field import MeanField, MessageWeights, MupScales
from inference.posterior import Posterior

_LAZY = {
    "Exact": "inference.exact",
    "Gibbs": "inference.gibbs",
    "GibbsResult": "inference.gibbs",
    "SMC": "inference.smc",
    "SMCResult": "inference.smc",
    "TemperedSMC": "inference.tempered_smc",
    "TemperedSMCResult": "inference.tempered_smc",
    "mean_field_guide": "inference.svi",
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
