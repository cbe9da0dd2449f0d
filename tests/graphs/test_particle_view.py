import math

import pyro
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphs
import inference


def run_smcfilter(view, embeddings, steps, ess_threshold):
    smc = pyro.infer.SMCFilter(
        view,
        view.bootstrap_guide(),
        num_particles=embeddings.shape[0],
        max_plate_nesting=0,
        ess_threshold=ess_threshold,
    )
    smc.init(embeddings)
    for _ in range(steps):
        smc.step()
    log_weights = smc.state._log_weights
    return smc.state["x"], log_weights - log_weights.logsumexp(0)


@pytest.mark.parametrize("weight", ["mass", "row"])
def test_deterministic_view_is_identical_under_smcfilter_and_the_engine(weight):
    torch.manual_seed(0)
    n, width, steps = 7, 8, 4
    view = graphs.ParticleView(width, rank=4, sigma=0.0, weight=weight).double()
    embeddings = torch.randn(3, n, width, dtype=torch.float64)
    with torch.no_grad():
        ours = inference.SMC(n, ess_threshold=1e-9).filter(view, num_steps=steps, batch_size=3, init_args=(embeddings,))
        for b in range(3):  # SMCFilter: one sentence at a time
            x, log_weights = run_smcfilter(view, embeddings[b], steps, 1e-9)
            torch.testing.assert_close(ours.particles["x"][b], x)
            torch.testing.assert_close(ours.log_weights[b], log_weights.double(), atol=1e-5, rtol=0)
    assert not ours.resampled.any()


def test_stochastic_view_with_resampling_runs_under_both():
    torch.manual_seed(1)
    n, width = 10, 6
    view = graphs.ParticleView(width, sigma=0.3)
    embeddings = torch.randn(2, n, width) * 3
    with torch.no_grad():
        result = inference.SMC(n, ess_threshold=1.0, generator=torch.Generator().manual_seed(0)).filter(
            view, num_steps=5, batch_size=2, init_args=(embeddings,)
        )
        x, _ = run_smcfilter(view, embeddings[0], 5, 1.0)
    assert result.resampled.all() and result.particles["x"].shape == (2, n, width)
    assert ((result.ess >= 1 - 1e-4) & (result.ess <= n + 1e-4)).all()
    assert torch.isfinite(result.log_evidence).all() and torch.isfinite(x).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(width=0), "width"),
        (dict(width=4, sigma=-1.0), "sigma"),
        (dict(width=4, weight="entropy"), "unknown weight"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        graphs.ParticleView(**kwargs)


numbers = st.one_of(
    st.integers(-3, 6), st.floats(allow_nan=True, allow_infinity=True), st.none(), st.booleans(), st.just("2")
)


@settings(max_examples=120, deadline=None)
@given(width=numbers, rank=numbers, sigma=numbers)
def test_sizes_and_sigma_are_accepted_exactly_when_valid_and_named_otherwise(width, rank, sigma):
    integer = {name: isinstance(v, int) and not isinstance(v, bool) for name, v in dict(width=width, rank=rank).items()}
    real = isinstance(sigma, int | float) and not isinstance(sigma, bool)
    wrong_type = [
        name
        for name, ok in [("width", integer["width"]), ("rank", rank is None or integer["rank"]), ("sigma", real)]
        if not ok
    ]
    wrong_value = [
        name
        for name, ok in [
            ("width", integer["width"] and width >= 1),
            ("rank", rank is None or (integer["rank"] and rank >= 1)),
            ("sigma", real and math.isfinite(sigma) and sigma >= 0),
        ]
        if not ok
    ]
    if not wrong_value:
        view = graphs.ParticleView(width, rank=rank, sigma=sigma)
        assert view.query.out_features == (width if rank is None else rank) and view.sigma == sigma
        return
    first = wrong_value[0]  # checked in the order width, rank, sigma
    error = TypeError if first in wrong_type else ValueError
    with pytest.raises(error, match=f"^{first} must be "):
        graphs.ParticleView(width, rank=rank, sigma=sigma)
