"""Diagnostics: ESS, Pareto-k (ArviZ), representation diversity (``metrics``), a model
report (``report``) and its figures (``plots``)."""

from probformer.diagnostics.metrics import MIN_PSIS_DRAWS, Diversity, ParetoK, diversity, ess, pareto_k
from probformer.diagnostics.plots import plot_report
from probformer.diagnostics.report import report

__all__ = ["MIN_PSIS_DRAWS", "ess", "pareto_k", "ParetoK", "diversity", "Diversity", "report", "plot_report"]
