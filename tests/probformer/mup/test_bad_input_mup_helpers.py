"""The μP helpers refuse what is not their argument by name: given a model where a config
goes (or a config, a number, None where a model goes) they raised AttributeError, or did
nothing (``initialise``); ``param_groups`` took lr=True (a bool is not a learning rate) and
an infinite lr or weight decay; ``samples_needed(p=1e-300)`` raised ZeroDivisionError;
``width_ratios({})`` raised KeyError and ``base_point(5)`` AttributeError."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import probformer as pf
from probformer import mup
from probformer.mup import coord_check, neighbourhood

CONFIG = pf.PTConfig(vocab_size=11, labels=4, channels=2, rank=2, iterations=1, dropout=0.0)
MODEL = pf.ProbabilisticTransformer(CONFIG)
OF_A_CONFIG = ["base_width", "width_multiplier", "base_shape", "engine_scales"]
OF_A_MODEL = ["roles", "initialise"]
NOT_A_CONFIG = [5, None, {"labels": 4}, "config", MODEL]
NOT_A_MODEL = [5, None, "model", CONFIG, torch.zeros(2)]


@pytest.mark.parametrize("name", OF_A_CONFIG)
@pytest.mark.parametrize("config", NOT_A_CONFIG)
def test_what_is_not_a_config_is_refused_by_name(name, config):
    hint = r".* \(pass model.config\)" if config is MODEL else ""
    with pytest.raises(TypeError, match=rf"config must be a PTConfig \(with labels, .*\), got \w+{hint}"):
        getattr(mup, name)(config)
    with pytest.raises(TypeError, match="config must be a PTConfig"):
        mup.widen(config, 8)


@pytest.mark.parametrize("name", OF_A_MODEL)
@pytest.mark.parametrize("model", NOT_A_MODEL)
def test_what_is_not_a_model_is_refused_by_name(name, model):
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got \w+"):
        getattr(mup, name)(model)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module"):
        mup.param_groups(model, 1e-3)


@given(lr=st.one_of(st.booleans(), st.floats(max_value=0.0), st.sampled_from([math.inf, math.nan, "1e-3", None])))
def test_a_bad_learning_rate_is_refused_by_name(lr):
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0, got "):
        mup.param_groups(MODEL, lr)


@given(decay=st.one_of(st.booleans(), st.floats(max_value=-1e-300), st.sampled_from([math.inf, math.nan, "0"])))
def test_a_bad_weight_decay_is_refused_by_name(decay):
    with pytest.raises(ValueError, match=r"weight_decay must be a finite number >= 0, got "):
        mup.param_groups(MODEL, 1e-3, decay)


@given(p=st.floats(min_value=1e-307, max_value=0.999, exclude_max=True), alpha=st.floats(0.001, 0.5))
def test_samples_needed_is_the_smallest_count_for_any_p(p, alpha):
    n = neighbourhood.samples_needed(p, alpha)
    assert n >= 1 and n * -math.log1p(-p) >= -math.log(alpha) * (1 - 1e-9)


@pytest.mark.parametrize(
    ("p", "words"), [(5e-324, "p=5e-324 is too small"), (True, "must be numbers in"), ("0.1", "must be numbers in")]
)
def test_samples_needed_refuses_what_it_cannot_count_by_name(p, words):
    with pytest.raises(ValueError, match=words):
        neighbourhood.samples_needed(p)


RESULT = {
    "widths": [4, 8],
    "steps": 0,
    "seeds": 1,
    "sizes": {w: {g: [1.0] for g in coord_check.ACTIVATIONS} for w in (4, 8)},
}


@pytest.mark.parametrize("result", [{}, 5, None, {"widths": [4]}, [RESULT]])
def test_width_ratios_of_what_is_not_a_result_are_refused_by_name(result):
    with pytest.raises(ValueError, match=r"result must be coord_check.run's result, a dict with \['widths', 'steps'"):
        coord_check.width_ratios(result)


def test_width_ratios_over_widths_the_result_lacks_are_refused_by_name():
    with pytest.raises(ValueError, match=r"widths must be among the result's widths \[4, 8\], got \[4, 16\]"):
        coord_check.width_ratios(RESULT, [4, 16])


@pytest.mark.parametrize("config", [5, None, CONFIG])
def test_base_point_of_what_is_not_a_run_config_is_refused_by_name(config):
    with pytest.raises(TypeError, match=r"config must be a RunConfig"):
        neighbourhood.base_point(config)
