"""The estimators (probformer.diagnostics.estimators) against exact answers: ESS of weights and
log-weights, Pareto k-hat (recovering known shapes, agreeing with Pyro's PSIS fit), the
diversity of token vectors at any magnitude, and refusals by name."""

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from probformer import diagnostics

# ---- ESS ---------------------------------------------------------------------


def test_ess_uniform_is_n_and_one_hot_is_one():
    assert diagnostics.ess(torch.ones(7)).item() == pytest.approx(7)
    assert diagnostics.ess(torch.tensor([0.0, 3.0, 0.0])).item() == pytest.approx(1)
    assert diagnostics.ess(torch.ones(4, 10), normalized=True).tolist() == pytest.approx([1.0] * 4)
    assert diagnostics.ess(log_weights=torch.tensor([0.0, -math.inf, -math.inf])).item() == pytest.approx(1)


@given(seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3))
def test_ess_is_scale_invariant_and_log_space_agrees(seed, scale):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(3, 5, 20, generator=g, dtype=torch.float64) ** 3
    by_hand = w.sum(-1) ** 2 / (w**2).sum(-1)
    torch.testing.assert_close(diagnostics.ess(w), by_hand)
    torch.testing.assert_close(diagnostics.ess(w * scale), by_hand)
    torch.testing.assert_close(diagnostics.ess(log_weights=w.log()), by_hand)
    torch.testing.assert_close(diagnostics.ess(log_weights=w.log() + 800.0), by_hand)  # no overflow


FLOAT_DTYPES = {torch.float16: 6e4, torch.bfloat16: 1e30, torch.float32: 1e30, torch.float64: 1e30}


@given(
    dtype=st.sampled_from(list(FLOAT_DTYPES)),
    size=st.integers(1, 4096),
    fraction=st.floats(-1.0, 1.0),
    exponent=st.integers(-30, 30),
)
def test_ess_of_equal_weights_is_exactly_n_at_any_magnitude_and_dtype(dtype, size, fraction, exponent):
    """N equal log-weights (or weights) give exactly N: an earlier version gave 3.00006 for three
    equal float32 log-weights of large magnitude."""
    magnitude = min(abs(fraction) * 10.0**exponent, FLOAT_DTYPES[dtype])
    value = math.copysign(magnitude, fraction)
    assert diagnostics.ess(log_weights=torch.full((size,), value, dtype=dtype)).item() == size
    assert diagnostics.ess(log_weights=torch.full((2, size), value, dtype=dtype), normalized=True).tolist() == [1.0] * 2
    weights = torch.full((size,), magnitude, dtype=dtype)
    if weights[0] > 0:  # tiny magnitudes underflow to 0 in half precision: no weight to measure
        assert diagnostics.ess(weights).item() == size


@given(
    logs=st.lists(st.floats(-1e30, 1e30, allow_nan=False), min_size=1, max_size=40),
    shift=st.sampled_from([0.0, -1e6, 1e6, 1e30]),
)
def test_ess_of_log_weights_matches_an_exact_sum(logs, shift):
    """Oracle: shift by the maximum in Python floats, sum with math.fsum (exactly rounded)."""
    lw = torch.tensor(logs, dtype=torch.float64) + shift
    top = max(lw.tolist())
    w = [math.exp(x - top) for x in lw.tolist()]
    first, second = math.fsum(w), math.fsum(x * x for x in w)
    assert diagnostics.ess(log_weights=lw).item() == pytest.approx(first * first / second, rel=1e-12)


