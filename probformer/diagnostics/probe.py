"""The per-layer diagnostics the trainer logs every ``train.diagnostics_every`` steps:
``layer_metrics(model, tokens, mask)`` on a fixed probe batch, as flat
``{"<measure>/<depth>_<i>": value}`` fields (one column each in ``metrics.csv``, one
TensorBoard tag each).

Measures (means over the probe's sentences and the heads): ``ess`` (ESS of the attention
received / n, where the model has attention), ``smc_ess`` (of the SMC weights, Particle
Transformer), ``cosine`` and ``effective_rank`` (representation diversity). ``<depth>``
is ``iteration`` for the PT and ``layer`` otherwise, as in the diagnostics report.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from probformer.diagnostics.trace_measures import mean_over_sentences, measure

__all__ = ["layer_metrics", "PROBE_MEASURES"]

# field prefix -> the measures variable it averages
PROBE_MEASURES = {"ess": "received_ess", "smc_ess": "smc_ess", "cosine": "cosine", "effective_rank": "effective_rank"}


def layer_metrics(model, tokens: torch.Tensor, mask: torch.Tensor, names=None) -> dict[str, float]:
    """Per-layer means of ``PROBE_MEASURES`` on ``(tokens, mask)``. A model with non-finite
    weights (a diverged run: its trace refuses them) gives NaN for each of ``names`` (the
    fields of an earlier call) instead of an error, so the trainer's own check names the
    step; without ``names`` it is the trace's ``ValueError``."""
    if names is not None and not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return dict.fromkeys(names, math.nan)
    with torch.random.fork_rng(devices=[]):  # the probe must not move the run's random stream
        measures = measure(model, tokens, mask)
    fields = {}
    for prefix, name in PROBE_MEASURES.items():
        if name not in measures.variables:
            continue
        dims, values = measures.variables[name]
        axis = dims.index(measures.depth)
        per_layer = np.moveaxis(values, axis, -1).reshape(-1, values.shape[axis])
        for index, value in enumerate(mean_over_sentences(per_layer)):
            fields[f"{prefix}/{measures.depth}_{index}"] = float(value)
    return fields
