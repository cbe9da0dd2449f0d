"""benchmarks/smc_ops.py's dry run: the GPU check's SMC model at its tiny sizes on the CPU,
counting the operator calls of a filter step (so the script cannot rot between GPU runs)."""

import json

from benchmarks import smc_ops


def test_the_dry_run_counts_the_users_and_the_filters_calls_per_step(tmp_path, capsys):
    out = tmp_path / "smc_ops.json"
    report = smc_ops.main(["--tiny", "--rounds", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    rows = report["rows"]
    assert [row["record_ancestors"] for row in rows] == [True, False]
    for row in rows:
        # the model's step: a draw, two multiplications and an addition, an index, a difference, a square, a scale
        assert row["user"] >= 5 and row["filter_compute"] > 0 and row["cpu_seconds_per_step"] > 0
        assert row["filter"] == row["filter_compute"] + row["filter_view"] + row["filter_allocation"]
        assert row["total"] == row["user"] + row["filter"]
        assert sum(row["filter_operators"].values()) == row["filter"]
        assert all(calls == int(calls) for calls in row["filter_operators"].values())  # the same calls every step
        # on a GPU a step of this model is bound by operator launches: a new call in the step loop is a choice
        assert row["filter"] <= 31, row["filter_operators"]
    assert "| True |" in capsys.readouterr().out
