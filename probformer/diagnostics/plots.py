"""``plot_report(report, directory)``: the figures of a ``report`` and a Markdown page
(``report.md``) that shows them with a paragraph each on how to read them.

Every figure takes its names from the report: the x axis is the report's depth dim
(``layer``, or ``iteration`` for the PT), the lines are its width dim (``head``, or
``channel``), the y labels are the variables' long names and units, and threshold lines
carry their meaning in the legend. Values are means over the batch's sentences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from probformer.diagnostics.page import write_page
from probformer.diagnostics.report import VARIABLES
from probformer.diagnostics.trace_measures import mean_over_sentences

__all__ = ["plot_report", "FIGURES"]

# figure name -> the sample_stats variables it needs (any one of them)
FIGURES = {
    "ess": ("query_ess", "received_ess"),
    "pareto_k": ("received_pareto_k", "smc_pareto_k"),
    "diversity": ("cosine",),
    "elbo": ("elbo",),
    "routing": ("cluster_ess",),
}
MAX_LEGEND_LINES = 10


def plot_report(data, directory) -> list[str]:
    """Write the figures ``data`` has variables for (ess.png, pareto_k.png, diversity.png,
    elbo.png, routing.png) and ``report.md`` into ``directory``; the figure paths, then the
    page's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stats = data["sample_stats"]
    depth, width = stats.attrs["depth_dim"], stats.attrs["width_dim"]
    draw = {"ess": _draw_ess, "pareto_k": _draw_pareto_k, "diversity": _draw_diversity, "elbo": _draw_elbo}
    draw["routing"] = _draw_routing
    written = []
    for name, needs in FIGURES.items():
        if not any(variable in stats for variable in needs):
            continue
        panels = 3 if name == "diversity" else 2 if name == "ess" and "query_ess" in stats else 1
        figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.6), squeeze=False)
        draw[name](stats, list(axes[0]), depth, width)
        for axis in axes[0]:
            axis.grid(alpha=0.3)
            axis.ticklabel_format(axis="y", style="plain", useOffset=False)
            axis.xaxis.get_major_locator().set_params(integer=True)
            axis.set_xlabel(_depth_label(depth))
            handles, _ = axis.get_legend_handles_labels()
            if 0 < len(handles) <= MAX_LEGEND_LINES + 2:
                # under the axes, never over the curves and threshold lines it names
                axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        figure.tight_layout()
        path = directory / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(str(path))
    page = write_page(data, directory, [Path(p).name for p in written])
    return [*written, str(page)]


def _depth_label(depth: str) -> str:
    return "iteration (mean-field step)" if depth == "iteration" else "layer"


# the y axis of each plotted variable: a short name, then its units from VARIABLES
AXIS_NAMES = {
    "query_ess": "ESS / n",
    "received_ess": "ESS / n",
    "received_pareto_k": "Pareto k-hat",
    "cosine": "cosine similarity",
    "rank_one_distance": "distance",
    "effective_rank": "effective rank",
    "elbo": "ELBO",
    "cluster_ess": "ESS / clusters",
}


def _ylabel(name: str) -> str:
    return f"{AXIS_NAMES[name]} ({VARIABLES[name][1]})"


def _mean_over_sentences(array, keep: list[str]) -> np.ndarray:
    """``array`` averaged over chain and draw (``trace_measures.mean_over_sentences``), dims ``keep``."""
    values = array.transpose("chain", "draw", *keep).values
    return mean_over_sentences(values.reshape(-1, *values.shape[2:]))


def _per_width(axis, stats, name: str, depth: str, width: str) -> None:
    """One line per head (channel) of ``name [depth, width]`` against depth."""
    values = _mean_over_sentences(stats[name], [depth, width])
    steps = np.arange(values.shape[0])
    legend = values.shape[1] <= MAX_LEGEND_LINES
    for index in range(values.shape[1]):
        label = f"{width} {index}" if legend else None
        axis.plot(steps, values[:, index], marker="o", alpha=0.7, label=label)
    axis.set_ylabel(_ylabel(name))


