"""``report(model, tokens, mask)``: the diagnostics of one batch, per layer (and head),
as ArviZ InferenceData.

The report protocol: a model offers ``diagnostic_trace(tokens, mask)`` returning a
dict with ``hidden [L, B, n, D]`` (token states per layer), ``attention
[L, B, H, n, n]`` (per head), and optionally ``log_weights [L, B, n]`` (SMC
importance weights) and ``elbo [T, B]`` (mean-field bound per iteration). Both
``ProbabilisticTransformer`` and ``ParticleTransformer`` do.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from inference import arviz_interop
from probformer.diagnostics.metrics import MIN_PSIS_DRAWS, diversity, ess, pareto_k

__all__ = ["report"]


def report(model, tokens: torch.Tensor, mask: torch.Tensor | None = None):
    """Per-layer diagnostics of ``model`` on one batch, as an ArviZ ``InferenceData`` with
    groups ``ess`` (rows: mean normalised ESS of each query's attention row; columns:
    normalised ESS of the attention mass each token receives), ``pareto_k`` (k-hat of the
    log attention mass received, per layer and head, mean over sentences; and of the SMC
    log-weights when the model has them), ``diversity`` (mean over sentences) and, for
    mean field, ``elbo`` (mean per iteration)."""
    if not hasattr(model, "diagnostic_trace"):
        raise TypeError(f"{type(model).__name__} does not offer diagnostic_trace(tokens, mask)")
    mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask
    was_training = model.training
    model.eval()
    with torch.no_grad():
        trace = model.diagnostic_trace(tokens, mask)
    model.train(was_training)
    attention = trace["attention"].double()  # [L, B, H, n, n]
    L, B, H, n, _ = attention.shape
    real = mask.to(attention.dtype)
    count = real.sum(-1)  # [B]

    # padded query rows have no attention at all: give them uniform rows, averaged out below
    rows_in = torch.where(mask[None, :, None, :, None], attention.clamp(min=0), 1.0)
    row_ess = ess(rows_in, dim=-1)  # [L, B, H, n]
    row_ess = row_ess / count[None, :, None, None]
    rows = (row_ess * real[None, :, None, :]).sum(-1) / count[None, :, None]  # [L, B, H]
    mass = (attention * real[None, :, None, :, None]).sum(-2)  # [L, B, H, n] received
    columns = ess(mass, dim=-1) / count[None, :, None]  # padded keys receive 0: they drop out
    log_mass = torch.where(mask[None, :, None, :], mass.clamp(min=1e-300).log(), -math.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # short sentences: nan k-hat, flagged below
        k_mass = pareto_k(log_mass).k  # [L, B, H]
    groups = {
        "ess": {
            "rows": (["layer", "head"], rows.mean(1).numpy()),
            "columns": (["layer", "head"], columns.mean(1).numpy()),
        },
        "pareto_k": {"attention_mass": (["layer", "head"], _nanmean(k_mass, axis=1))},
        "diversity": {},
    }
    if "log_weights" in trace:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            k_weights = pareto_k(trace["log_weights"].double()).k  # [L, B]
        groups["pareto_k"]["log_weights"] = (["layer"], _nanmean(k_weights, axis=1))
    per_layer = [diversity(trace["hidden"][layer], mask) for layer in range(trace["hidden"].shape[0])]
    for name in ("cosine", "effective_rank", "rank_one_distance"):
        groups["diversity"][name] = (["layer"], torch.stack([getattr(d, name).mean() for d in per_layer]).numpy())
    if "elbo" in trace:
        groups["elbo"] = {"elbo": (["iteration"], trace["elbo"].double().mean(1).numpy())}
    attrs = {
        "model": type(model).__name__,
        "sentences": B,
        "max_length": n,
        "pareto_k_threshold": min(1 - 1 / math.log10(n), 0.7) if n > 1 else float("nan"),
        "pareto_k_reliable": int(int(count.min()) >= MIN_PSIS_DRAWS),
    }
    return arviz_interop.from_datasets(groups, attrs)


def _nanmean(values: np.ndarray, axis: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan slices stay nan
        return np.nanmean(np.where(np.isfinite(values), values, np.nan), axis=axis)