def test_ess_works_along_other_dims_on_attention_shapes():
    attention = torch.rand(2, 3, 6, 6).softmax(-1)
    column_mass = attention.sum(-2)
    assert diagnostics.ess(attention).shape == (2, 3, 6)
    assert diagnostics.ess(attention, dim=-2).shape == (2, 3, 6)
    assert diagnostics.ess(column_mass).shape == (2, 3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(weights=torch.tensor([])), "non-empty"),
        (dict(weights=torch.tensor([1.0, math.nan])), "NaN"),
        (dict(weights=torch.tensor([1.0, -1.0])), "non-negative"),
        (dict(weights=torch.zeros(3)), "sum to zero"),
        (dict(log_weights=torch.full((3,), -math.inf)), "all -inf"),
        (dict(log_weights=torch.tensor([0.0, math.nan])), "NaN"),
        (dict(), "exactly one"),
    ],
)
def test_ess_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        diagnostics.ess(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [  # the reliability benchmark's cases: IndexError or "too many dimensions 'str'"
        (
            dict(log_weights=torch.zeros(3, 4), dim=5),
            r"dim must be an integer in \[-2, 1\] \(the weights have 2 dims\)",
        ),
        (dict(weights=torch.ones(3, 4), dim=-3), r"dim must be an integer in \[-2, 1\]"),
        (dict(weights=torch.tensor(0.5)), "at least one dim"),
        (dict(log_weights=[[0.0], [1.0, 2.0]]), "log_weights must be a tensor or array of real numbers"),
    ],
)
def test_ess_names_the_bad_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        diagnostics.ess(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [  # a wrong type is a TypeError, naming the argument
        (dict(weights=torch.ones(3), dim=0.0), r"dim must be an integer"),
        (dict(weights=torch.ones(3), dim=True), r"dim must be an integer"),
        (dict(weights=["a", "b"]), "weights must be a tensor or array of real numbers"),
        (dict(weights=torch.ones(3, dtype=torch.complex64)), "weights must hold real numbers"),
        (dict(weights=[1j, 2.0]), "weights must hold real numbers"),
        (dict(weights=torch.ones(3), normalized="yes"), "normalized must be True or False"),
    ],
)
def test_ess_names_the_argument_of_the_wrong_type(kwargs, match):
    with pytest.raises(TypeError, match=match):
        diagnostics.ess(**kwargs)


@given(st.integers(1, 4), st.integers(-6, 6))
def test_ess_takes_exactly_the_dims_the_weights_have(ndim, dim):
    weights = torch.ones((2,) * ndim)
    if -ndim <= dim < ndim:
        assert (diagnostics.ess(weights, dim=dim) == 2).all()  # two equal weights along any dim
    else:
        with pytest.raises(ValueError, match="dim must be an integer"):
            diagnostics.ess(weights, dim=dim)


# ---- Pareto k ------------------------------------------------------------------


def normal_log_ratio(rng, proposal_scale, size, proposal_mean=0.0):
    """log N(x; 0, 1) - log N(x; mean, scale) for x drawn from the proposal."""
    x = rng.normal(proposal_mean, proposal_scale, size)
    return -0.5 * x**2 + 0.5 * ((x - proposal_mean) / proposal_scale) ** 2 + np.log(proposal_scale)


def test_light_tails_give_small_k():
    rng = np.random.default_rng(0)
    shifted = diagnostics.pareto_k(normal_log_ratio(rng, 1.0, 4000, proposal_mean=0.5))  # equal scales
    assert shifted.k < 0.5 and shifted.verdict == "ok"
    wide = diagnostics.pareto_k(normal_log_ratio(rng, 1.5, 4000))  # wider proposal: bounded ratios
    assert wide.k < 0.5
    equal = diagnostics.pareto_k(np.zeros(100))  # proposal = target: all weights equal
    assert equal.k == -np.inf and equal.verdict == "ok"


@pytest.mark.parametrize("xi", [0.8, 1.2])
def test_pareto_weights_recover_their_shape(xi):
    rng = np.random.default_rng(1)
    weights = rng.pareto(1 / xi, size=(6, 20_000)) + 1  # a Pareto tail with shape xi
    result = diagnostics.pareto_k(np.log(weights))
    assert abs(result.k.mean() - xi) < 0.12, result.k
    assert np.all(result.k > 0.7) and np.all(result.verdict == "degenerate")
    assert result.threshold == pytest.approx(0.7)


@given(draws=st.integers(21, 400), heavy=st.integers(1, 3), gap=st.floats(200.0, 2000.0))
def test_a_few_draws_holding_all_the_mass_are_degenerate_never_unreliable(draws, heavy, gap):
    """ESS of 1 to 3 out of 21 or more draws: the worst importance weights there are. ArviZ's
    fit says k = inf; it stays inf ("degenerate"), never NaN ("unreliable", left out of means)."""
    log_w = np.full(draws, -gap)
    log_w[:heavy] = 0.0
    result = diagnostics.pareto_k(log_w)
    assert float(diagnostics.ess(log_weights=log_w)) == pytest.approx(heavy)
    assert result.k == np.inf and result.verdict == "degenerate"


