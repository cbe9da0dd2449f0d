"""Non-finite input is refused by name wherever it enters, and one error taxonomy holds
everywhere: TypeError for a wrong type, ValueError for a wrong value, the same message for
the same mistake in every model, engine and loaded export."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference
from probformer.deploy.reader import CheckedOnnx, CheckedProgram
from probformer.models import registry
from probformer.models.pt_layer import PTLayer
from tests.builders import TINY_CONFIGS, VOCAB

BAD = [math.nan, math.inf, -math.inf]
ENGINES = {
    "Exact": lambda crf: inference.Exact(crf),
    "MeanField": lambda crf: inference.MeanField(crf, iterations=2),
    # refusals come before JAX compiles anything
    "Gibbs": lambda crf: inference.Gibbs(crf, num_samples=10, num_warmup=2, num_chains=1),
}


def embeddings_crf():
    torch.manual_seed(0)
    return graphs.CRF(embedding_size=3, labels=2, channels=1, rank=2, global_labels=2)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@given(value=st.sampled_from(BAD), batch=st.integers(1, 3), length=st.integers(1, 4), data=st.data())
@settings(max_examples=10)
def test_every_engine_refuses_non_finite_embeddings_naming_them(engine, value, batch, length, data):
    x = torch.randn(batch, length, 3)
    row, position, channel = (data.draw(st.integers(0, size - 1)) for size in (batch, length, 3))
    x[row, position, channel] = value
    with pytest.raises(ValueError, match=r"embeddings contains NaN or Inf \(first at index"):
        ENGINES[engine](embeddings_crf())(embeddings=x)


CASTS = [(torch.float64, torch.float32), (torch.float32, torch.float16)]  # (embeddings', CRF's dtype)


@pytest.mark.parametrize("engine", sorted(ENGINES) + ["TemperedSMC"])
@pytest.mark.parametrize("given,dtype", CASTS)
@given(overflows=st.booleans(), sign=st.sampled_from([1.0, -1.0]), excess=st.floats(2.0, 1e4), data=st.data())
@settings(max_examples=8, deadline=None)
def test_finite_embeddings_that_overflow_the_crfs_dtype_are_refused_naming_the_overflow(
    engine, given, dtype, overflows, sign, excess, data
):
    # a finite value `excess` times the dtype's largest (rounds to inf in it), or that many times
    # smaller (fits): clear of the rounding boundary, so finfo alone says which
    largest = torch.finfo(dtype).max
    value = sign * (largest * excess if overflows else largest / excess)
    assert math.isfinite(value) and math.isfinite(torch.tensor(value, dtype=given).item())
    crf = embeddings_crf().to(dtype)
    x = torch.rand(2, 3, 3, dtype=given)
    x[data.draw(st.integers(0, 1)), data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))] = value
    run = (lambda crf: inference.TemperedSMC(crf, num_particles=4, replicates=2)) if engine == "TemperedSMC" else None
    run = (run or ENGINES[engine])(crf)
    if overflows:
        held = re.escape(f"{torch.tensor(value, dtype=given).item():g}")
        with pytest.raises(ValueError, match=rf"embeddings holds {held} .*overflows {dtype} .*the CRF's dtype"):
            run(embeddings=x)
    elif engine in ("Exact", "MeanField"):  # a value that fits: the same posterior as embeddings cast first
        torch.testing.assert_close(run(embeddings=x).z, run(embeddings=x.to(dtype)).z)


def test_pt_layer_refuses_hidden_states_that_overflow_its_dtype_naming_them():
    layer = PTLayer(4, labels=3, channels=1, rank=2)
    hidden = torch.randn(2, 3, 4, dtype=torch.float64)
    hidden[1, 2, 0] = 1e39
    with pytest.raises(ValueError, match=r"hidden holds 1e\+39 \(first at index \[1, 2, 0\]\), which overflows"):
        layer(hidden)


@given(value=st.sampled_from(BAD), length=st.integers(1, 4))
@settings(max_examples=6)
def test_pt_layer_refuses_non_finite_hidden_states_naming_them(value, length):
    layer = PTLayer(4, labels=3, channels=1, rank=2)
    hidden = torch.randn(2, length, 4)
    hidden[1, length - 1, 0] = value
    with pytest.raises(ValueError, match="hidden contains NaN or Inf"):
        layer(hidden)
    with pytest.raises(ValueError, match="hidden contains NaN or Inf"):
        layer.posterior(hidden)


@pytest.mark.parametrize("kind", sorted(registry.KINDS))
@given(value=st.sampled_from(BAD), data=st.data())
@settings(max_examples=5)
def test_every_model_refuses_a_non_finite_parameter_naming_it(kind, value, data):
    torch.manual_seed(0)
    model = registry.build(kind, TINY_CONFIGS[kind]).eval()
    names = [name for name, p in model.named_parameters() if p.is_floating_point()]
    name = data.draw(st.sampled_from(names))
    with torch.no_grad():
        model.get_parameter(name).view(-1)[0] = value
    with pytest.raises(ValueError, match=f"{name}'? .*contains NaN or Inf"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("method", ["systematic", "stratified", "multinomial", "residual"])
@given(value=st.sampled_from(BAD), rows=st.integers(1, 3), particles=st.integers(1, 5), data=st.data())
@settings(max_examples=5)
def test_resampling_refuses_non_finite_weights_naming_them(method, value, rows, particles, data):
    from inference.smc.filter import resample_indices

    weights = torch.rand(rows, particles) + 0.1
    weights[data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, particles - 1))] = value
    with pytest.raises(ValueError, match="weights contains NaN or Inf"):
        resample_indices(weights, method)


def test_a_nan_only_at_padded_positions_changes_nothing():
    crf = embeddings_crf()
    x = torch.randn(1, 4, 3)
    mask = torch.tensor([[True, True, False, False]])
    junk = x.clone()
    junk[0, 2:] = math.nan
    for engine in ("Exact", "MeanField"):
        run = ENGINES[engine](crf)
        torch.testing.assert_close(run(embeddings=junk, mask=mask).z, run(embeddings=x, mask=mask).z)


# ---- one error taxonomy ------------------------------------------------------------------------


def callers():
    """Every public way in that reads token ids: ``{name: call(tokens)}``."""
    torch.manual_seed(0)
    found = {}
    for kind in sorted(registry.KINDS):
        model = registry.build(kind, TINY_CONFIGS[kind]).eval()
        found[kind] = lambda tokens, model=model: model(tokens)
    crf = graphs.CRF(vocab_size=VOCAB, labels=2)
    for engine in ("Exact", "MeanField"):
        run = ENGINES[engine](crf)
        found[engine] = lambda tokens, run=run: run(tokens)
    config = {"vocab_size": VOCAB}
    found["loaded .pt2"] = lambda tokens: CheckedProgram(None, config, "model.pt2")(tokens)
    found["loaded .onnx"] = lambda tokens: CheckedOnnx(None, config, "model.onnx")(tokens)
    return found


WRONG_TYPES = {  # a wrong type of token ids -> (TypeError, the one message every caller gives)
    "numpy array": (np.array([[1, 2]]), "tokens must be a torch.Tensor of integer ids [batch, length], got ndarray"),
    "list": ([[1, 2]], "tokens must be a torch.Tensor of integer ids [batch, length], got list"),
    "float tensor": (torch.tensor([[1.0, math.nan]]), "tokens must have an integer dtype, got torch.float32"),
    "bool tensor": (torch.tensor([[True, False]]), "tokens must have an integer dtype, got torch.bool"),
}
WRONG_VALUES = {  # a wrong value -> ValueError naming it
    "1-D": (torch.tensor([1, 2]), "tokens must have shape [batch, length]"),
    "empty": (torch.zeros(1, 0, dtype=torch.long), "tokens must be non-empty"),
    "id = vocab_size": (torch.tensor([[1, VOCAB]]), f"token ids must lie in [0, {VOCAB}) (vocab_size)"),
}


@pytest.mark.parametrize("caller", sorted(callers()))
def test_every_model_engine_and_loader_gives_the_same_error_for_the_same_mistake(caller):
    call = callers()[caller]
    for what, (tokens, message) in WRONG_TYPES.items():
        with pytest.raises(TypeError) as error:
            call(tokens)
        assert str(error.value).startswith(message), (caller, what, str(error.value))
    for what, (tokens, message) in WRONG_VALUES.items():
        with pytest.raises(ValueError) as error:
            call(tokens)
        assert message in str(error.value), (caller, what, str(error.value))


@pytest.mark.parametrize("name,value", [("labels", "3"), ("labels", 2.0), ("channels", None), ("vocab_size", [5])])
def test_crf_sizes_of_a_wrong_type_raise_type_error(name, value):
    kwargs = dict(vocab_size=5, labels=2) | {name: value}
    with pytest.raises(TypeError, match=f"{name} must be an integer"):
        graphs.CRF(**kwargs)
