"""Diagnostics: when importance weights degenerate (the SMC view of attention) and
when token representations collapse (over-smoothing).

    ess(weights) / ess(log_weights=...)   effective sample size (sum w)^2 / sum w^2
    pareto_k(log_weights)                 PSIS Pareto k-hat through ArviZ, with a verdict
    diversity(hidden, mask)               cosine similarity, effective rank, distance to
                                          the all-tokens-equal subspace
    report(model, tokens, mask)           all of it per layer (and head), as ArviZ InferenceData
    plot_report(report, directory)        PNG figures of a report

The report protocol: a model offers ``diagnostic_trace(tokens, mask)`` returning a
dict with ``hidden [L, B, n, D]`` (token states per layer), ``attention
[L, B, H, n, n]`` (per head), and optionally ``log_weights [L, B, n]`` (SMC
importance weights) and ``elbo [T, B]`` (mean-field bound per iteration). Both
``ProbabilisticTransformer`` and ``ParticleTransformer`` do.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from inference import arviz_interop

__all__ = ["ess", "pareto_k", "ParetoK", "diversity", "Diversity", "MIN_PSIS_DRAWS", "report", "plot_report"]

# ArviZ fits the generalised Pareto to the ceil(min(S / 5, 3 sqrt(S))) largest weights
# and needs at least 5 of them: S >= 21.
MIN_PSIS_DRAWS = 21


def _check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=torch.float64)
    if not value.dtype.is_floating_point:
        value = value.double()
    if value.numel() == 0:
        raise ValueError(f"{name} must be non-empty")
    if torch.isnan(value).any():
        raise ValueError(f"{name} contains NaN")
    return value


def ess(weights=None, *, log_weights=None, dim: int = -1, normalized: bool = False) -> torch.Tensor:
    """Effective sample size ``(sum w)^2 / sum w^2`` along ``dim``.

    Give non-negative ``weights`` (attention rows ``[B, H, n, n]``, column mass, SMC
    weights ``[B, N]``) or ``log_weights`` (computed stably in log space:
    ``exp(2 lse(lw) - lse(2 lw))``). ``normalized=True`` divides by the number of
    weights (1 = uniform, 1/N = one weight carries everything).
    """
    if (weights is None) == (log_weights is None):
        raise ValueError("give exactly one of weights or log_weights")
    if log_weights is not None:
        lw = _check_tensor("log_weights", log_weights)
        if torch.isposinf(lw).any():
            raise ValueError("log_weights contains +inf")
        if torch.isneginf(lw).all(dim=dim).any():
            raise ValueError(f"log_weights are all -inf along dim {dim}: no weight to measure")
        value = (2 * lw.logsumexp(dim) - (2 * lw).logsumexp(dim)).exp()
        size = lw.shape[dim]
    else:
        w = _check_tensor("weights", weights)
        if (w < 0).any() or torch.isinf(w).any():
            raise ValueError("weights must be finite and non-negative")
        total = w.sum(dim)
        if (total == 0).any():
            raise ValueError(f"weights sum to zero along dim {dim}: no weight to measure")
        # rescale by the max first so squares cannot overflow or underflow
        w = w / w.amax(dim, keepdim=True)
        value = w.sum(dim) ** 2 / (w**2).sum(dim)
        size = w.shape[dim]
    return value / size if normalized else value


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
        smoothed, k = arviz_interop.psislw(finite, relative_efficiency)
        constant = np.ptp(lw, axis=-1) == 0  # equal weights: no tail at all
        k = np.where(constant, -np.inf, np.where(np.isfinite(k), k, np.nan))
    verdict = np.where(
        np.isnan(k), "unreliable", np.where(k < 0.5, "ok", np.where(k <= threshold, "high", "degenerate"))
    )
    return ParetoK(np.asarray(k), threshold, verdict, np.asarray(smoothed))


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
    if mask.shape != (B, n) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor of shape {(B, n)}")
    if (mask.sum(1) < 1).any():
        raise ValueError("every sequence needs at least one real token")
    x = hidden.double() * mask[..., None]
    count = mask.sum(1).double()

    unit = torch.nn.functional.normalize(x, dim=-1)
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


def plot_report(data, directory) -> list[str]:
    """Write ess.png, pareto_k.png, diversity.png (and elbo.png) of a ``report``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []

    def figure(name, draw):
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        handles, _ = ax.get_legend_handles_labels()
        if 0 < len(handles) <= 10:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = directory / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(str(path))

    def per_head(ax, array, title, ylabel):
        layers = np.arange(array.shape[0])
        for head in range(array.shape[1]):
            ax.plot(layers, array[:, head], marker="o", alpha=0.6, label=f"head {head}")
        ax.set(title=title, xlabel="layer", ylabel=ylabel)

    ess_group = data["ess"]
    figure(
        "ess", lambda ax: per_head(ax, ess_group["columns"].values, "ESS of attention received / n", "normalised ESS")
    )
    k = data["pareto_k"]

    def draw_k(ax):
        per_head(ax, k["attention_mass"].values, "Pareto k-hat of attention mass", "k-hat")
        if "log_weights" in k:
            ax.plot(k["log_weights"].values, "k-", linewidth=2, label="SMC log-weights")
        ax.axhline(k.attrs.get("pareto_k_threshold", 0.7), color="red", linestyle="--", label="threshold")

    figure("pareto_k", draw_k)
    div = data["diversity"]

    def draw_diversity(ax):
        for name in ("cosine", "rank_one_distance"):
            ax.plot(div[name].values, marker="o", label=name)
        ax.set(title="representation diversity per layer", xlabel="layer")
        twin = ax.twinx()
        twin.plot(div["effective_rank"].values, "g--", marker="s", label="effective rank")
        twin.set_ylabel("effective rank")
        twin.legend(loc="upper right", fontsize=7)

    figure("diversity", draw_diversity)
    if "elbo" in data.groups():
        figure(
            "elbo",
            lambda ax: (
                ax.plot(data["elbo"]["elbo"].values, marker="o"),
                ax.set(title="mean-field ELBO", xlabel="iteration", ylabel="ELBO"),
            ),
        )
    return written