@given(
    draws=st.integers(21, 400), levels=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=3), top=st.floats(0.25, 0.9)
)
def test_bounded_weights_tied_at_their_top_have_no_tail_never_degenerate(draws, levels, top):
    """A share ``top`` of the draws tie at the largest weight (more than the M + 1 of PSIS's
    tail), the rest lie within e^-0.5 of it: weights bounded by 1.65, ESS near S. ArviZ finds
    no draw above its cutoff and says k = inf; that is a flat tail (-inf, "ok", like equal
    weights), not a collapse. ArviZ's tail size is written here: ceil(min(S/5, 3 sqrt S))."""
    tail = math.ceil(min(draws / 5, 3 * math.sqrt(draws)))
    tied = max(tail + 1, int(top * draws))
    log_w = np.zeros(draws)
    log_w[tied:] = -np.resize(np.asarray(levels) + 1e-3, draws - tied)
    result = diagnostics.pareto_k(log_w)
    assert result.k == -np.inf and result.verdict == "ok"


def test_a_few_light_draws_above_tied_weights_are_unreliable_not_degenerate():
    """3 of 256 draws weigh e^0.1 times the rest: too few above the cutoff to fit (ArviZ's
    k = inf), holding 1.3% of the mass: no collapse, so nan ("unreliable"), not +inf."""
    log_w = np.zeros(256)
    log_w[:3] = 0.1
    result = diagnostics.pareto_k(log_w)
    assert np.isnan(result.k) and result.verdict == "unreliable"


def test_narrow_proposal_is_heavy_tailed():
    rng = np.random.default_rng(2)
    result = diagnostics.pareto_k(normal_log_ratio(rng, 0.4, 4000))
    assert result.k > 0.5


def test_agrees_with_pyro_psis_fit():
    """Pyro's psis_diagnostic fits its tail with fit_generalized_pareto the same way."""
    from pyro.ops.stats import fit_generalized_pareto

    rng = np.random.default_rng(3)
    for log_w in (normal_log_ratio(rng, 0.7, 4000), np.log(rng.pareto(1.0, 4000) + 1)):
        lw = torch.tensor(log_w - log_w.max()).sort().values
        cutoff = lw[-int(math.ceil(min(0.2 * 4000, 3 * math.sqrt(4000)))) - 1]
        tail = lw[lw > cutoff]
        pyro_k, _ = fit_generalized_pareto(tail.exp() - cutoff.exp())
        ours = diagnostics.pareto_k(log_w).k
        assert abs(float(ours) - float(pyro_k)) < 0.05


def test_too_few_draws_warn_and_give_nan():
    with pytest.warns(UserWarning, match="at least 21 draws"):
        result = diagnostics.pareto_k(np.zeros((2, 10)))
    assert np.isnan(result.k).all() and (result.verdict == "unreliable").all()


def test_pareto_k_bad_input():
    with pytest.raises(ValueError, match="all -inf"):
        diagnostics.pareto_k(np.full(100, -np.inf))
    with pytest.raises(ValueError, match="NaN"):
        diagnostics.pareto_k(np.array([0.0, np.nan] * 50))
    with pytest.raises(ValueError, match="non-empty"):
        diagnostics.pareto_k(np.array([]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diagnostics.pareto_k(np.r_[np.zeros(99), -np.inf])  # some -inf weights are fine


@pytest.mark.parametrize(
    "args,kwargs,match",
    [  # IndexError, "too many dimensions 'str'", ZeroDivisionError or silent NaN
        ((torch.tensor(0.5),), {}, r"log_weights must have a draws axis: shape \[..., S\]"),
        ((np.zeros(100),), dict(relative_efficiency=0), "relative_efficiency must be a finite number > 0, got 0"),
        ((np.zeros(100),), dict(relative_efficiency=-1.0), "relative_efficiency must be a finite number > 0"),
        ((np.zeros(100),), dict(relative_efficiency=math.nan), "relative_efficiency must be a finite number > 0"),
        ((np.zeros(100),), dict(relative_efficiency=math.inf), "relative_efficiency must be a finite number > 0"),
    ],
)
def test_pareto_k_names_the_bad_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        diagnostics.pareto_k(*args, **kwargs)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((["a"],), {}, "log_weights must be a tensor or array of real numbers"),
        ((np.zeros(100),), dict(relative_efficiency="1"), "relative_efficiency must be a finite number > 0"),
        ((np.zeros(100),), dict(relative_efficiency=True), "relative_efficiency must be a finite number > 0"),
    ],
)
def test_pareto_k_names_the_argument_of_the_wrong_type(args, kwargs, match):
    with pytest.raises(TypeError, match=match):
        diagnostics.pareto_k(*args, **kwargs)


