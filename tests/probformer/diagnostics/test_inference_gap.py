"""inference_gap against exact answers: log Z from brute force, the ELBO from the oracle's
mean-field bound at the model's own label marginals, KL = log Z - ELBO >= 0; a CRF whose
posterior the mean field represents exactly gives KL 0 and equal weights (k-hat "good");
the report group and the figure; bad models are refused by name."""

import math

import numpy as np
import pytest
import torch

import probformer as pf
from probformer.diagnostics.inference_gap import add_to_report, plot_inference_gap
from tests import oracles


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.random.fork_rng():
        yield
    torch.set_num_threads(threads)


def small_pt(seed=0, **overrides):
    torch.manual_seed(seed)
    config = dict(vocab_size=12, labels=3, channels=2, rank=2, iterations=2, dropout=0.0, kernel="naive")
    model = pf.ProbabilisticTransformer(pf.PTConfig(**{**config, **overrides}))
    return model.double()


def test_gap_is_log_z_minus_the_oracle_elbo():
    model = small_pt()
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    gap = pf.diagnostics.inference_gap(model, tokens, mask, particles=32, replicates=8)
    with torch.no_grad():
        q_z = model.mean_field(tokens, mask).z
    for b in range(2):
        row, row_mask = tokens[b].tolist(), mask[b].tolist()
        log_z = oracles.brute_force(model.crf, row, row_mask)[0]
        elbo = oracles.mean_field_elbo(model.crf, row, row_mask, q_z[b])
        assert gap.log_partition[b] == pytest.approx(log_z, abs=max(0.05, 4 * gap.standard_error[b]))
        assert gap.elbo[b] == pytest.approx(elbo, abs=1e-6)
        assert gap.kl[b] == pytest.approx(gap.log_partition[b] - gap.elbo[b])
        assert log_z - elbo >= -1e-9  # the oracle's own gap is a KL divergence
    assert gap.draws == 32 * 8
    assert np.isfinite(gap.pareto_k).all()
    expected = np.where(gap.pareto_k < 0.5, "good", np.where(gap.pareto_k <= 0.7, "acceptable", "untrustworthy"))
    assert (gap.verdict == expected).all()
    assert "k-hat" in gap.table()


def test_a_posterior_the_mean_field_represents_has_no_gap():
    model = small_pt(iterations=1)
    with torch.no_grad():  # no ternary potential: labels and heads independent, q_z exact after one update
        for name in ("ternary_u", "ternary_v"):
            getattr(model.crf, name).zero_()
    tokens = torch.tensor([[1, 2, 3]])
    gap = pf.diagnostics.inference_gap(model, tokens, particles=16, replicates=4)
    assert abs(gap.kl[0]) < 1e-6
    assert gap.standard_error[0] < 1e-6
    assert gap.verdict[0] == "good"  # equal weights: k-hat -inf


def test_report_group_and_figure(tmp_path):
    model = small_pt()
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    gap = pf.diagnostics.inference_gap(model, tokens, particles=16, replicates=2)
    report = pf.diagnostics.report(model, tokens)
    report = add_to_report(report, gap)
    group = report["inference_gap"]
    assert group["kl"].dims == ("chain", "draw") and group["kl"].shape == (1, 2)
    assert np.allclose(group["kl"].values[0], gap.kl)
    assert group["pareto_k"].attrs["long_name"].startswith("PSIS")
    path = plot_inference_gap(gap, tmp_path)
    assert path.endswith("inference_gap.png") and (tmp_path / "inference_gap.png").stat().st_size > 0
    report.to_netcdf(str(tmp_path / "report.nc"))


def test_a_model_without_a_crf_is_refused():
    with pytest.raises(TypeError, match="model must be a Probabilistic Transformer"):
        pf.diagnostics.inference_gap(torch.nn.Linear(2, 2), torch.tensor([[1, 2]]))


def test_a_model_with_an_adaptive_span_is_refused_by_name():
    """Its ELBO bounds log Z of the CRF times the span's prior, not of the CRF: a KL from the
    two would mix two models."""
    with pytest.raises(ValueError, match="span=True"):
        pf.diagnostics.inference_gap(small_pt(span=True, span_max=2, span_ramp=1), torch.tensor([[1, 2, 3]]))


def test_log_z_matches_across_padding():
    model = small_pt(seed=1)
    alone = pf.diagnostics.inference_gap(model, torch.tensor([[3, 4, 5]]), particles=32, replicates=8)
    padded = pf.diagnostics.inference_gap(
        model, torch.tensor([[3, 4, 5, 0]]), torch.tensor([[True, True, True, False]]), particles=32, replicates=8
    )
    assert padded.elbo[0] == pytest.approx(alone.elbo[0], abs=1e-9)
    tolerance = 4 * math.hypot(alone.standard_error[0], padded.standard_error[0]) + 1e-6
    assert padded.log_partition[0] == pytest.approx(alone.log_partition[0], abs=tolerance)
