"""inference: engines that compute marginals of ``graphs`` models.

Exact (Pyro enumeration) and Gibbs (NumPyro) are the reference oracles.
``inference`` never imports ``probformer``.
"""

from inference.exact import Exact
from inference.posterior import Posterior

__all__ = ["Exact", "Posterior"]

from inference.gibbs import Gibbs, GibbsResult  # noqa: E402

__all__ += ["Gibbs", "GibbsResult"]

from inference.mean_field import MeanField, MessageWeights, MupScales  # noqa: E402

__all__ += ["MeanField", "MessageWeights", "MupScales"]

from inference.smc import SMC, SMCResult  # noqa: E402

__all__ += ["SMC", "SMCResult"]

from inference.svi import mean_field_guide  # noqa: E402

__all__ += ["mean_field_guide"]

from inference.folding import Folded, FoldState  # noqa: E402

__all__ += ["Folded", "FoldState"]