# ---- diversity -------------------------------------------------------------------


def test_identical_tokens_are_fully_collapsed():
    x = torch.randn(1, 1, 16).expand(2, 6, 16)
    result = diagnostics.diversity(x)
    torch.testing.assert_close(result.cosine, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(result.effective_rank, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(result.rank_one_distance, torch.zeros(2, dtype=torch.float64), atol=1e-12, rtol=0)


def test_orthogonal_tokens_have_zero_cosine_and_full_rank():
    x = (torch.eye(8) * 3.0)[None, :5]
    result = diagnostics.diversity(x)
    assert result.cosine.item() == pytest.approx(0.0, abs=1e-12)
    assert result.effective_rank.item() == pytest.approx(5.0)
    assert result.rank_one_distance.item() > 0.5


def test_padding_is_ignored():
    x = torch.randn(1, 4, 8)
    padded = torch.cat([x, torch.randn(1, 3, 8) * 100], 1)
    mask = torch.tensor([[True] * 4 + [False] * 3])
    a, b = diagnostics.diversity(x), diagnostics.diversity(padded, mask)
    for name in ("cosine", "effective_rank", "rank_one_distance"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name))


def test_diversity_bad_input():
    with pytest.raises(ValueError, match=r"\[batch, tokens, width\]"):
        diagnostics.diversity(torch.randn(4, 8))
    with pytest.raises(ValueError, match="at least one real token"):
        diagnostics.diversity(torch.randn(1, 3, 4), torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be a bool tensor of shape \(1, 3\), got shape \(1, 2\)"):
        diagnostics.diversity(torch.randn(1, 3, 4), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be a bool tensor of shape \(1, 3\)"):
        diagnostics.diversity(torch.randn(1, 3, 4), torch.ones(1, 3))
    with pytest.raises(TypeError, match="hidden must be a tensor or array of real numbers"):
        diagnostics.diversity("hidden")
    with pytest.raises(ValueError, match="NaN"):
        diagnostics.diversity(torch.full((1, 3, 4), math.nan))


@given(
    exponent=st.integers(-300, 300),
    width=st.integers(1, 6),
    tokens=st.integers(2, 5),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_equal_tokens_are_fully_collapsed_at_any_magnitude(exponent, width, tokens, dtype):
    # tokens of size 1e-20 gave cosine ~1e-16 (F.normalize's eps swamped them)
    scale = 10.0**exponent
    if dtype == torch.float32 and not 1e-37 < scale < 1e37:
        return  # not representable as a normal float32
    hidden = torch.full((1, tokens, width), scale, dtype=dtype)
    result = diagnostics.diversity(hidden)
    assert result.cosine.item() == pytest.approx(1.0, abs=1e-12)
    assert result.effective_rank.item() == pytest.approx(1.0, abs=1e-9)
    assert result.rank_one_distance.item() == pytest.approx(0.0, abs=1e-12)


@given(exponent=st.integers(-300, 300))
def test_orthogonal_tokens_stay_orthogonal_at_any_magnitude(exponent):
    hidden = torch.eye(4, dtype=torch.float64)[None] * 10.0**exponent
    result = diagnostics.diversity(hidden)
    assert result.cosine.item() == pytest.approx(0.0, abs=1e-12)
    assert result.effective_rank.item() == pytest.approx(4.0)


def test_cosine_of_tokens_of_very_different_magnitudes():
    # two tokens at 45 degrees, one 1e-30 times the other: cosine 1/sqrt(2) exactly
    hidden = torch.tensor([[[1.0, 0.0], [1e-30, 1e-30]]], dtype=torch.float64)
    assert diagnostics.diversity(hidden).cosine.item() == pytest.approx(2**-0.5, rel=1e-12)
