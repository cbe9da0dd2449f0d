"""A saved model is rebuilt from its config: a PT that differs from what its config declares
(an engine setting changed after construction, a Pairwise other than the declared one) is
refused by save_pretrained and the torch export, naming what differs."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import probformer
from probformer.models import pretrained, registry
from tests.probformer.models.pretrained.test_pretrained import CONFIGS, tiny

CHANGES = {  # an engine setting, and a value other than the tiny PT's
    "iterations": 5,
    "schedule": "parallel",
    "damping": (0.3, 0.0),
    "step_size": (1.0, 0.5),
    "dropout": 0.2,
    "exit_threshold": 0.5,
}


@given(setting=st.sampled_from(sorted(CHANGES)), on=st.sampled_from(["engine", "config"]))
def test_an_engine_setting_changed_after_construction_is_refused_by_name(tmp_path_factory, setting, on):
    """A saved model is rebuilt from its config: a setting changed on the engine (or on the
    config, where it has one) after construction would reload as something else."""
    model = tiny("probabilistic_transformer")
    if on == "config" and not hasattr(model.config, setting):
        on = "engine"  # damping and step size are engine arguments only
    setattr(model.mean_field if on == "engine" else model.config, setting, CHANGES[setting])
    folder = tmp_path_factory.mktemp("drift")
    for write in (
        lambda: pretrained.save_pretrained(model, folder / "saved"),
        lambda: probformer.export(model, folder / "torch", "torch"),
    ):
        with pytest.raises(ValueError, match=f"not what its config declares: {setting}="):
            write()
    assert not (folder / "saved").exists() and not (folder / "torch").exists()


def test_a_kernel_chosen_after_construction_is_saved_with_the_configs():
    """Kernels compute the same answers: a model run on another kernel saves as declared."""
    model = tiny("probabilistic_transformer").double()
    model.mean_field.kernel = "fused"
    assert model.undeclared_engine_settings() == []


def test_a_pairwise_factor_other_than_the_declared_one_is_refused_on_save(tmp_path):
    """The config declares Pairwise(labels, 'chain()', 0): another topology, gamma or class in
    its place, or none, would reload as the declared one (only the first factor was let by)."""
    from graphs.factors import Pairwise

    def pt():
        torch.manual_seed(0)
        return registry.build(
            "probabilistic_transformer", {**CONFIGS["probabilistic_transformer"], "pairwise": "chain()"}
        )

    pretrained.save_pretrained(pt(), tmp_path / "declared")  # the declared factor itself
    labels = CONFIGS["probabilistic_transformer"]["labels"]
    for name, replacement in (("window", Pairwise(labels, "window(2)")), ("gamma", Pairwise(labels, "chain()", 1))):
        model = pt()
        model.crf.factors[0] = replacement
        with pytest.raises(ValueError, match=r"cannot save the factor\(s\) '\w+' \(Pairwise\)"):
            pretrained.save_pretrained(model, tmp_path / name)
    removed = pt()
    del removed.crf.factors[0]
    with pytest.raises(ValueError, match=r"the config's Pairwise \(removed"):
        pretrained.save_pretrained(removed, tmp_path / "removed")
