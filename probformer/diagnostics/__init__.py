"""Diagnostics: ESS, Pareto-k (ArviZ), representation diversity, and a model report."""

from probformer.diagnostics.report import (  # noqa: F401
    MIN_PSIS_DRAWS,
    Diversity,
    ParetoK,
    diversity,
    ess,
    pareto_k,
    plot_report,
    report,
)

__all__ = ["MIN_PSIS_DRAWS", "ess", "pareto_k", "ParetoK", "diversity", "Diversity", "report", "plot_report"]
