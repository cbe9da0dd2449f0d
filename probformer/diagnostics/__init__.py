"""Diagnostics: ESS, Pareto-k (ArviZ), representation diversity (``estimators``), the
per-sentence measures of a model's trace (``trace_measures``), a model report as ArviZ
InferenceData (``report``), its figures and Markdown page (``plots``, ``page``) and the
per-layer probe the trainer logs (``probe``)."""

from probformer.diagnostics.estimators import MIN_PSIS_DRAWS, Diversity, ParetoK, diversity, ess, pareto_k
from probformer.diagnostics.inference_gap import InferenceGap, inference_gap
from probformer.diagnostics.plots import plot_report
from probformer.diagnostics.report import describe, layer_means, report

__all__ = [
    "MIN_PSIS_DRAWS",
    "ess",
    "pareto_k",
    "ParetoK",
    "diversity",
    "Diversity",
    "report",
    "plot_report",
    "describe",
    "layer_means",
    "inference_gap",
    "InferenceGap",
]
