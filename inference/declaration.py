"""What each engine compiles of a declaration, and the refusal of what it cannot.

An engine is built from a ``graphs.CRF``: it reads the CRF's templates (``crf.templates()``)
one by one, and each template is either compiled by the engine or refused when the
engine is built, with an error that names the factor and the engines that can handle it.
Nothing is ignored silently.

When a subclass overrides ``CRF.model``, the templates may no longer be the whole model,
and no trace can prove that they are: a site some sentences never reach, a scale, a mask
or a blocked site leaves no mark a trace could check. So an overridden model is refused by
the engines that read templates, not the model; only ``Exact`` sums the model itself. A
CRF whose ``model`` is the generated one is checked from its templates alone (no Pyro: an
exported model builds its engine without it).
"""

from __future__ import annotations

__all__ = ["ENGINES", "engines_for", "compile_templates", "model_is_overridden"]

ENGINES = ("Exact", "MeanField", "Gibbs")


def engines_for(template) -> tuple[str, ...]:
    """The engines that compile ``template``."""
    from graphs.factors import BUILT_IN, Pairwise

    if template.template in BUILT_IN or isinstance(template, Pairwise):
        return ENGINES
    # a user factor: Exact and Gibbs score its log_potential, MeanField takes its expectation
    needs = {
        "Exact": template.has_log_potential,
        "MeanField": template.has_expectation,
        "Gibbs": template.has_log_potential,
    }
    return tuple(engine for engine in ENGINES if needs[engine]())


_HINTS = {  # what a user factor lacks when an engine cannot compile it
    "Exact": "implement log_potential(z, tokens, mask) -> [B] for Exact and Gibbs",
    "Gibbs": "implement log_potential(z, tokens, mask) -> [B] for Exact and Gibbs",
    "MeanField": "implement expected_log_potential(q, tokens, mask) for MeanField",
}


def compile_templates(crf, engine: str) -> list:
    """The templates of ``crf`` for ``engine``, or ``ValueError`` naming the first factor (or
    model site) that ``engine`` cannot compile and the engines that can."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    templates = crf.templates()
    for template in templates:
        able = engines_for(template)
        if engine not in able:
            raise ValueError(
                f"{engine} cannot compile factor {template.name!r} ({template.template}) ({_HINTS[engine]}); "
                f"engines that can: {', '.join(able) or 'none'}"
            )
    if engine != "Exact" and model_is_overridden(crf):
        owner = type(crf).__name__
        raise ValueError(
            f"{engine} cannot compile {owner}.model: it overrides CRF.model, and {engine} reads the CRF's "
            "templates, not its model, so whatever the override adds or changes (a site, a scale, a mask, a "
            "blocked site) would be ignored; engines that can: Exact. Declare an extra factor as a graphs.Factor "
            "in CRF(factors=[...]) instead"
        )
    return templates


def model_is_overridden(crf) -> bool:
    from graphs.crf import CRF

    return type(crf).model is not CRF.model
