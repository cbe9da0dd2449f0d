"""What each engine compiles of a declaration, and the refusal of what it cannot.

An engine is built from a ``graphs.CRF``: it reads the CRF's templates (``crf.templates()``)
one by one, and each template is either compiled by the engine or refused when the
engine is built, with an error that names the factor and the engines that can handle it.
Nothing is ignored silently.

When a subclass overrides ``CRF.model``, the templates may no longer be the whole model:
the model is traced once (on a two-token sentence) and every site must be a declared
variable (``infer["variable"]``: Z, H or G) or a factor site made by one of the CRF's
templates (``infer["template"]``). Any other site (a raw ``pyro.factor``, a new latent
variable) is refused by the engines that read templates, not the model: only ``Exact``
sums the model itself. A CRF whose ``model`` is the generated one needs no trace (and no
Pyro: an exported model builds its engine without it).
"""

from __future__ import annotations

import torch

__all__ = ["ENGINES", "engines_for", "compile_templates"]

ENGINES = ("Exact", "MeanField", "Gibbs")


def engines_for(template) -> tuple[str, ...]:
    """The engines that compile ``template``."""
    from graphs.factors import BUILT_IN, Pairwise

    if template.template in BUILT_IN or isinstance(template, Pairwise):
        return ENGINES
    # a user factor: its log_potential serves Exact and Gibbs; MeanField needs the expectation
    return ("Exact", "MeanField", "Gibbs") if template.has_expectation() else ("Exact", "Gibbs")


def compile_templates(crf, engine: str) -> list:
    """The templates of ``crf`` for ``engine``, or ``ValueError`` naming the first factor (or
    model site) that ``engine`` cannot compile and the engines that can."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    templates = crf.templates()
    for template in templates:
        able = engines_for(template)
        if engine not in able:
            hint = ""
            if engine == "MeanField" and not template.has_expectation():
                hint = " (implement expected_log_potential(q, tokens, mask) for MeanField)"
            raise ValueError(
                f"{engine} cannot compile factor {template.name!r} ({template.template}){hint}; "
                f"engines that can: {', '.join(able)}"
            )
    if engine != "Exact" and _model_is_overridden(crf):
        _check_trace(crf, engine, templates)
    return templates


def _model_is_overridden(crf) -> bool:
    from graphs.crf import CRF

    return type(crf).model is not CRF.model


def _check_trace(crf, engine: str, templates: list) -> None:
    """Every site of ``crf.model`` on a two-token sentence is a variable or a template's."""
    from pyro import poutine
    from pyro.poutine.util import site_is_subsample

    tokens = torch.zeros(1, 2, dtype=torch.long, device=crf.unary.device)
    with torch.no_grad():
        trace = poutine.trace(crf.model).get_trace(tokens)
    known = {t.template for t in templates}
    owner = type(crf).__name__
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        if site["is_observed"]:
            template = site["infer"].get("template")
            if template not in known:
                made = "not made by a template" if template is None else f"made by {template!r}, not in crf.templates()"
                raise ValueError(
                    f"{engine} cannot compile factor site {name!r} of {owner}.model ({made}): {engine} reads the "
                    f"templates, not the model, and would ignore it; engines that can: Exact. Declare it as a "
                    f"graphs.Factor in CRF(factors=[...]) instead"
                )
        elif site["infer"].get("variable") not in ("Z", "H", "G"):
            raise ValueError(
                f"{engine} cannot compile latent site {name!r} of {owner}.model (not a declared Z, H or G "
                f"variable); engines that can: Exact"
            )
