"""The resamplers (inference.smc.resamplers, as the SMC engine calls them): offspring counts
with expectation N w, lower variance than multinomial, exactness where N w is an integer,
systematic resampling's floor/ceil property and sorted ancestors, on normalised and on
unnormalised weights."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from inference.smc.filter import RESAMPLERS, resample_indices
from inference.smc.resamplers import SystematicResampler, systematic_ancestors

# ---- resamplers ------------------------------------------------------------------


@pytest.mark.parametrize("method", RESAMPLERS)
def test_offspring_counts_have_expectation_n_w(method):
    N, draws = 10, 4000
    g = torch.Generator().manual_seed(0)
    w = torch.rand(N, generator=g, dtype=torch.float64) ** 2
    w = w / w.sum()
    ancestors = resample_indices(w.expand(draws, N).contiguous(), method, g)
    counts = torch.nn.functional.one_hot(ancestors, N).sum(1).double()  # [draws, N]
    observed, expected = counts.sum(0), draws * N * w
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < stats.chi2.ppf(0.999, N - 1), chi2


@pytest.mark.parametrize("method", RESAMPLERS)
@given(scale=st.sampled_from([1e-30, 0.1, 3.0, 1e30]), seed=st.integers(0, 10_000))
def test_every_method_reads_a_row_that_does_not_sum_to_one_as_its_fractions(method, scale, seed):
    """Weights 1, 1, 2, 4 (times any scale) mean fractions 1/8, 1/8, 1/4, 1/2: mean offspring
    0.5, 0.5, 1, 2 out of 4, and at least the floor of each (every method but multinomial)."""
    draws = 2000
    w = (scale * torch.tensor([1.0, 1.0, 2.0, 4.0], dtype=torch.float64)).expand(draws, 4).contiguous()
    counts = torch.nn.functional.one_hot(resample_indices(w, method, torch.Generator().manual_seed(seed)), 4).sum(1)
    mean = counts.double().mean(0)
    # multinomial count of particle 4 has variance 4 (1/2)(1/2) = 1 per draw: 6 standard errors
    assert torch.allclose(mean, torch.tensor([0.5, 0.5, 1.0, 2.0], dtype=torch.float64), atol=6 / draws**0.5)
    if method != "multinomial":
        assert (counts >= torch.tensor([0, 0, 1, 2])).all()


def test_stratified_and_systematic_have_lower_count_variance_than_multinomial():
    N, draws = 20, 3000
    g = torch.Generator().manual_seed(1)
    w = torch.rand(N, generator=g, dtype=torch.float64)
    w = (w / w.sum()).expand(draws, N).contiguous()
    variance = {}
    for method in RESAMPLERS:
        counts = torch.nn.functional.one_hot(resample_indices(w, method, g), N).sum(1).double()
        variance[method] = counts.var(0).sum().item()
    assert variance["stratified"] < variance["multinomial"]
    assert variance["systematic"] < variance["multinomial"]
    assert variance["residual"] < variance["multinomial"]


@pytest.mark.parametrize("method", RESAMPLERS)
def test_particles_of_weight_zero_never_get_offspring(method):
    """Zero weights inside and at the end of 2,000 rows of 1,000 float32 weights, over ten
    draws. Systematic resampling gave the last position of a row whose rounded cumulative
    weight fell short of N to its last particle, dead or not (row 318 of draw 8 here)."""
    N, B = 1000, 2000
    w = torch.rand(B, N, generator=torch.Generator().manual_seed(0)) ** 3
    dead = torch.zeros(N, dtype=torch.bool)
    dead[100:103] = dead[-5:] = True
    w[:, dead] = 0.0
    for seed in range(10):
        ancestors = resample_indices(w, method, torch.Generator().manual_seed(seed))
        assert not dead[ancestors].any(), (seed, dead[ancestors].any(-1).nonzero().flatten().tolist())


@pytest.mark.parametrize("method", ["stratified", "residual", "systematic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_are_resampled_as_the_same_numbers_in_float32(method, dtype):
    """Half-precision weights resample exactly as their values cast up: the arithmetic no
    longer runs in half precision (bfloat16 counts positions exactly only to 256: a particle of
    N w = 0.33 always got 5 copies; a half-precision row sum put its error on the last particle)."""
    N, B = 600, 50
    w = (torch.rand(B, N, generator=torch.Generator().manual_seed(1)) ** 3).to(dtype)
    half = resample_indices(w, method, torch.Generator().manual_seed(2))
    wide = resample_indices(w.float(), method, torch.Generator().manual_seed(2))
    assert torch.equal(half, wide)


def test_residual_is_exact_on_integer_n_w():
    w = torch.tensor([[0.5, 0.25, 0.25, 0.0]], dtype=torch.float64).expand(50, 4).contiguous()
    counts = torch.nn.functional.one_hot(resample_indices(w, "residual"), 4).sum(1)
    assert (counts == torch.tensor([2, 1, 1, 0])).all()


@given(n=st.integers(1, 60), seed=st.integers(0, 100_000), power=st.sampled_from([1, 4, 12]))
def test_systematic_fast_path_equals_a_binary_search(n, seed, power):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(3, n, generator=g, dtype=torch.float64) ** power
    w = w / w.sum(-1, keepdim=True)
    fast = resample_indices(w, "systematic", torch.Generator().manual_seed(seed))
    # the resampler's positions are (i + 1 - v) / N with v its one U[0, 1) draw per filter,
    # drawn as an integer in units of 2**-shift (its fixed point)
    unit = 2 ** SystematicResampler(3, n, dtype=torch.float64).shift
    v = torch.randint(unit, (3, 1), generator=torch.Generator().manual_seed(seed)).double() / unit
    cumulative = w.cumsum(-1)
    cumulative[:, -1] = 1.0
    expected = torch.searchsorted(cumulative, ((torch.arange(n) + 1 - v) / n).contiguous()).clamp(max=n - 1)
    assert torch.equal(fast, expected)


# ---- the in-filter systematic resampler (unnormalised weights, per-filter decision) ----


@given(n=st.integers(1, 80), seed=st.integers(0, 100_000), power=st.sampled_from([1, 4, 12]))
def test_systematic_gives_floor_or_ceil_of_n_w_copies_and_sorted_ancestors(n, seed, power):
    """Systematic resampling's defining property: particle j gets floor(N w_j) or
    ceil(N w_j) copies, and the ancestors are sorted. Unnormalised weights (any row
    total); filters that do not resample get the identity exactly."""
    g = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.randint(-3, 4, (4, 1), generator=g, dtype=torch.float64)
    weights = torch.rand(4, n, generator=g, dtype=torch.float64) ** power * scales
    total = weights.sum(-1)
    resampled = torch.tensor([True, False, True, False])
    ancestors = systematic_ancestors(weights, total, resampled, g)
    assert ancestors.dtype == torch.long and ancestors.shape == (4, n)
    assert torch.equal(ancestors[~resampled], torch.arange(n).expand(2, n))
    drawn = ancestors[resampled]
    assert (drawn >= 0).all() and (drawn < n).all() and (drawn.diff(dim=-1) >= 0).all()
    copies = torch.nn.functional.one_hot(drawn, n).sum(1).double()
    expected = n * weights[resampled] / total[resampled, None]
    assert ((copies >= torch.floor(expected - 1e-9)) & (copies <= torch.ceil(expected + 1e-9))).all()


@given(n=st.integers(1, 2000), seed=st.integers(0, 100_000), power=st.sampled_from([1, 8, 40]))
def test_systematic_with_float32_row_sums_keeps_ancestors_in_range_and_counts_floor_or_ceil(n, seed, power):
    """The filter's form: float32 weights whose totals are their own float32 row sums
    (``row_sums=True``: no clamp of the positions below N where N (N + 4) eps < 1, i.e.
    N <= 2,894, clamped above). Whatever the rounding of the sums, ancestors stay in [0, N),
    sorted, and every particle gets floor or ceil of N w_j copies (up to float32 rounding of
    N w_j)."""
    g = torch.Generator().manual_seed(seed)
    weights = (torch.rand(6, n, generator=g) ** power).clamp_min(1e-30)
    weights[:, -1] = 0.0 if n > 1 else 1.0  # a last particle of no weight: the sum's excess falls before it
    total = weights.sum(-1, keepdim=True)
    resampler = SystematicResampler(6, n, dtype=torch.float32, row_sums=True)
    ancestors = resampler(weights.clone(), total, torch.ones(6, 1), g)
    assert (ancestors >= 0).all() and (ancestors < n).all() and (ancestors.diff(dim=-1) >= 0).all()
    copies = torch.nn.functional.one_hot(ancestors, n).sum(1).double()
    expected = n * weights.double() / total.double()
    slack = 1e-6 * n
    assert ((copies >= torch.floor(expected - slack)) & (copies <= torch.ceil(expected + slack))).all()


@given(
    n=st.integers(1, 50),
    seed=st.integers(0, 100_000),
    exponent=st.sampled_from([-35, -20, 0, 20, 35]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    given_total=st.booleans(),
)
def test_systematic_takes_any_row_total_and_half_precision(n, seed, exponent, dtype, given_total):
    """Row totals far from 1 (float32 weights of 1e-35 to 1e35: a scale N 2**shift / total
    would overflow) and half-precision weights (scaled in float32: float16 overflows at
    2**16), with the totals given or not (then the rows are divided by their sums): valid,
    sorted ancestors, floor or ceil of N w_j copies (up to the precision of the weights)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(4, n, generator=g) + 0.01
    if dtype == torch.float32:
        weights = weights * 10.0**exponent
    weights = weights.to(dtype)
    total = weights.float().sum(-1).to(dtype) if given_total else None
    if not given_total:  # "normalised" rows, as well as their precision allows
        weights = (weights.float() / weights.float().sum(-1, keepdim=True)).to(dtype)
    ancestors = systematic_ancestors(weights, total, None, g)
    assert (ancestors >= 0).all() and (ancestors < n).all() and (ancestors.diff(dim=-1) >= 0).all()
    copies = torch.nn.functional.one_hot(ancestors, n).sum(1).double()
    w = weights.double()
    expected = n * w / (w.sum(-1, keepdim=True) if total is None else total.double()[:, None])
    slack = n * (1e-2 if dtype != torch.float32 else 1e-5)
    assert ((copies >= torch.floor(expected - slack)) & (copies <= torch.ceil(expected + slack))).all()


def test_systematic_offspring_counts_of_unnormalised_weights_have_expectation_n_w():
    """Unbiasedness of the form the filter calls (unnormalised weights, a per-filter
    decision): over 4,000 draws the mean number of copies of particle j is N w_j within
    4 standard errors (the SE estimated from the draws)."""
    N, draws = 12, 4000
    g = torch.Generator().manual_seed(0)
    w = torch.rand(N, generator=g, dtype=torch.float64) ** 3 * 7.0  # total ~ 1.75, not 1
    weights = w.expand(2 * draws, N).contiguous()
    resampled = torch.arange(2 * draws) % 2 == 0  # every other filter resamples
    ancestors = systematic_ancestors(weights, weights.sum(-1), resampled, g)
    copies = torch.nn.functional.one_hot(ancestors[resampled], N).sum(1).double()  # [draws, N]
    expected = N * w / w.sum()
    se = copies.std(0) / math.sqrt(draws) + 1e-12  # 0 where N w_j is an integer (exact copies)
    assert ((copies.mean(0) - expected).abs() <= 4 * se + 1e-9).all(), (copies.mean(0), expected)
    assert torch.equal(ancestors[~resampled], torch.arange(N).expand(draws, N))