def _draw_ess(stats, axes, depth, width) -> None:
    names = [n for n in ("query_ess", "received_ess") if n in stats]
    for axis, name in zip(axes, names):
        _per_width(axis, stats, name, depth, width)
        axis.set_title(VARIABLES[name][0], fontsize=9)
        axis.axhline(1.0, color="grey", linestyle=":", label="1 = spread evenly over every real token")
    if "smc_ess" in stats:
        values = _mean_over_sentences(stats["smc_ess"], [depth])
        axes[-1].plot(values, "k-", linewidth=2, label="SMC weights")
    for axis in axes:
        axis.set_ylim(bottom=0)


def _draw_pareto_k(stats, axes, depth, width) -> None:
    (axis,) = axes
    if "received_pareto_k" in stats:
        _per_width(axis, stats, "received_pareto_k", depth, width)
    if "smc_pareto_k" in stats:
        axis.plot(_mean_over_sentences(stats["smc_pareto_k"], [depth]), "k-", linewidth=2, label="SMC weights")
    threshold = stats.attrs["pareto_k_threshold"]
    if np.isfinite(threshold):
        axis.axhline(threshold, color="red", linestyle="--", label=f"k = {threshold:.2f} (Pareto-k threshold)")
    axis.axhline(0.5, color="orange", linestyle=":", label="k = 0.5 (reliable below)")
    axis.set_ylabel(_ylabel("received_pareto_k"))
    note = "" if stats.attrs["pareto_k_reliable"] else "\n(sentences under 21 tokens have no k-hat: left out)"
    axis.set_title("Pareto k-hat of importance weights" + note, fontsize=9)


def _draw_diversity(stats, axes, depth, width) -> None:
    for axis, name in zip(axes, ("cosine", "rank_one_distance", "effective_rank")):
        values = stats[name].transpose("chain", "draw", depth).values.reshape(-1, stats.sizes[depth])
        steps = np.arange(values.shape[1])
        axis.plot(steps, values.mean(0), marker="o", label="mean over sentences")
        axis.fill_between(steps, values.min(0), values.max(0), alpha=0.2, label="range over sentences")
        axis.set_ylabel(_ylabel(name))
        axis.set_title(VARIABLES[name][0], fontsize=9)
    axes[0].axhline(1.0, color="red", linestyle="--", label="1 = all tokens point the same way")
    axes[1].axhline(0.0, color="red", linestyle="--", label="0 = all tokens equal (collapsed)")
    axes[2].axhline(1.0, color="red", linestyle="--", label="1 = rank one (collapsed)")


def _draw_elbo(stats, axes, depth, width) -> None:
    (axis,) = axes
    values = stats["elbo"].transpose("chain", "draw", "iteration").values.reshape(-1, stats.sizes["iteration"])
    steps = np.arange(values.shape[1])
    axis.plot(steps, values.mean(0), marker="o", label="mean over sentences")
    axis.fill_between(steps, values.min(0), values.max(0), alpha=0.2, label="range over sentences")
    axis.set_ylabel(_ylabel("elbo"))
    axis.set_title(elbo_title(stats.attrs.get("schedule", ""), stats.attrs.get("coordinate_ascent", 0)), fontsize=9)


def elbo_title(schedule: str, coordinate_ascent) -> str:
    """What the ELBO curve should do: only coordinate ascent (the sequential schedule with
    the CRF's own messages, ``report.coordinate_ascent``) never lowers it; any other
    setting may lower it or oscillate while the model still trains well."""
    named = f"{schedule} schedule" if schedule else "schedule not recorded"
    if coordinate_ascent:
        return f"mean-field ELBO, {named}\n(coordinate ascent: never falls)"
    return f"mean-field ELBO, {named}\n(not coordinate ascent: need not rise)"


def _draw_routing(stats, axes, depth, width) -> None:
    (axis,) = axes
    axis.plot(_mean_over_sentences(stats["cluster_ess"], [depth]), marker="o", label="mean over sentences")
    axis.axhline(1.0, color="grey", linestyle=":", label="1 = every cluster holds as many tokens")
    axis.set_ylim(bottom=0)
    axis.set_ylabel(_ylabel("cluster_ess"))
    axis.set_title(VARIABLES["cluster_ess"][0], fontsize=9)
