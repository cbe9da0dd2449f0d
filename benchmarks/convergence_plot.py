"""The convergence study's figure: validation perplexity by epoch, per model and seed, from
``convergence_report``'s rows (matplotlib, imported on use)."""

from __future__ import annotations

from pathlib import Path


def plot(rows: list[dict], path: Path) -> None:
    """Every run's validation perplexity by epoch, one line per model and seed, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 4.5))
    colours = {"pt-small": "tab:blue", "bert-small": "tab:orange", "ut-small": "tab:green"}
    spare = iter(["tab:purple", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    for name in dict.fromkeys(row["config"] for row in rows):
        colours.setdefault(name, next(spare, "tab:gray"))
    # a diverged run (perplexities of 1e40) would squash every other curve: the axis ends a
    # little above the largest first-epoch perplexity, and points above it sit on that edge, as x
    top = 1.5 * max((row["curve"][0] for row in rows if row["curve"]), default=1.0)
    for row in rows:
        if row["curve"]:
            epochs = range(1, len(row["curve"]) + 1)
            style = "-" if row["seed"] == 0 else "--"
            label = f"{row['config']} seed {row['seed']} (lr {row['lr']:g})"
            if row["diverged_at"]:
                label += f", diverged at epoch {row['diverged_at']}"
            shown = [min(value, top) for value in row["curve"]]
            colour = colours.get(row["config"])
            axes.plot(epochs, shown, style, marker="o", color=colour, label=label)
            off = [(e, top) for e, value in zip(epochs, row["curve"]) if value > top]
            if off:
                axes.plot(*zip(*off), "x", color=colour, markersize=10, markeredgewidth=2)
    axes.set_yscale("log")
    axes.set_ylim(top=top * 1.05)
    axes.xaxis.get_major_locator().set_params(integer=True)  # epochs are whole numbers
    axes.set_xlabel("epoch")
    axes.set_ylabel("validation masked-token perplexity")
    axes.set_title("PTB MLM, small size")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves, not on them
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
