"""The diagnostics' estimators, functions of tensors: when importance weights degenerate
(the SMC view of attention) and when token representations collapse (over-smoothing).

    ess(weights) / ess(log_weights=...)   effective sample size (sum w)^2 / sum w^2
    pareto_k(log_weights)                 PSIS Pareto k-hat through ArviZ, with a verdict
    diversity(hidden, mask)               cosine similarity, effective rank, distance to
                                          the all-tokens-equal subspace
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from inference import arviz_interop

__all__ = ["ess", "pareto_k", "ParetoK", "diversity", "Diversity", "MIN_PSIS_DRAWS"]

# ArviZ fits the generalised Pareto to the ceil(min(S / 5, 3 sqrt(S))) largest weights
# and needs at least 5 of them: S >= 21.
MIN_PSIS_DRAWS = 21


def _check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            array = np.asarray(value)
        except ValueError as error:  # a ragged list: numbers, but no array shape
            raise ValueError(f"{name} must be a tensor or array of real numbers, got {value!r:.80} ({error})") from None
        if array.dtype.kind in "cb":  # a bool is no weight: True would read as 1
            raise TypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
        if array.dtype.kind not in "iuf":  # strings, objects
            raise TypeError(f"{name} must be a tensor or array of real numbers, got {value!r:.80}")
        value = torch.as_tensor(array.astype(np.float64))
    if value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must hold real numbers, got dtype {value.dtype}")
    if not value.dtype.is_floating_point:
        value = value.double()
    if value.numel() == 0:
        raise ValueError(f"{name} must be non-empty")
    if torch.isnan(value).any():
        raise ValueError(f"{name} contains NaN")
    return value


def _check_dim(dim, ndim: int) -> int:
    if ndim == 0:
        raise ValueError("the weights must have at least one dim (the weights to measure), got a 0-d value")
    low, high = -ndim, ndim - 1
    message = f"dim must be an integer in [{low}, {high}] (the weights have {ndim} dims), got {dim!r}"
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(message)
    if not low <= dim <= high:
        raise ValueError(message)
    return dim


def ess(weights=None, *, log_weights=None, dim: int = -1, normalized: bool = False) -> torch.Tensor:
    """Effective sample size ``(sum w)^2 / sum w^2`` along ``dim``, in float64.

    Give non-negative ``weights`` (attention rows ``[B, H, n, n]``, column mass, SMC
    weights ``[B, N]``) or ``log_weights``. ``normalized=True`` divides by the number of
    weights (1 = uniform, 1/N = one weight carries everything).

    Computed stably and exactly where it can be: the weights are divided by their
    maximum (log weights: the maximum is subtracted) before anything is summed, and the
    sums run in float64 as ``s1 * (s1 / s2)``. So N equal weights give exactly N, at any
    magnitude and in any input dtype (the shifted weights are all exactly 1), and no
    square overflows or underflows.
    """
    if (weights is None) == (log_weights is None):
        raise ValueError("give exactly one of weights or log_weights")
    if not isinstance(normalized, bool):
        raise TypeError(f"normalized must be True or False, got {normalized!r}")
    if log_weights is not None:
        lw = _check_tensor("log_weights", log_weights)
        _check_dim(dim, lw.dim())
        if torch.isposinf(lw).any():
            raise ValueError("log_weights contains +inf")
        if torch.isneginf(lw).all(dim=dim).any():
            raise ValueError(f"log_weights are all -inf along dim {dim}: no weight to measure")
        # the shift happens in the input dtype: equal entries give exactly 0, whatever their size
        w = (lw - lw.amax(dim, keepdim=True)).double().exp()
    else:
        w = _check_tensor("weights", weights)
        _check_dim(dim, w.dim())
        if (w < 0).any() or torch.isinf(w).any():
            raise ValueError("weights must be finite and non-negative")
        if (w.sum(dim) == 0).any():
            raise ValueError(f"weights sum to zero along dim {dim}: no weight to measure")
        w = w.double() / w.double().amax(dim, keepdim=True)  # the largest weight is exactly 1
    first, second = w.sum(dim), (w * w).sum(dim)
    value = first * (first / second)  # N ones: N * (N / N) = N exactly
    return value / w.shape[dim] if normalized else value


@dataclass
class ParetoK:
    """k-hat per row (-inf for equal weights), the sample-size-aware threshold min(1 - 1/log10(S), 0.7), a verdict per
    row ("ok": k < 0.5; "high": up to the threshold; "degenerate": above it; "unreliable":
    too few draws, k = nan), and the Pareto-smoothed log weights."""

    k: np.ndarray
    threshold: float
    verdict: np.ndarray
    smoothed_log_weights: np.ndarray


def pareto_k(log_weights, relative_efficiency: float = 1.0) -> ParetoK:
    """PSIS Pareto k-hat of log importance ratios ``[..., S]`` (last axis: the S draws),
    computed by ArviZ's ``psislw``."""
    lw = _check_tensor("log_weights", log_weights).detach().cpu().double().numpy()
    if lw.ndim == 0:
        raise ValueError("log_weights must have a draws axis: shape [..., S], got a 0-d value")
    if isinstance(relative_efficiency, bool) or not isinstance(relative_efficiency, int | float):
        raise TypeError(f"relative_efficiency must be a finite number > 0, got {relative_efficiency!r}")
    if not (math.isfinite(relative_efficiency) and relative_efficiency > 0):  # ArviZ divides by it
        raise ValueError(f"relative_efficiency must be a finite number > 0, got {relative_efficiency!r}")
    if np.isposinf(lw).any():
        raise ValueError("log_weights contains +inf")
    if np.isneginf(lw).all(axis=-1).any():
        raise ValueError("log_weights are all -inf along the draws axis")
    draws = lw.shape[-1]
    threshold = min(1 - 1 / math.log10(draws), 0.7) if draws > 1 else -math.inf
    if draws < MIN_PSIS_DRAWS:
        warnings.warn(
            f"PSIS needs at least {MIN_PSIS_DRAWS} draws to fit the tail, got {draws}: k-hat is nan (unreliable)",
            stacklevel=2,
        )
        k = np.full(lw.shape[:-1], np.nan)
        smoothed = lw - np.logaddexp.reduce(lw, axis=-1, keepdims=True)
    else:
        finite = np.where(np.isneginf(lw), np.finfo(float).min, lw)
        # a degenerate tail (equal or nearly equal weights) makes ArviZ's Pareto fit divide
        # 0 by 0: numpy's RuntimeWarnings leaked into training logs; the non-finite k it gives
        # is mapped just below: -inf for constant weights, +inf read by _unfitted_tail, else nan
        with np.errstate(divide="ignore", invalid="ignore"):
            smoothed, k = arviz_interop.psislw(finite, relative_efficiency)
        constant = np.ptp(lw, axis=-1) == 0  # equal weights: no tail at all
        k = np.where(np.isposinf(k), _unfitted_tail(finite, relative_efficiency), np.where(np.isfinite(k), k, np.nan))
        k = np.where(constant, -np.inf, k)
    verdict = np.where(
        np.isnan(k), "unreliable", np.where(k < 0.5, "ok", np.where(k <= threshold, "high", "degenerate"))
    )
    return ParetoK(np.asarray(k), threshold, verdict, np.asarray(smoothed))


