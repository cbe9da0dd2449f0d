"""The mean-field engine's frozen settings (``MeanFieldOptions``): parsed once, scales by
hand, a written setting replaces the options, and nothing writes the engine's attributes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs
import inference
from inference.mean_field.message_weights import MessageWeights
from tests.builders import grouped_crf

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_engine_parses_its_arguments_into_one_frozen_options_object():
    crf = graphs.CRF(vocab_size=7, labels=4, channels=2, rank=2)
    engine = inference.MeanField(crf, iterations=3, damping=0.25, step_size=(0.5, 1), weights="reference", span=True)
    assert engine.options.iterations == 3
    assert engine.options.damping == (0.25, 0.25) and engine.options.step_size == (0.5, 1.0)
    assert engine.options.weights == MessageWeights(attention=4.0, topic_logits=4.0)  # lambda_H = 1/d
    assert engine.options.adaptive_span is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.options.iterations = 5


def test_the_scales_are_the_weights_times_the_mup_factors_by_hand():
    """d = 4 labels, r = 2, no global labels: tau = d / r = 2; head logits tau * d = 8, ternary
    messages d = 4, topic message max(g, 1) = 1, topic logits tau * 1 = 2."""
    crf = graphs.CRF(vocab_size=7, labels=4, channels=2, rank=2)
    weights = {"unary": 1.5, "head": 2.0, "dependents": 3.0, "topic": 5.0, "attention": 7.0, "topic_logits": 11.0}
    plain = inference.MeanField(crf, weights=weights).scales()
    assert plain == weights
    with_mup = inference.MeanField(crf, weights=weights, mup=True).scales()
    expected = {"unary": 1.5, "head": 8.0, "dependents": 12.0, "topic": 5.0, "attention": 56.0, "topic_logits": 22.0}
    assert with_mup == expected


def test_writing_an_engine_setting_replaces_its_options():
    """An attribute write (the deploy exporter's ``engine.kernel = "naive"``) makes new options;
    options taken before keep their value, and the forward follows the new one."""
    torch.manual_seed(0)
    crf = grouped_crf()
    tokens = torch.randint(0, 7, (2, 6))
    engine = inference.MeanField(crf, iterations=4)
    before = engine.options
    engine.iterations = 1
    assert engine.iterations == 1 and engine.options.iterations == 1 and before.iterations == 4
    with torch.no_grad():
        one = engine(tokens)
        torch.testing.assert_close(one.logits, inference.MeanField(crf, iterations=1)(tokens).logits, rtol=0, atol=0)
        assert one.trace["logits"].shape[0] == 1


def engine_state(engine) -> dict:
    """Every instance attribute of the engine and its submodules, by identity."""
    return {(name, key): id(value) for name, module in engine.named_modules() for key, value in vars(module).items()}


@pytest.mark.parametrize("kernel", ["naive", "fused"])
@pytest.mark.parametrize("schedule", ["async", "sequential"])
def test_nothing_writes_the_engines_attributes(kernel, schedule):
    """A forward, its ELBO and trace leave every attribute of the engine as it was, also when a
    parameter change makes the score bound be read again (its cache is the engine's own object,
    which changes inside)."""
    if kernel == "fused" and schedule == "sequential":
        pytest.skip("the fused kernel has no sequential schedule")
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=7, labels=3, channels=2, rank=3)
    engine = inference.MeanField(crf, iterations=2, kernel=kernel, schedule=schedule)
    tokens = torch.randint(0, 7, (2, 5))
    state = engine_state(engine)
    with torch.no_grad():
        for p in (crf.ternary_u, crf.ternary_v):
            p.mul_(100.0)  # the bound now far past 512: the next read must find float64
        posterior = engine(tokens)
        computed = (posterior.elbo, posterior.trace, posterior.h)  # each computed on first access
    assert torch.isfinite(computed[0]).all() and len(computed[1]["logits"]) == 2
    assert engine.fused_compute_dtype(1.0) == torch.float64
    assert engine_state(engine) == state


NAMES = [f.name for f in dataclasses.fields(MessageWeights)]


@given(
    key=st.sampled_from(NAMES),
    value=st.one_of(
        st.sampled_from(["1e400", "-inf", "nan", "0.5"]),  # text float() would read
        st.booleans(),
        st.none(),
        st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: not math.isfinite(v)),
    ),
)
def test_a_weight_that_is_not_a_finite_real_number_is_refused_naming_it(key, value):
    """Oracle: the weights multiply logits, so each must be a finite int or float; text or a
    bool (which float() would turn into a number) and NaN or infinity are refused by name."""
    with pytest.raises((TypeError, ValueError), match=f"message weight '{key}'"):
        MessageWeights.parse({key: value}, labels=4)


@given(
    key=st.sampled_from(NAMES), value=st.integers(-(10**9), 10**9) | st.floats(allow_nan=False, allow_infinity=False)
)
def test_a_finite_real_weight_is_kept_as_a_float(key, value):
    weights = MessageWeights.parse({key: value}, labels=4)
    assert getattr(weights, key) == float(value) and type(getattr(weights, key)) is float


@given(
    damping=st.sampled_from([0.0, 0.5, (0.0, 0.5), (0.3, 0.0)]),
    step_size=st.sampled_from([1.0, 0.5, (1.0, 0.3)]),
    initial=st.sampled_from(["none", "ones"]),
)
def test_the_sequential_schedule_refuses_what_coordinate_ascent_cannot_apply(damping, step_size, initial):
    """It ignored a damping or step size (the same answer as without), and with head damping
    and the cache of ones it damped every head update against ones: another fixed point, and
    an ELBO that fell. Refused unless all three are the plain setting."""
    crf = graphs.CRF(vocab_size=5, labels=2, channels=1, rank=2)
    build = lambda: inference.MeanField(  # noqa: E731
        crf, schedule="sequential", damping=damping, step_size=step_size, initial_head_logits=initial
    )
    plain = damping == 0.0 and step_size == 1.0 and initial == "none"
    if plain:
        build()
    else:
        with pytest.raises(ValueError, match="schedule 'sequential' is coordinate ascent"):
            build()
        inference.MeanField(crf, schedule="async", damping=damping, step_size=step_size, initial_head_logits=initial)


def test_the_sequential_schedule_refuses_a_product_key_memory_by_name():
    """Its ELBO after every step met the memory's (probs, index) pair: a bare TypeError."""
    crf = graphs.CRF(vocab_size=5, labels=2, global_labels=4, global_memory="product_key")
    with pytest.raises(ValueError, match="product-key memory is not a CRF factor"):
        inference.MeanField(crf, schedule="sequential")


def test_a_written_setting_cannot_reach_what_the_sequential_schedule_refuses():
    """OptionView wrote the options without the constructor's checks."""
    crf = graphs.CRF(vocab_size=5, labels=2, channels=1, rank=2)
    damped = inference.MeanField(crf, damping=0.5)
    with pytest.raises(ValueError, match="schedule 'sequential' is coordinate ascent"):
        damped.schedule = "sequential"
    assert damped.schedule == "async"
    sequential = inference.MeanField(crf, schedule="sequential")
    with pytest.raises(ValueError, match="schedule 'sequential' is coordinate ascent"):
        sequential.damping = 0.5
    sequential.damping = 0.0  # the plain setting, as a number: kept
