"""The numbers behind the diagnostics: per sentence, per layer (and head, token,
particle or cluster), measured on a model's ``diagnostic_trace``.

``measure(model, tokens, mask)`` runs the trace once and returns ``Measures``: every
variable as ``(dims, array)`` with the sentence first (dim ``draw``: ArviZ's name for one
draw; here one sentence of the batch). ``report`` wraps them in an ArviZ
``InferenceData``, the trainer's probe averages them per layer.

The depth and width dims carry the model's own names: ``iteration`` and ``channel`` for
the Probabilistic Transformer (its layers are mean-field iterations, its heads are
dependency channels), ``layer`` and ``head`` for every other kind. Token positions are
``token``; the Particle Transformer's SMC weights sit on ``particle`` (its particles are
the tokens, so the coordinates are the same positions); SwarmFormer's clusters on
``cluster``.

A number with nothing to measure is NaN: padding positions, a row or column of
attention with no mass (a length-1 sentence under the PT's ``full`` topology has no
head at all), Pareto k-hat with fewer than ``MIN_PSIS_DRAWS`` real tokens or equal
weights (no tail to fit).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from probformer.diagnostics.estimators import MIN_PSIS_DRAWS, diversity, ess, pareto_k

__all__ = ["Measures", "measure", "dim_names", "mean_over_sentences", "DRAW", "TOKEN", "PARTICLE", "CLUSTER"]

DRAW, TOKEN, PARTICLE, CLUSTER = "draw", "token", "particle", "cluster"


def dim_names(model) -> tuple[str, str]:
    """``(depth, width)`` dim names of ``model``: the PT's own words, else layer and head."""
    from probformer.models.probabilistic_transformer import ProbabilisticTransformer

    if isinstance(model, ProbabilisticTransformer):
        return "iteration", "channel"
    return "layer", "head"


@dataclass
class Measures:
    """``variables``: name -> ``(dims, float64 array)``, the sentence (``draw``) first;
    ``mask [draw, token]`` the real tokens; ``depth``/``width`` the dim names used."""

    depth: str
    width: str
    mask: np.ndarray
    variables: dict[str, tuple[tuple[str, ...], np.ndarray]] = field(default_factory=dict)

    def add(self, name: str, dims: tuple[str, ...], values) -> None:
        array = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
        self.variables[name] = (dims, array.astype(np.float64))

    @property
    def pareto_k_threshold(self) -> float:
        """ArviZ's sample-size-aware threshold min(1 - 1/log10(S), 0.7) at the longest sentence."""
        draws = int(self.mask.sum(-1).max())
        return min(1 - 1 / math.log10(draws), 0.7) if draws > 1 else math.nan

    @property
    def pareto_k_reliable(self) -> bool:
        return int(self.mask.sum(-1).min()) >= MIN_PSIS_DRAWS


