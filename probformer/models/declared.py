"""What a saved model holds is what its config declares: a model is saved as its config and
weights and rebuilt from them, so one changed after construction in a way the config does
not say (a topology swapped in, an engine setting, a factor) would reload as another model.
``save_pretrained`` and the exporter refuse it, naming what differs."""

from __future__ import annotations

from torch import nn

from probformer.models import registry

__all__ = ["check_declared", "undeclared_factors"]


def check_declared(model: nn.Module) -> None:
    """A saved model is rebuilt from its config, so it must be what its config declares: a
    PT topology swapped in, or an engine setting changed (``model.mean_field.iterations``, or
    ``model.config.iterations``) after construction would be lost, so it is refused."""
    if registry.kind_of(model) == "probabilistic_transformer":
        from graphs.topology import parse

        declared, found = parse(model.config.topology).name, model.crf.topology.name
        if declared != found:
            raise ValueError(
                f"topology {found!r} is not the config's ({declared!r}): a saved model stores the config, "
                "so build the model with the topology in PTConfig(topology=...)"
            )
        changed = model.undeclared_engine_settings()
        if changed:
            raise ValueError(
                f"the model's mean-field engine is not what its config declares: {', '.join(changed)}; a saved "
                "model stores the config, so build the model from a PTConfig with these settings"
            )


def undeclared_factors(model: nn.Module) -> list[str]:
    """A PT's factors that its config does not declare (``PTConfig(pairwise=...)`` declares
    one ``Pairwise``; another in its place counts), as "'name' (Class)": user factors added
    to ``model.crf.factors`` are Python code, which a saved model never holds."""
    return model.undeclared_factors() if registry.kind_of(model) == "probabilistic_transformer" else []
