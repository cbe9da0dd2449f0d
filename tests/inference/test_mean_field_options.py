"""The mean-field engine's collaborators: ``MeanFieldOptions`` (the frozen settings) and what
reads them.

The kernel choice is checked against a table written from the documented rules (``MeanField``'s
``kernel`` argument, docs/perf.md): a pure function of (options, CRF, n, device, training),
called here with options built by hand, no engine. The score bound's precision decision is
checked against the bound computed in numpy. And a forward, a kernel choice, a schedule or
the bound writes no attribute of the engine: its state after them is the state before.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphs
import inference
from inference.mean_field.kernels import choice as kernel_choice
from inference.mean_field.kernels import head_kernels
from inference.mean_field.message_weights import MessageWeights
from inference.mean_field.options import MeanFieldOptions
from tests.builders import shared_crf

pytestmark = pytest.mark.usefixtures("one_thread")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device name: no GPU is needed to choose

# (options, shared ternary form, n, device, training) -> kernel, from the documented rules:
# an explicit kernel is kept; auto is naive whenever the heads need materialising (head damping
# or step size, the sequential schedule, an adaptive span, dropout while training), flex on
# CUDA, and on the CPU fused from 129 nodes (513 with the shared ternary form), else naive.
TABLE = [
    (dict(kernel="naive"), False, 1000, CUDA, True, "naive"),
    (dict(kernel="fused"), False, 5, CPU, True, "fused"),
    (dict(kernel="fused", dropout=0.1), False, 5, CPU, False, "fused"),
    (dict(kernel="flex", dropout=0.1), False, 5, CUDA, False, "flex"),
    (dict(), False, 10, CUDA, True, "flex"),
    (dict(), True, 10, CUDA, False, "flex"),
    (dict(), False, 128, CPU, False, "naive"),
    (dict(), False, 129, CPU, False, "fused"),
    (dict(), True, 128, CPU, False, "naive"),
    (dict(), True, 512, CPU, False, "naive"),
    (dict(), True, 513, CPU, False, "fused"),
    (dict(dropout=0.1), False, 1000, CPU, False, "fused"),
    (dict(dropout=0.1), False, 1000, CPU, True, "naive"),
    (dict(dropout=0.1), False, 1000, CUDA, True, "naive"),
    (dict(dropout=0.1), False, 1000, CUDA, False, "flex"),
    (dict(damping=(0.0, 0.5)), False, 1000, CUDA, False, "naive"),
    (dict(damping=(0.5, 0.0)), False, 1000, CUDA, False, "flex"),  # label damping: any kernel
    (dict(step_size=(1.0, 0.5)), False, 1000, CPU, False, "naive"),
    (dict(step_size=(0.5, 1.0)), False, 1000, CPU, False, "fused"),
    (dict(schedule="sequential"), False, 1000, CUDA, False, "naive"),
    (dict(adaptive_span=True), False, 1000, CUDA, False, "naive"),
]


def grouped_crf():
    return graphs.CRF(vocab_size=7, labels=3, channels=2, rank=2)


@pytest.mark.parametrize(("settings", "shared", "n", "device", "training", "expected"), TABLE)
def test_the_kernel_choice_follows_the_documented_table(settings, shared, n, device, training, expected):
    if expected == "fused" and device == CPU and not head_kernels.fused_available(CPU):
        pytest.skip("no CPU flash kernel: auto never picks fused here")
    crf = shared_crf() if shared else grouped_crf()
    options = MeanFieldOptions(**settings)
    assert kernel_choice.resolved_kernel(options, crf, n, device, training) == expected


def test_training_is_an_argument_of_the_choice_not_a_frozen_setting():
    """The same options refuse dropout on fused heads while training and accept it in eval."""
    options = MeanFieldOptions(kernel="fused", dropout=0.1)
    assert kernel_choice.resolved_kernel(options, grouped_crf(), 5, CPU, False) == "fused"
    with pytest.raises(ValueError, match="kernel='fused' cannot apply dropout"):
        kernel_choice.resolved_kernel(options, grouped_crf(), 5, CPU, True)
    engine = inference.MeanField(grouped_crf(), kernel="fused", dropout=0.1)
    assert engine.eval().resolved_kernel(5, CPU) == "fused"
    with pytest.raises(ValueError, match="cannot apply dropout"):
        engine.train().resolved_kernel(5, CPU)


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


def numpy_score_bound(crf) -> float:
    """max over groups and channels of max_a |U_a| max_b |V_b|, in numpy."""
    u, v, _ = (None if t is None else t.detach().numpy() for t in crf.projection_tables())
    return float((np.linalg.norm(u, axis=-1).max(-1) * np.linalg.norm(v, axis=-1).max(-1)).max())


@given(st.floats(0.05, 20.0))
def test_the_precision_follows_the_score_bound_computed_in_numpy(scale):
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=7, labels=3, channels=2, rank=3)
    with torch.no_grad():
        for p in (crf.ternary_u, crf.ternary_v):
            p.mul_(6.0)
    bound = numpy_score_bound(crf)
    if abs(abs(scale) * bound - 512) < 1e-3 * 512:
        return  # too close to the limit for float32 rounding to agree
    expected = torch.float64 if scale * bound > 512 else None
    assert kernel_choice.fused_compute_dtype(crf, kernel_choice.ScoreBound(), scale) == expected


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