def _unfitted_tail(log_weights: np.ndarray, relative_efficiency: float) -> np.ndarray:
    """What ArviZ's k = +inf means, per row: it gives +inf whenever at most 4 draws lie
    strictly above its tail cutoff (the M+1-th largest weight, M = ceil(min(S / 5,
    3 sqrt(S / r_eff)))), too few to fit. That is a collapse ("degenerate", +inf) only
    when those draws hold most of the mass; no draw above the cutoff is a flat top (tied
    weights: no tail, -inf, as for equal weights); a few light draws are nan (unreliable)."""
    draws = log_weights.shape[-1]
    tail = int(math.ceil(min(draws / 5.0, 3 * (draws / relative_efficiency) ** 0.5)))
    x = log_weights - log_weights.max(-1, keepdims=True)
    cutoff = np.maximum(np.sort(x, axis=-1)[..., -tail - 1], np.log(np.finfo(float).tiny))  # as ArviZ cuts
    above = x > cutoff[..., None]
    weights = np.exp(x)
    share = np.where(above, weights, 0.0).sum(-1) / weights.sum(-1)
    return np.where(~above.any(-1), -np.inf, np.where(share >= 0.5, np.inf, np.nan))


@dataclass
class Diversity:
    """Per sequence: mean pairwise cosine similarity of distinct real tokens, effective rank
    (exp of the entropy of the normalised singular values), and the relative distance
    ``||X - 1 mean(X)|| / ||X||`` to the subspace where all tokens are equal."""

    cosine: torch.Tensor  # [B]
    effective_rank: torch.Tensor  # [B]
    rank_one_distance: torch.Tensor  # [B]


