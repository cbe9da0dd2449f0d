"""``plot_report(report, directory)``: PNG figures of a ``report``."""

from __future__ import annotations

import numpy as np

__all__ = ["plot_report"]


def plot_report(data, directory) -> list[str]:
    """Write the figures of a ``report`` that has the groups they need: ess.png (attention),
    pareto_k.png (attention or SMC weights), diversity.png (always), elbo.png (mean field),
    routing.png (clusters); returns the paths."""
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

    groups = data.groups()
    ess_group = data["ess"] if "ess" in groups else {}
    if "columns" in ess_group:
        figure(
            "ess",
            lambda ax: per_head(ax, ess_group["columns"].values, "ESS of attention received / n", "normalised ESS"),
        )
    k = data["pareto_k"] if "pareto_k" in groups else {}

    def draw_k(ax):
        if "attention_mass" in k:
            per_head(ax, k["attention_mass"].values, "Pareto k-hat of attention mass", "k-hat")
        if "log_weights" in k:
            ax.plot(k["log_weights"].values, "k-", linewidth=2, label="SMC log-weights")
            ax.set(title="Pareto k-hat", xlabel="layer", ylabel="k-hat")
        ax.axhline(k.attrs.get("pareto_k_threshold", 0.7), color="red", linestyle="--", label="threshold")

    if k:
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
    lines = {  # group: (variable, title, x label, y label)
        "elbo": ("elbo", "mean-field ELBO", "iteration", "ELBO"),
        "routing": ("cluster_ess", "ESS of cluster occupancy / clusters", "layer", "normalised ESS"),
    }
    for group, (variable, title, xlabel, ylabel) in lines.items():
        if group in groups:
            values = data[group][variable].values
            figure(group, lambda ax, v=values, s=(title, xlabel, ylabel): _line(ax, v, *s))
    return written


def _line(ax, values, title: str, xlabel: str, ylabel: str) -> None:
    ax.plot(values, marker="o")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
