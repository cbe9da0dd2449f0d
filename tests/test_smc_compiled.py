"""benchmarks/smc_compiled.py: its exact log evidence against the test oracles' Kalman filter,
and its CPU dry run (each variant's log evidence lies near the exact one), so the script
cannot rot between GPU runs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import smc_compiled
from tests.oracles import kalman


@given(st.integers(1, 6), st.floats(-0.99, 0.99), st.floats(0.1, 2.0), st.floats(0.1, 2.0), st.integers(0, 99))
@settings(max_examples=30, deadline=None)
def test_the_kalman_log_evidence_is_the_oracles_plus_the_left_out_constant(steps, a, q, r, seed):
    ys = torch.randn(3, steps, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ours = smc_compiled.kalman_log_evidence(ys, a, q, r)
    eye = torch.eye(1, dtype=torch.float64)
    for series, value in zip(ys, ours):
        _, expected = kalman(series[:, None], a * eye, q * eye, eye, r * eye, torch.zeros(1, dtype=torch.float64), eye)
        expected += 0.5 * steps * math.log(2 * math.pi * r)  # the observation density's constant, left out
        assert math.isclose(float(value), expected, rel_tol=1e-9, abs_tol=1e-9)


def test_the_dry_run_compiles_the_filter_to_one_graph_and_each_variant_estimates_the_exact_evidence(tmp_path):
    # 12 steps: more than Dynamo's recompile limit (8), were each step compiled apart
    out = tmp_path / "smc_compiled.jsonl"
    argv = ["--device", "cpu", "--tiny", "--backend", "aot_eager", "--steps", "12", "--filters", "6"]
    lines = smc_compiled.main([*argv, "--particles", "40", "--out", str(out)])
    assert [line["variant"] for line in lines] == ["eager", "compiled"]  # reduce-overhead: CUDA only
    assert all("error" not in line for line in lines), lines
    assert lines[0]["graphs"] == 0 and lines[1]["graphs"] == 1
    for line in lines:
        assert line["particle_steps_per_s"] > 0 and (line["steps"], line["filters"], line["particles"]) == (12, 6, 40)
        # 6 filters of 40 particles: the estimate's error is a few tenths at most
        assert abs(line["log_evidence_error_mean"]) < 5 * line["log_evidence_error_se"] + 0.5, line
    assert len(out.read_text().splitlines()) == 2
    assert all(line["threads"] == torch.get_num_threads() for line in lines)  # left as the tests set it


@pytest.mark.parametrize("option", ["--steps", "--filters", "--particles", "--threads"])
def test_a_size_below_one_is_refused_by_name(option, capsys):
    with pytest.raises(SystemExit):
        smc_compiled.main(["--device", "cpu", "--tiny", option, "0"])
    assert f"{option} must be at least 1, got 0" in capsys.readouterr().err