def diversity(hidden: torch.Tensor, mask: torch.Tensor | None = None) -> Diversity:
    """Over-smoothing statistics of token representations ``[B, n, D]``."""
    hidden = _check_tensor("hidden", hidden)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [batch, tokens, width], got {tuple(hidden.shape)}")
    if torch.isinf(hidden).any():
        raise ValueError("hidden contains Inf")
    B, n, _ = hidden.shape
    mask = torch.ones(B, n, dtype=torch.bool, device=hidden.device) if mask is None else mask
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor of shape {(B, n)}, got {getattr(mask, 'dtype', type(mask))}")
    if mask.shape != (B, n):
        raise ValueError(f"mask must be a bool tensor of shape {(B, n)}, got shape {tuple(mask.shape)}")
    if (mask.sum(1) < 1).any():
        raise ValueError("every sequence needs at least one real token")
    x = hidden.double() * mask[..., None]
    # every statistic is scale-invariant: each sequence divided by its largest entry, so no
    # square underflows or overflows in the SVD and norms (hidden of size 1e-200 or 1e200)
    peak = x.abs().amax((1, 2), keepdim=True)
    x = x / torch.where(peak > 0, peak, 1.0)
    count = mask.sum(1).double()

    # Each token scaled by its largest entry first, so its norm lies in [1, sqrt(D)]: exact
    # for any magnitude (F.normalize's eps swamped tokens of size 1e-20). Zero tokens stay 0.
    largest = x.abs().amax(-1, keepdim=True)
    scaled = x / torch.where(largest > 0, largest, 1.0)
    length = scaled.norm(dim=-1, keepdim=True)
    unit = scaled / torch.where(length > 0, length, 1.0)
    gram = unit @ unit.transpose(1, 2)
    pairs = (mask[:, :, None] & mask[:, None, :]) & ~torch.eye(n, dtype=torch.bool, device=x.device)
    pair_count = pairs.sum((1, 2)).double()
    cosine = torch.where(pair_count > 0, (gram * pairs).sum((1, 2)) / pair_count.clamp(min=1), 1.0)

    singular = torch.linalg.svdvals(x)  # padded rows are zero: they add no singular value
    p = singular / singular.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    entropy = -(p * torch.where(p > 0, p, 1.0).log()).sum(-1)
    effective_rank = torch.where(singular.sum(-1) > 0, entropy.exp(), 0.0)

    mean = x.sum(1, keepdim=True) / count[:, None, None]
    residual = ((x - mean) * mask[..., None]).norm(dim=(1, 2))
    norm = x.norm(dim=(1, 2))
    distance = torch.where(norm > 0, residual / norm.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
    return Diversity(cosine, effective_rank, distance)
