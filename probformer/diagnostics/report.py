"""``report(model, tokens, mask)``: the diagnostics of one batch as an ArviZ
``InferenceData`` that follows ArviZ's schema, so ``az.summary``, ``az.plot_khat`` and
the rest of ArviZ read it.

The mapping (docs/diagnostics.md has the whole layout):

- ``sample_stats`` ("diagnostics of each draw, from the inference backend"): the
  model's own inference (attention read as importance sampling, mean field, SMC) is
  the backend, and one draw is one sentence of the batch: dims ``chain`` (1: the batch)
  and ``draw`` (the sentences, in order), then the variable's own dims. ``az.summary(
  report, group="sample_stats")`` gives each statistic's mean, sd and HDI over the
  sentences; ``az.plot_khat(report.sample_stats["received_pareto_k"])`` plots k-hat.
- ``constant_data``: ``tokens`` and ``mask [draw, token]``, the batch itself.

There is no ``posterior`` group: the models compute weights and marginals, not
posterior draws (so ``az.plot_ess``, an MCMC-draws plot, has nothing to run on).

The report protocol: a model offers ``diagnostic_trace(tokens, mask)`` returning a
dict with ``hidden [L, B, n, D]`` (token states per layer) and, where the model has
them, ``attention [L, B, H, n, n]`` (per head), ``log_weights [L, B, n]`` (SMC
importance weights), ``elbo [T, B]`` (mean-field bound per iteration) and ``routing``
(per layer a dict with the token-to-cluster ``assignment [B, n, C]``).

What each model kind offers, hence which variables its report has:

    ProbabilisticTransformer   diversity, attention (head marginals), elbo
    ParticleTransformer        diversity, attention, SMC log-weights
    Transformer                diversity, attention
    SwarmFormer                diversity, routing (its window attention is never materialised)
    FoldedContext              diversity (the final states, one "layer")

A part the model does not offer is left out (no variable); it is never an error.
"""

from __future__ import annotations

import numpy as np
import torch

from inference import arviz_interop
from probformer.diagnostics.trace_measures import DRAW, Measures, mean_over_sentences, measure

__all__ = ["report", "VARIABLES", "layer_means", "describe", "coordinate_ascent"]

# name -> (long name, units): the labels of every figure, table and docs entry
VARIABLES = {
    "query_ess": ("ESS of each query's attention row / n (mean over queries)", "fraction of real tokens"),
    "received_ess": ("ESS of the attention received / n", "fraction of real tokens"),
    "received_pareto_k": ("Pareto k-hat of the attention received", "dimensionless"),
    "attention_received": ("attention mass received", "queries' worth of attention"),
    "smc_ess": ("ESS of the SMC weights / n", "fraction of real tokens"),
    "smc_pareto_k": ("Pareto k-hat of the SMC weights", "dimensionless"),
    "smc_log_weights": ("SMC log-weight (mean weight 1)", "nats"),
    "cosine": ("mean pairwise cosine similarity of tokens", "cosine, -1 to 1"),
    "effective_rank": ("effective rank of the token states", "dimensions"),
    "rank_one_distance": ("relative distance to all-tokens-equal", "fraction of the norm"),
    "elbo": ("mean-field ELBO", "nats per sentence"),
    "cluster_ess": ("ESS of cluster occupancy / clusters", "fraction of clusters"),
    "cluster_tokens": ("real tokens held by the cluster", "tokens"),
}


def report(model, tokens: torch.Tensor, mask: torch.Tensor | None = None):
    """Per-sentence, per-layer diagnostics of ``model`` on one batch (padding allowed,
    any length >= 1) as an ArviZ ``InferenceData`` with groups ``sample_stats`` and
    ``constant_data`` (see the module docstring and ``measures.measure`` for the
    variables). Write it with ``.to_netcdf(path)``; ``plot_report`` draws it."""
    return to_inference_data(measure(model, tokens, mask), model, tokens)


