"""Every ArviZ call of the project lives here, so that the move from the classic
0.2x API (pinned: ArviZ 1.x needs Python >= 3.12) to 1.x touches one file.

Arrays follow ArviZ's layout: ``[chain, draw, *shape]``.
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["from_numpyro", "from_arrays", "from_datasets", "ess", "rhat", "psislw"]


def _arviz():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the 0.2x -> 1.x refactor notice
        import arviz

    return arviz


def from_numpyro(mcmc):
    """``InferenceData`` (posterior, sample_stats) of a finished NumPyro MCMC run."""
    return _arviz().from_numpyro(mcmc, log_likelihood=False)


def from_arrays(groups: dict[str, dict[str, np.ndarray]], dims=None, coords=None):
    """``InferenceData`` from ``{group: {name: array}}`` (e.g. {"posterior": {...}})."""
    return _arviz().from_dict(**groups, dims=dims, coords=coords)


def ess(draws: np.ndarray) -> np.ndarray:
    """Bulk effective sample size of each coordinate of ``draws [chain, draw, *shape]``."""
    az = _arviz()
    return az.ess(az.convert_to_dataset(np.asarray(draws, dtype=float)), method="bulk")["x"].values


def rhat(draws: np.ndarray) -> np.ndarray:
    """Rank-normalised split R-hat of each coordinate of ``draws [chain, draw, *shape]``."""
    az = _arviz()
    return az.rhat(az.convert_to_dataset(np.asarray(draws, dtype=float)), method="rank")["x"].values


def psislw(log_weights: np.ndarray, relative_efficiency: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Pareto-smoothed log importance weights and the Pareto k-hat of each row.

    ``log_weights [..., S]`` are log importance *ratios* (the last axis holds the
    S draws). ArviZ 0.2x takes them as they are (ArviZ 1.x's ``psislw`` follows the
    LOO convention and wants them negated: mind it when migrating).
    """
    smoothed, khat = _arviz().psislw(np.asarray(log_weights, dtype=float), reff=relative_efficiency)
    return np.asarray(smoothed), np.asarray(khat)


def from_datasets(groups: dict[str, dict[str, tuple[list[str], np.ndarray]]], attrs: dict | None = None):
    """``InferenceData`` with the given groups (names outside ArviZ's scheme are fine:
    its warning about them is silenced), each ``{variable: (dims, array)}``."""
    import xarray

    az = _arviz()
    datasets = {
        name: xarray.Dataset({k: (dims, np.asarray(v)) for k, (dims, v) in variables.items()}, attrs=attrs or {})
        for name, variables in groups.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return az.InferenceData(**datasets)
