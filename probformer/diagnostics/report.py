"""``report(model, tokens, mask)``: the diagnostics of one batch, per layer (and head),
as ArviZ InferenceData.

The report protocol: a model offers ``diagnostic_trace(tokens, mask)`` returning a
dict with ``hidden [L, B, n, D]`` (token states per layer) and, where the model has
them, ``attention [L, B, H, n, n]`` (per head), ``log_weights [L, B, n]`` (SMC
importance weights), ``elbo [T, B]`` (mean-field bound per iteration) and ``routing``
(per layer a dict with the token-to-cluster ``assignment [B, n, C]``).

What each model kind offers, hence which groups its report has:

    ProbabilisticTransformer   hidden, attention (head marginals), elbo
    ParticleTransformer        hidden, attention, log_weights
    Transformer                hidden, attention
    SwarmFormer                hidden, routing (its window attention is never materialised)
    FoldedContext              hidden (the final states, one "layer")

A part the model does not offer is left out of the report (no group, or no variable in a
group); it is never an error. A number that has nothing to measure is NaN: the rows ESS
of a layer where no real token had a head (a length-1 sentence under the PT's ``full``
topology has none), k-hat with fewer than ``MIN_PSIS_DRAWS`` real tokens.
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
    """Per-layer diagnostics of ``model`` on one batch (padding allowed, any length >= 1),
    as an ArviZ ``InferenceData``. Groups (each only when the trace has what it needs):

    ``ess``        ``rows`` and ``columns`` ``[layer, head]`` (attention): mean normalised
                   ESS of each real query's attention row over the real keys, and the
                   normalised ESS of the attention mass each real token receives; both
                   divided by the sentence's real length, then averaged over sentences.
                   ``log_weights [layer]``: normalised ESS of the SMC weights.
    ``pareto_k``   ``attention_mass [layer, head]``: k-hat of the log mass received;
                   ``log_weights [layer]``: k-hat of the SMC log-weights (mean over sentences).
    ``diversity``  ``cosine``, ``effective_rank``, ``rank_one_distance`` ``[layer]`` (always).
    ``elbo``       ``elbo [iteration]`` (mean field).
    ``routing``    ``cluster_ess [layer]``: normalised ESS of how many real tokens each
                   cluster holds (1: all clusters used equally; 1/C: one cluster holds all).
    """
    if not hasattr(model, "diagnostic_trace"):
        raise TypeError(f"{type(model).__name__} does not offer diagnostic_trace(tokens, mask)")
    if mask is None:
        mask = torch.ones(tokens.shape, dtype=torch.bool, device=getattr(tokens, "device", None))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            trace = model.diagnostic_trace(tokens, mask)  # the model validates tokens and mask
    finally:
        model.train(was_training)
    mask = torch.as_tensor(mask).bool().cpu()  # the report's arithmetic runs on the host, in float64
    count = mask.sum(-1).double()  # [B] real tokens per sentence
    groups = {"ess": {}, "pareto_k": {}, "diversity": {}}
    if "attention" in trace:
        _attention(trace["attention"], mask, count, groups)
    if "log_weights" in trace:
        _log_weights(trace["log_weights"], mask, count, groups)
    hidden = trace["hidden"].cpu()
    per_layer = [diversity(hidden[layer, :, : mask.shape[1]], mask) for layer in range(hidden.shape[0])]
    for name in ("cosine", "effective_rank", "rank_one_distance"):
        groups["diversity"][name] = (["layer"], torch.stack([getattr(d, name).mean() for d in per_layer]).numpy())
    if "elbo" in trace:
        groups["elbo"] = {"elbo": (["iteration"], trace["elbo"].double().mean(1).cpu().numpy())}
    if "routing" in trace:
        groups["routing"] = {"cluster_ess": (["layer"], _cluster_ess(trace["routing"], mask))}
    draws = int(count.max())
    attrs = {
        "model": type(model).__name__,
        "sentences": mask.shape[0],
        "max_length": mask.shape[1],
        "pareto_k_threshold": min(1 - 1 / math.log10(draws), 0.7) if draws > 1 else float("nan"),
        "pareto_k_reliable": int(int(count.min()) >= MIN_PSIS_DRAWS),
    }
    return arviz_interop.from_datasets({k: v for k, v in groups.items() if v}, attrs)


def _attention(attention: torch.Tensor, mask: torch.Tensor, count: torch.Tensor, groups: dict) -> None:
    """``ess.rows``, ``ess.columns`` and ``pareto_k.attention_mass`` of ``[L, B, H, n, n]``."""
    n = mask.shape[1]
    attention = attention[..., :n, :n].double().clamp(min=0).cpu()
    real_keys = mask[None, :, None, None, :]
    attention = attention * real_keys  # a row's mass on padding is not a head choice
    real_queries = mask[None, :, None, :]  # [1, B, 1, n]

    # a row with no mass (padding, or a token with no legal head) has nothing to measure
    row_valid = real_queries & (attention.sum(-1) > 0)  # [L, B, H, n]
    row_ess = ess(torch.where(row_valid[..., None], attention, 1.0), dim=-1) / count[None, :, None, None]
    rows = _masked_mean(row_ess, row_valid, dim=-1)  # [L, B, H]

    mass = (attention * real_queries[..., None]).sum(-2)  # [L, B, H, n] received from real queries
    column_valid = mass.sum(-1) > 0  # [L, B, H]
    columns = ess(torch.where(column_valid[..., None], mass, 1.0), dim=-1) / count[None, :, None]
    columns = torch.where(column_valid, columns, math.nan)
    log_mass = torch.where(real_queries, mass.clamp(min=1e-300).log(), -math.inf)
    log_mass = torch.where(column_valid[..., None], log_mass, 0.0)  # a stand-in, set to NaN below
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # short sentences: nan k-hat, flagged in attrs
        k_mass = np.where(column_valid.numpy(), pareto_k(log_mass).k, np.nan)  # [L, B, H]

    groups["ess"]["rows"] = (["layer", "head"], _nanmean(rows.numpy(), axis=1))
    groups["ess"]["columns"] = (["layer", "head"], _nanmean(columns.numpy(), axis=1))
    groups["pareto_k"]["attention_mass"] = (["layer", "head"], _nanmean(k_mass, axis=1))


def _log_weights(log_weights: torch.Tensor, mask: torch.Tensor, count: torch.Tensor, groups: dict) -> None:
    """``ess.log_weights`` and ``pareto_k.log_weights`` of SMC log-weights ``[L, B, n]``."""
    n = mask.shape[1]
    log_weights = torch.where(mask[None], log_weights[..., :n].double().cpu(), -math.inf)  # padding weighs 0
    groups["ess"]["log_weights"] = (["layer"], (ess(log_weights=log_weights) / count).mean(1).numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        k_weights = pareto_k(log_weights).k  # [L, B]
    groups["pareto_k"]["log_weights"] = (["layer"], _nanmean(k_weights, axis=1))


def _cluster_ess(routing: list[dict], mask: torch.Tensor) -> np.ndarray:
    """Per layer: normalised ESS of the real tokens held by each cluster, mean over sentences."""
    values = []
    for layer in routing:
        assignment = layer["assignment"].double().cpu() * mask[..., None]  # [B, n, C]
        held = assignment.sum(1)  # [B, C]
        values.append((ess(held, dim=-1) / held.shape[-1]).mean())
    return torch.stack(values).numpy()


def _masked_mean(values: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean of ``values`` where ``valid`` along ``dim``; NaN where nothing is valid."""
    total = torch.where(valid, values, 0.0).sum(dim)
    number = valid.sum(dim)
    return torch.where(number > 0, total / number.clamp(min=1), math.nan)


def _nanmean(values: np.ndarray, axis: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan slices stay nan
        return np.nanmean(np.where(np.isfinite(values), values, np.nan), axis=axis)