def to_inference_data(measures: Measures, model, tokens):
    mask = measures.mask
    sentences, length = mask.shape
    stats, dims, coords = {}, {}, {"draw": np.arange(sentences)}
    for name, (variable_dims, values) in measures.variables.items():
        stats[name] = values[None]  # the one chain
        dims[name] = list(variable_dims[1:])  # from_dict adds chain and draw
        for axis, dim in enumerate(variable_dims[1:], start=1):
            coords[dim] = np.arange(values.shape[axis])
    token_ids = np.asarray(torch.as_tensor(tokens).cpu())[:, :length].astype(np.int64)
    constant = {"tokens": token_ids, "mask": mask.astype(np.int8)}
    dims |= {"tokens": [DRAW, "token"], "mask": [DRAW, "token"]}
    coords["token"] = np.arange(length)
    data = arviz_interop.from_arrays({"sample_stats": stats, "constant_data": constant}, dims=dims, coords=coords)
    attrs = {
        "model": type(model).__name__,
        "sentences": sentences,
        "max_length": length,
        "depth_dim": measures.depth,
        "width_dim": measures.width,
        "draw": "one sentence of the batch (chain: the batch)",
        "pareto_k_threshold": measures.pareto_k_threshold,
        "pareto_k_reliable": int(measures.pareto_k_reliable),
        # which mean-field schedule ran (the PT's; "" for other models), and whether its updates
        # are coordinate ascent on the reported ELBO (then, and only then, the ELBO never falls)
        "schedule": str(getattr(getattr(model, "mean_field", None), "schedule", "")),
        "coordinate_ascent": int(coordinate_ascent(getattr(model, "mean_field", None))),
    }
    for group in data.groups():
        data[group].attrs.update(attrs)
    for name, array in data["sample_stats"].data_vars.items():
        long_name, units = VARIABLES[name]
        array.attrs.update(long_name=long_name, units=units)
    data["constant_data"]["tokens"].attrs.update(long_name="token id", units="vocabulary index")
    data["constant_data"]["mask"].attrs.update(long_name="real token (1) or padding (0)", units="flag")
    return data


def coordinate_ascent(engine) -> bool:
    """Whether a mean-field engine's updates are coordinate ascent on the ELBO it reports:
    the sequential schedule with the CRF's own messages (all information weights 1, no
    μP scales, no damping, full steps). Any other setting updates with other multipliers
    or from stale values, so its ELBO may fall between iterations."""
    if engine is None or getattr(engine, "schedule", None) != "sequential" or engine.mup:
        return False
    weights = [getattr(engine.weights, name) for name in engine.weights.__dataclass_fields__]
    undamped = tuple(engine.damping) == (0.0, 0.0) and tuple(engine.step_size) == (1.0, 1.0)
    return all(w == 1.0 for w in weights) and undamped


def layer_means(data) -> dict[str, np.ndarray]:
    """Each per-layer variable averaged over the sentences and the heads: ``{name: [depth]}``
    (NaN where nothing was measured)."""
    stats = data["sample_stats"]
    depth = stats.attrs["depth_dim"]
    means = {}
    for name, array in stats.data_vars.items():
        if depth not in array.dims or {"token", "particle", "cluster"} & set(array.dims):
            continue  # per-token and per-cluster arrays are not summarised
        other = [d for d in array.dims if d != depth]
        values = np.moveaxis(array.values, array.dims.index(depth), -1).reshape(-1, array.sizes[depth])
        means[name] = mean_over_sentences(values) if other else values[0]
    return means


def describe(data) -> str:
    """The per-layer table ``probformer diagnose`` prints (means over sentences and heads)."""
    stats = data["sample_stats"]
    depth = stats.attrs["depth_dim"]
    means = layer_means(data)
    columns = [
        (name, label, width)
        for name, label, width in (
            ("received_ess", "ESS(received)/n", 15),
            ("received_pareto_k", "k-hat(received)", 15),
            ("smc_ess", "ESS(SMC)/n", 10),
            ("cosine", "cosine", 6),
            ("effective_rank", "eff.rank", 8),
            ("rank_one_distance", "dist(rank-1)", 12),
            ("cluster_ess", "ESS(clusters)", 13),
        )
        if name in means
    ]
    lines = [f"{depth:>9}  " + "  ".join(f"{label:>{width}}" for _, label, width in columns)]
    for index in range(stats.sizes[depth]):
        cells = "  ".join(f"{means[name][index]:{width}.3f}" for name, _, width in columns)
        lines.append(f"{index:9d}  {cells}")
    if "elbo" in stats:
        schedule = ""
        if stats.attrs.get("schedule"):  # what the curve should do (plots.elbo_title)
            ascent = "coordinate ascent: never falls" if stats.attrs.get("coordinate_ascent") else "need not rise"
            schedule = f"; {stats.attrs['schedule']} schedule, {ascent}"
        elbo = mean_over_sentences(stats["elbo"].values.reshape(-1, stats.sizes["iteration"]))
        lines.append(f"ELBO per iteration (nats per sentence{schedule}): " + " ".join(f"{v:.2f}" for v in elbo))
    return "\n".join(lines)