def measure(model, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> Measures:
    """Per-sentence diagnostics of ``model`` on one batch (padding allowed, any length >= 1).

    Variables (each only when the trace offers what it needs; D = depth, W = width dim):

    ``query_ess [draw, D, W]``             mean over real queries of ESS(attention row) / n
    ``received_ess [draw, D, W]``          ESS of the attention each real token receives / n
    ``received_pareto_k [draw, D, W]``     Pareto k-hat of the log attention received
    ``attention_received [draw, D, W, token]``  the attention mass each token receives
    ``smc_ess``, ``smc_pareto_k [draw, D]``  of the SMC log-weights (Particle Transformer)
    ``smc_log_weights [draw, D, particle]`` the SMC log-weights, normalised to mean weight 1
    ``cosine``, ``effective_rank``, ``rank_one_distance [draw, D]``  (always)
    ``elbo [draw, iteration]``             mean-field ELBO (nats per sentence)
    ``cluster_ess [draw, D]``              ESS of the real tokens each cluster holds / clusters
    ``cluster_tokens [draw, D, cluster]``  the real tokens each cluster holds

    n is the sentence's number of real tokens.
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
    mask = torch.as_tensor(mask).bool().cpu()  # the arithmetic runs on the host, in float64
    depth, width = dim_names(model)
    result = Measures(depth, width, mask.numpy())
    count = mask.sum(-1).double()  # [B] real tokens per sentence
    if "attention" in trace:
        _attention(trace["attention"], mask, count, result)
    if "log_weights" in trace:
        _log_weights(trace["log_weights"], mask, count, result)
    hidden = trace["hidden"].cpu()
    per_layer = [diversity(hidden[layer, :, : mask.shape[1]], mask) for layer in range(hidden.shape[0])]
    for name in ("cosine", "effective_rank", "rank_one_distance"):
        result.add(name, (DRAW, depth), torch.stack([getattr(d, name) for d in per_layer], 1))
    if "elbo" in trace:
        result.add("elbo", (DRAW, "iteration"), trace["elbo"].double().cpu().T)
    if "routing" in trace:
        _routing(trace["routing"], mask, result)
    return result


def _attention(attention: torch.Tensor, mask: torch.Tensor, count: torch.Tensor, result: Measures) -> None:
    """The ESS and k-hat of attention ``[L, B, H, n, n]`` per sentence."""
    n = mask.shape[1]
    attention = attention[..., :n, :n].double().clamp(min=0).cpu()
    attention = attention * mask[None, :, None, None, :]  # a row's mass on padding is not a head choice
    real_queries = mask[None, :, None, :]  # [1, B, 1, n]

    # a row with no mass (padding, or a token with no legal head) has nothing to measure
    row_valid = real_queries & (attention.sum(-1) > 0)  # [L, B, H, n]
    row_ess = ess(torch.where(row_valid[..., None], attention, 1.0), dim=-1) / count[None, :, None, None]
    rows = _masked_mean(row_ess, row_valid, dim=-1)  # [L, B, H]

    mass = (attention * real_queries[..., None]).sum(-2)  # [L, B, H, n] received from real queries
    column_valid = mass.sum(-1) > 0  # [L, B, H]
    columns = ess(torch.where(column_valid[..., None], mass, 1.0), dim=-1) / count[None, :, None]
    columns = torch.where(column_valid, columns, math.nan)
    log_mass = torch.where(column_valid[..., None], mass.clamp(min=1e-300).log(), 0.0)  # 0: a stand-in, NaN below
    k_mass = np.where(column_valid.numpy(), _pareto_k_per_sentence(log_mass, mask, sentence_dim=1), np.nan)

    by_sentence = (1, 0, 2)  # [L, B, H] -> [B, L, H]
    dims = (DRAW, result.depth, result.width)
    result.add("query_ess", dims, rows.permute(by_sentence))
    result.add("received_ess", dims, columns.permute(by_sentence))
    result.add("received_pareto_k", dims, _tailless_as_nan(k_mass.transpose(by_sentence)))
    received = torch.where(real_queries, mass, math.nan).permute(1, 0, 2, 3)  # [B, L, H, n]
    result.add("attention_received", (*dims, TOKEN), received)


def _log_weights(log_weights: torch.Tensor, mask: torch.Tensor, count: torch.Tensor, result: Measures) -> None:
    """ESS and k-hat of SMC log-weights ``[L, B, n]`` per sentence."""
    n = mask.shape[1]
    log_weights = torch.where(mask[None], log_weights[..., :n].double().cpu(), -math.inf)  # padding weighs 0
    dims = (DRAW, result.depth)
    result.add("smc_ess", dims, (ess(log_weights=log_weights) / count).T)
    k_hat = _pareto_k_per_sentence(log_weights, mask, sentence_dim=1)  # [L, B]
    result.add("smc_pareto_k", dims, _tailless_as_nan(k_hat.T))  # [B, L]
    stored = torch.where(mask[None], log_weights, math.nan).permute(1, 0, 2)  # [B, L, n]
    result.add("smc_log_weights", (*dims, PARTICLE), stored)


def _routing(routing: list[dict], mask: torch.Tensor, result: Measures) -> None:
    """Per sentence and layer: the real tokens each cluster holds, and their normalised ESS."""
    held = [(layer["assignment"].double().cpu() * mask[..., None]).sum(1) for layer in routing]  # [B, C_l]
    result.add("cluster_ess", (DRAW, result.depth), torch.stack([ess(h, dim=-1) / h.shape[-1] for h in held], 1))
    # layers may have different numbers of clusters: the missing ones are NaN
    clusters = max(h.shape[-1] for h in held)
    padded = [torch.nn.functional.pad(h, (0, clusters - h.shape[-1]), value=math.nan) for h in held]
    result.add("cluster_tokens", (DRAW, result.depth, CLUSTER), torch.stack(padded, 1))  # [B, L, C]


def _pareto_k_per_sentence(log_weights: torch.Tensor, mask: torch.Tensor, sentence_dim: int) -> np.ndarray:
    """k-hat of ``log_weights [..., B, ..., n]`` (the sentences on ``sentence_dim``, the draws
    last), each sentence fitted on its own real tokens only: a padded position is no draw
    (counted as a weight of zero it would lengthen the sample and shift the tail). So a
    sentence with fewer than ``MIN_PSIS_DRAWS`` real tokens gets NaN, whatever it is padded to.
    Sentences of the same real length are fitted together (one ArviZ call per length)."""
    weights = log_weights.movedim(sentence_dim, 0)  # [B, ..., n]
    k_hat = np.full(tuple(weights.shape[:-1]), np.nan)
    lengths = mask.sum(-1)
    for length in lengths.unique().tolist():
        rows = (lengths == length).nonzero().flatten()
        # the real tokens of each of these rows, in order: [rows, ..., length]
        real = torch.stack([weights[row][..., mask[row]] for row in rows.tolist()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # short sentences: nan k-hat, flagged in attrs
            k_hat[rows.numpy()] = pareto_k(real).k
    return np.moveaxis(k_hat, 0, sentence_dim)


def _masked_mean(values: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean of ``values`` where ``valid`` along ``dim``; NaN where nothing is valid."""
    total = torch.where(valid, values, 0.0).sum(dim)
    number = valid.sum(dim)
    return torch.where(number > 0, total / number.clamp(min=1), math.nan)


def _tailless_as_nan(values: np.ndarray) -> np.ndarray:
    """k-hat of equal weights is -inf (no tail): stored as NaN, like every k with nothing to
    fit; +inf (a few draws hold most of the mass) is kept: the worst collapse is never left out."""
    return np.where(np.isneginf(values), np.nan, values)


def mean_over_sentences(values: np.ndarray) -> np.ndarray:
    """Mean over axis 0 (the sentences) of a measure: NaN (nothing measured) is ignored, +inf
    (a degenerate k-hat) is kept, so the worst collapse is never left out; NaN where every
    value is NaN."""
    measured = ~np.isnan(values)
    count = measured.sum(0)
    total = np.where(measured, values, 0.0).sum(0)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)
