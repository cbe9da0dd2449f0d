"""Exact sums over any enumerable Pyro function, with Pyro's own machinery.

``TraceEnum_ELBO`` traces the function with every latent site enumerated in parallel (it
finds the plate nesting and packs the tensors); ``pyro.ops.contract.contract_to_tensor``
then sums the enumerated dims and multiplies over plates, in log space, down to the
outermost plate. Every log-factor is cast to float64 first. ``inference.Exact`` calls
this for a function; a ``graphs.CRF`` declaration has its own float64 elimination there.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

__all__ = ["log_partition", "marginals"]


def _traces(function, args, kwargs, max_configurations: int):
    """The enumerated model trace (packed), the empty guide's trace, and the batch plate's
    symbol (None without one)."""
    from pyro.infer import TraceEnum_ELBO, config_enumerate

    enumerated = config_enumerate(function, "parallel")
    elbo = TraceEnum_ELBO(max_plate_nesting=_plate_nesting(function, args, kwargs))
    with warnings.catch_warnings():  # a continuous latent site is refused by name just below
        warnings.filterwarnings("ignore", "Found vars in model but not guide", UserWarning)
        warnings.filterwarnings("ignore", "TraceEnum_ELBO found no sample sites configured", UserWarning)
        model_trace, guide_trace = next(elbo._get_traces(enumerated, _empty_guide, args, kwargs))
    sites = [s for s in model_trace.nodes.values() if s["type"] == "sample"]
    for site in sites:
        if not site["is_observed"] and site["infer"].get("_enumerate_dim") is None:
            raise ValueError(
                f"site {site['name']!r} is latent but not enumerable ({type(site['fn']).__name__}): "
                f"Exact needs every latent site discrete with enumerate support"
            )
    if not sites:
        raise ValueError("the model has no sample or factor sites: nothing to sum")
    for site in sites:  # Pyro's packed log_prob would scale; the sum below reads the unscaled one
        scale = torch.as_tensor(site["scale"])
        if scale.ne(1).any():
            shown = scale.item() if scale.numel() == 1 else f"a tensor {tuple(scale.shape)}"
            raise ValueError(
                f"site {site['name']!r} is scaled by {shown} (poutine.scale, or a subsampled plate): Exact sums "
                "the model's own terms, unscaled; write a tempered term as pyro.factor(name, scale * log_prob), "
                "and give a plate its whole data"
            )
    common = set.intersection(*(_plates(s) for s in sites))
    outer = [f for f in sites[0]["cond_indep_stack"] if f.name in common]  # outermost first
    batch = model_trace.plate_to_symbol[outer[0].name] if outer else None
    batch_size = outer[0].size if outer else 1
    for site in sites:
        entries = site["packed"]["unscaled_log_prob"].numel() // batch_size
        if entries > max_configurations:
            raise ValueError(
                f"Exact: site {site['name']!r} enumerates to {entries} log-probabilities per batch element, above "
                f"max_configurations={max_configurations}; use smaller supports or raise max_configurations"
            )
    return model_trace, guide_trace, batch


def _plate_nesting(function, args, kwargs) -> int:
    """How many plate dims the function uses: one plain run (as Pyro guesses it, without
    the log line)."""
    from pyro import poutine

    with poutine.block():
        trace = poutine.trace(function).get_trace(*args, **kwargs)
    dims = [f.dim for s in trace.nodes.values() if s["type"] == "sample" for f in s["cond_indep_stack"] if f.vectorized]
    return -min(dims) if dims else 0


def _empty_guide(*args, **kwargs):
    """Every latent site is enumerated in the model: the guide samples nothing."""


def _plates(site) -> set[str]:
    return {f.name for f in site["cond_indep_stack"] if f.vectorized}


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float64 copy that keeps the packed tensor's dim names."""
    out = t.double() if t.is_floating_point() else t
    out._pyro_dims = t._pyro_dims
    return out


def log_partition(function, args, kwargs, max_configurations: int) -> torch.Tensor:
    """``[B]`` log of the total mass over the outermost plate (scalar without one)."""
    from pyro.infer.traceenum_elbo import _find_ordinal
    from pyro.ops import packed
    from pyro.ops.contract import contract_to_tensor

    model_trace, _, batch = _traces(function, args, kwargs, max_configurations)
    tree, sum_dims = OrderedDict(), set()
    for site in model_trace.nodes.values():
        if site["type"] != "sample":
            continue
        log_prob = site["packed"]["unscaled_log_prob"]
        # a mask drops an observation's term; an enumerated latent keeps its prior (it sums to
        # 1 where nothing reads it: Pyro's obs_mask idiom), as Pyro's TraceEnum_ELBO does
        if site["is_observed"] and site["packed"].get("mask") is not None:
            log_prob = packed.scale_and_mask(log_prob, mask=site["packed"]["mask"])
        tree.setdefault(_find_ordinal(model_trace, site), []).append(_wide(log_prob))
        if not site["is_observed"]:
            sum_dims.add(site["infer"]["_enumerate_symbol"])
    target = frozenset({batch}) if batch is not None else frozenset()
    total = contract_to_tensor(tree, sum_dims, target_ordinal=target)
    total = packed.unpack(total, model_trace.symbol_to_dim)
    return total.reshape(-1) if batch is not None else total.reshape(())


def marginals(function, args, kwargs, max_configurations: int) -> dict[str, torch.Tensor]:
    """``{site: probabilities [*batch, k]}`` for every enumerated latent site."""
    from pyro.infer.traceenum_elbo import _compute_marginals

    model_trace, guide_trace, _ = _traces(function, args, kwargs, max_configurations)
    result = {}
    for name, distribution in _compute_marginals(model_trace, guide_trace).items():
        support = distribution.enumerate_support(expand=False)  # [k, 1, ...]
        probs = distribution.log_prob(support).exp()  # [k, *batch]
        result[name] = probs.movedim(0, -1)
    return result
