"""``report.md``: the figures of a diagnostics report on one Markdown page, each with a
paragraph on how to read it (written by ``plot_report`` beside the figures)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_page", "READING"]

# figure -> (title, how to read it); {depth} and {width} become the report's dim names
READING = {
    "ess": (
        "Effective sample size of attention",
        "Attention read as importance sampling: a row of attention weights is a set of "
        "importance weights over the sentence's tokens, and ESS = (sum w)^2 / sum w^2 counts "
        "how many tokens effectively carry them. Both panels divide it by the sentence's real "
        "length n, so 1 (dotted line) means spread evenly over every token and 1/n means one "
        "token takes everything. Left: the mean over queries of each query's own row (how "
        "focused one token's choice is); right: the attention each token receives, summed "
        "over queries (whether a few tokens soak up everyone's attention). One line per "
        "{width}, against {depth}; values are means over the batch's sentences. A {width} "
        "whose received ESS falls towards 1/n with {depth} is degenerating onto a few tokens.",
    ),
    "pareto_k": (
        "Pareto k-hat",
        "PSIS k-hat (ArviZ's psislw) of the log attention each token receives, one line per "
        "{width}, and of the SMC log-weights where the model has them (black). It estimates "
        "the tail shape of the weights: below 0.5 (orange line) the weights are well behaved; "
        "above the dashed red line (min(1 - 1/log10 n, 0.7), ArviZ's sample-size-aware "
        "threshold) a handful of tokens dominate and importance-weighted averages over them "
        "are unreliable. k-hat needs at least 21 real tokens: shorter sentences give NaN and "
        "are left out of the mean; a sentence where a few tokens hold most of the weight gives +inf "
        "(degenerate) and counts, so a mean of +inf is off the top of the plot.",
    ),
    "diversity": (
        "Representation diversity (over-smoothing)",
        "Whether token states collapse onto one another with {depth}. Left: the mean pairwise "
        "cosine similarity of distinct real tokens (1 = all point the same way). Middle: the "
        "relative distance ||X - mean(X)|| / ||X|| to the subspace where all tokens are equal "
        "(0 = collapsed). Right: the effective rank, exp of the entropy of the normalised "
        "singular values, in dimensions (1 = rank one). The line is the mean over sentences, "
        "the band their range. Cosine rising towards 1 while distance and rank fall is "
        "over-smoothing.",
    ),
    "elbo": (
        "Mean-field ELBO",
        "The evidence lower bound of the PT's mean-field inference after each iteration, in "
        "nats per sentence (a lower bound on the log partition function of the sentence's "
        "CRF): mean over sentences, band = range. {elbo_reading}",
    ),
    "routing": (
        "Cluster routing",
        "SwarmFormer routes tokens to clusters: per {depth}, the ESS of the number of real "
        "tokens each cluster holds, divided by the number of clusters C. 1 (dotted) means every "
        "cluster holds as many tokens; 1/C means one cluster holds them all "
        "(the other clusters are wasted); layers may have different numbers C of clusters.",
    ),
}


# what the ELBO curve should do: coordinate ascent or not (report.coordinate_ascent)
ELBO_READING = {
    True: (
        "This model ran the {schedule} schedule with the CRF's own messages (information "
        "weights 1, no μP scales, no damping): coordinate ascent, where each update maximises "
        "the bound in one node's factor, so the curve never falls and flattens out as "
        "inference converges; a fall means a numerical problem."
    ),
    False: (
        "This model ran the {schedule} schedule{settings}: not coordinate ascent on this bound "
        "(the unrolled schedules update many nodes at once from the previous iteration's "
        "values; information weights, μP scales and damping change the updates), so the bound "
        "need not rise at every iteration, and a trained PT's curve may fall or stay flat while "
        "its predictions are good (training fits the task loss, not the ELBO). Read it as how "
        "much inference still changes: a curve that still moves at the last iteration means "
        "more iterations would change the answer; a large oscillation calls for damping."
    ),
}


def elbo_reading(schedule: str, coordinate_ascent) -> str:
    name = repr(schedule) if schedule else "(unrecorded)"
    settings = " with information weights, μP or damping other than the CRF's own" if schedule == "sequential" else ""
    return ELBO_READING[bool(coordinate_ascent)].format(schedule=name, settings=settings)


def write_page(data, directory, figures: list[str]) -> Path:
    """``directory/report.md`` showing ``figures`` (file names) with their paragraphs."""
    stats = data["sample_stats"]
    depth, width = stats.attrs["depth_dim"], stats.attrs["width_dim"]
    lines = [
        f"# Diagnostics of {stats.attrs['model']}",
        "",
        f"{stats.attrs['sentences']} sentences (padded to {stats.attrs['max_length']} tokens). The numbers are in "
        "`report.nc` (ArviZ InferenceData: group `sample_stats`, one draw per sentence; "
        "`arviz.from_netcdf('report.nc')`). Figures show means over the sentences.",
        "",
    ]
    if stats.attrs.get("schedule"):
        lines += [f"Mean-field schedule: `{stats.attrs['schedule']}`.", ""]
    for name in figures:
        title, reading = READING[Path(name).stem]
        elbo = elbo_reading(stats.attrs.get("schedule", ""), stats.attrs.get("coordinate_ascent", 0))
        text = reading.format(depth=depth, width=width, elbo_reading=elbo)
        lines += [f"## {title}", "", f"![{title}]({name})", "", text, ""]
    path = Path(directory) / "report.md"
    path.write_text("\n".join(lines))
    return path
