"""The convergence study's report, read from run folders: the crossing point is found
where the sign of the gap changes, a curve has one perplexity per epoch trained, and the
best epoch is the one early stopping keeps."""

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import convergence
from benchmarks.convergence_report import crossing, mean_curve


def test_the_crossing_is_where_the_gap_changes_sign():
    # gaps 100, 5, -10: the sign flips after epoch 2
    assert crossing([100.0, 90.0, 80.0], [200.0, 95.0, 70.0]) == (
        "the curves cross between epochs 2 and 3; the baseline is ahead at epoch 3; "
        "gap (baseline − PT) from epoch 2 on: +5.0, -10.0"
    )
    # gaps 100, -5, 3, 4: crossed twice, PT ahead again at the end
    text = crossing([100.0, 90.0, 80.0, 70.0], [200.0, 85.0, 83.0, 74.0])
    assert text.startswith("the curves cross between epochs 1 and 2, then between epochs 2 and 3; PT is ahead")
    assert text.endswith("from epoch 1 on: +100.0, -5.0, +3.0, +4.0")
    text = crossing([100.0, 90.0, 80.0, 75.0], [200.0, 150.0, 110.0, 90.0])
    assert text.startswith("no crossing in 4 common epoch(s)")
    # gaps 100, 60, 30, 15: shrinking by (60 - 15) / 2 = 22.5 per epoch, closed in ceil(15 / 22.5) = 1 more
    assert "shrinking by 22.5 per epoch" in text and "near epoch 5" in text
    assert crossing([], [1.0]) == "no common epoch yet"


def test_each_seed_crossing_is_read_from_that_seeds_curves_alone():
    from benchmarks.convergence_report import seed_by_seed

    rows = [
        {"config": "pt", "seed": 0, "curve": [100.0, 90.0, 80.0]},
        {"config": "bert", "seed": 0, "curve": [200.0, 95.0, 70.0]},  # gaps 100, 5, -10
        {"config": "pt", "seed": 1, "curve": [100.0, 90.0]},
        {"config": "bert", "seed": 1, "curve": [200.0, 95.0, 1.0]},  # seed 1's PT has 2 epochs
    ]
    assert (
        seed_by_seed(rows, "pt", "bert") == "s0 2-3 (gap -10.0 at epoch 3); s1 none in 2 epoch(s) (gap +5.0 at epoch 2)"
    )
    assert seed_by_seed([{"config": "pt", "seed": 0, "curve": []}], "pt", "bert") == "s0 none in 0 epoch(s)"


def test_a_mean_cut_by_a_diverged_seed_says_so():
    from benchmarks.convergence_report import divergence_note

    rows = [
        {"config": "pt", "seed": 0, "diverged_at": 13},
        {"config": "pt", "seed": 1, "diverged_at": None},
        {"config": "bert", "seed": 0, "diverged_at": 2},
    ]
    assert divergence_note(rows, "pt") == "; s0 diverged at epoch 13: the mean stops before it"
    assert divergence_note(rows[1:2], "pt") == ""


def test_the_mean_curve_stops_before_a_seed_diverged():
    rows = [
        {"config": "pt-small", "curve": [10.0, 8.0, 1e40, 1e30], "diverged_at": 3},
        {"config": "pt-small", "curve": [12.0, 6.0, 5.0, 4.0], "diverged_at": None},
    ]
    assert mean_curve(rows, "pt-small") == [11.0, 7.0]


def test_no_mean_over_seeds_while_a_seed_has_no_curve():
    """A mean over the seeds that have curves would be one seed's curve under the mean's name."""
    rows = [{"config": "pt-small", "curve": [10.0, 8.0]}, {"config": "pt-small", "curve": []}]
    assert mean_curve(rows, "pt-small") == []


def test_the_recipe_reads_what_every_run_records():
    from benchmarks.convergence_report import shared

    rows = [{"warmup_steps": 100, "batch_size": 32}, {"warmup_steps": None, "batch_size": None}]
    assert (shared(rows, "warmup_steps"), shared(rows, "batch_size")) == ("100", "32")
    assert shared([{"lr": 0.01}, {"lr": 0.03}], "lr") == "per run" and shared(rows[1:], "batch_size") == "not started"


def test_the_mean_curve_stops_at_the_shortest_seed():
    rows = [
        {"config": "pt-small", "curve": [10.0, 8.0, 7.0]},
        {"config": "pt-small", "curve": [12.0, 6.0]},
        {"config": "bert-small", "curve": [1.0]},
    ]
    assert mean_curve(rows, "pt-small") == [11.0, 7.0]
    assert mean_curve(rows, "ut-small") == []


def test_the_ranking_is_read_against_the_papers():
    from benchmarks.convergence_report import against_the_paper

    text = against_the_paper([600.0, 500.0], [650.0, 400.0])
    assert text.startswith("PT: at epoch 2, BERT is ahead (500.0 PT vs 400.0 BERT): this agrees with")
    assert against_the_paper([300.0], [400.0], "pt-small-lr0.01").startswith("pt-small-lr0.01: at epoch 1, PT")
    assert "PT is ahead" in against_the_paper([300.0], [400.0]) and "reverse" in against_the_paper([300.0], [400.0])


def test_the_section_replaces_only_what_lies_between_its_markers(tmp_path, monkeypatch):
    from benchmarks import convergence_report

    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nearlier section\n")
    monkeypatch.setattr(convergence_report, "DOC", page)
    convergence_report.write_section("first report")
    convergence_report.write_section("second report")
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nearlier section\n")
    assert text.count(convergence_report.HEADING) == 1 and "second report" in text and "first report" not in text


@given(st.lists(st.floats(-1e3, 1e3).filter(lambda g: g != 0.0), min_size=1, max_size=40))
def test_the_crossings_are_the_sign_flips_and_their_count_gives_the_final_leader(gaps):
    from benchmarks.convergence_report import sign_changes

    flips = sign_changes(gaps)
    assert all((gaps[e] < 0) == (gaps[e - 1] > 0) for e in flips)
    assert all((gaps[e] < 0) == (gaps[e - 1] < 0) for e in range(1, len(gaps)) if e not in flips)
    # an odd number of crossings, and only then, leaves the other model ahead
    assert (len(flips) % 2 == 1) == ((gaps[0] > 0) != (gaps[-1] > 0))


@given(st.lists(st.floats(1.0, 1e4), min_size=1, max_size=30), st.integers(0, 29), st.floats(10.5, 1e40))
def test_a_run_diverges_at_the_first_epoch_ten_times_worse_than_its_best_before(points, at, factor):
    from benchmarks.convergence_report import diverged_at

    steady = [min(points[: i + 1]) for i in range(len(points))]  # never worse than before: no divergence
    assert diverged_at(steady) is None
    if at < len(steady):
        spiked = steady[:at] + [factor * min(steady[: at or 1])] + steady[at:]
        assert diverged_at(spiked) == (at + 1 if at else None)  # the first epoch has nothing before it


def test_perplexities_past_a_million_print_as_powers_of_ten():
    from benchmarks.convergence_report import ppl

    assert ppl(282.64) == "282.6" and ppl(2.1309e40) == "2.13e+40"
    assert ppl(-5.25, signed=True) == "-5.2" and ppl(-2.13e40, signed=True) == "-2.13e+40"


def _write_run(run, perplexities, per_epoch, stopped_early, finished):
    """A run folder as the trainer leaves it: train lines, a periodic validation after every
    epoch but on the run's last step (MAX_EPOCHS epochs: there it validates once, as its
    final line), the final line and summary.json once finished."""
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for epoch, value in enumerate(perplexities, start=1):
        step = epoch * per_epoch
        lines.append({"step": step, "split": "train", "loss": 5.0, "tokens_per_second": 1000.0 + epoch})
        if step < convergence.MAX_EPOCHS * per_epoch:
            lines.append({"step": step, "split": "valid", "loss": math.log(value), "perplexity": value})
    if finished:
        final = {"step": len(perplexities) * per_epoch, "split": "valid", "final": True}
        lines.append(final | {"loss": math.log(perplexities[-1]), "perplexity": perplexities[-1]})
        (run / "summary.json").write_text(json.dumps({"stopped_early": stopped_early}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@given(st.lists(st.floats(1.0, 1e4), min_size=1, max_size=convergence.MAX_EPOCHS), st.booleans())
def test_the_curve_has_one_perplexity_per_epoch_trained_the_last_epoch_included(values, to_the_end):
    """A run that trains all MAX_EPOCHS epochs has no periodic validation on its last step,
    only the final one: the curve takes that as its last epoch (it was left out: 39 epochs,
    and a best and last perplexity without the 40th); an early-stopped run's final line
    repeats its last periodic one and adds no epoch."""
    from benchmarks.convergence_report import curve

    if to_the_end:
        values = (values * convergence.MAX_EPOCHS)[: convergence.MAX_EPOCHS]
    finished = to_the_end or len(values) > convergence.PATIENCE  # else in progress
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        _write_run(run, values, 7, stopped_early=not to_the_end, finished=finished)
        assert curve(run) == values
        assert convergence.epochs_done(run) == len(values)


@given(st.integers(1, 10_000), st.sampled_from(["train", "valid"]))
def test_a_line_the_trainer_is_still_writing_is_no_record(cut, split):
    """The trainer appends a metrics line in two writes (and a kill can stop it between them),
    so a report read while the study runs can find a last line without its newline: it is
    not read (it was, and JSONDecodeError ended the report), as the trainer's resume drops it."""
    from benchmarks.convergence_report import curve, tokens_per_second

    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        _write_run(run, [300.0, 200.0, 150.0], 7, stopped_early=False, finished=False)
        whole = (convergence.records(run), curve(run), tokens_per_second(run), convergence.epochs_done(run))
        line = json.dumps({"step": 28, "split": split, "loss": 4.9, "perplexity": 134.3, "tokens_per_second": 9.0})
        with (run / "metrics.jsonl").open("a") as handle:
            handle.write(line[: cut % len(line)])
        assert (convergence.records(run), curve(run), tokens_per_second(run), convergence.epochs_done(run)) == whole


@given(st.lists(st.one_of(st.floats(1.0, 1e6), st.just(math.nan)), min_size=1, max_size=40))
def test_the_best_epoch_is_early_stoppings_and_a_nan_is_never_it(points):
    """The report's best epoch is the one the trainer's early stopping keeps (the first lowest
    loss, a NaN never an improvement); it took a NaN at epoch 1 as the best (min() keeps
    a NaN it starts from), and a NaN after a best was no divergence."""
    from benchmarks.convergence_report import best_epoch, diverged_at
    from probformer.training.early_stopping import EarlyStopping

    stopping = EarlyStopping(patience=0)
    for epoch, value in enumerate(points, start=1):
        stopping.update(math.log(value), epoch)
    assert best_epoch(points) == (stopping.best_step or None)
    first_nan = next((e for e, value in enumerate(points) if math.isnan(value)), None)
    if first_nan is not None and any(not math.isnan(value) for value in points[:first_nan]):
        assert diverged_at(points) is not None and diverged_at(points) <= first_nan + 1


# curves of a small synthetic study, 6 epochs each (early stopping after the best at epoch 3)
PT_S0, PT_S1 = [300.0, 200.0, 150.0, 160.0, 170.0, 180.0], [310.0, 190.0, 140.0, 150.0, 155.0, 160.0]
BERT_S0, BERT_S1 = [250.0, 150.0, 100.0, 110.0, 120.0, 130.0], [260.0, 140.0, 90.0, 95.0, 96.0, 97.0]
UT = [255.0, 155.0, 105.0, 115.0, 125.0, 135.0]


def study_report(folder, curves: dict, running: tuple = ()) -> str:
    """The report's text for run folders written under ``folder`` from ``curves`` ({run name:
    perplexities}), every run finished but those named in ``running``."""
    from benchmarks.convergence_report import collect, report

    for name, values in curves.items():
        _write_run(folder / name, values, 7, stopped_early=True, finished=name not in running)
    arms = convergence.parse_arms("pt,bert,ut")
    return report(arms, collect(arms, 2, folder))


def default_curves(**changed) -> dict:
    curves = {"pt-small-s0": PT_S0, "pt-small-s1": PT_S1, "bert-small-s0": BERT_S0, "bert-small-s1": BERT_S1}
    return curves | {"ut-small-s0": UT, "ut-small-s1": UT} | {name.replace("_", "-"): c for name, c in changed.items()}


def test_a_finished_study_states_each_arms_final_best_and_the_final_ranking_against_the_papers(tmp_path):
    text = study_report(tmp_path, default_curves())
    # best perplexities 150 and 140: mean 145, sample sd sqrt(50) = 7.07
    assert (
        "- pt-small: final best validation perplexity 145.00 ± 7.07 (mean ± sample sd over 2 seeds; "
        "s0 150.00 at epoch 3; s1 140.00 at epoch 3)." in text
    )
    assert "- bert-small: final best validation perplexity 95.00 ± 7.07" in text
    assert "- ut-small: final best validation perplexity 105.00 ± 0.00" in text
    # 145 / 95 - 1 = 52.6%
    assert (
        "- pt-small, final: BERT is ahead, PT's best perplexity 52.6% higher (145.00 ± 7.07 pt-small vs "
        "95.00 ± 7.07 bert-small): this agrees with the PT paper's converged ranking" in text
    )
    assert "PT's 7.6% higher" in text  # the paper's: 62.86 / 58.43 - 1
    assert "Every run has finished" in text and "Total CPU hours: " in text
    assert "at epoch 6, BERT is ahead" not in text and "extrapolation" not in text and "in progress" not in text


def test_while_a_seed_runs_its_arm_gives_no_final_number_and_the_ranking_stays_the_curves(tmp_path):
    text = study_report(tmp_path, default_curves(bert_small_s1=BERT_S1[:4]), running=("bert-small-s1",))
    assert (
        "- bert-small: in progress (s0 stopped early; s1 in progress): no final number until every seed has finished."
        in text
    )
    assert "bert-small: final" not in text and "95.00" not in text and "pt-small, final" not in text
    assert "- pt-small: final best validation perplexity 145.00 ± 7.07" in text  # PT's seeds have finished
    assert "- pt-small: at epoch 4, BERT is ahead (155.0 PT vs 102.5 BERT): this agrees with" in text
    assert "Some runs are still in progress (bert-small): what compares with them is partial" in text
    assert "Total CPU hours so far" in text


def test_a_diverged_seeds_best_before_it_counts_and_the_seed_is_flagged(tmp_path):
    diverged = [300.0, 200.0, 150.0, 1e40, 1e41, 1e42]
    text = study_report(tmp_path, default_curves(pt_small_s0=diverged))
    assert (
        "- pt-small: final best validation perplexity 145.00 ± 7.07 (mean ± sample sd over 2 seeds; "
        "s0 150.00 at epoch 3, diverged at epoch 4: its best, before that, stands; s1 140.00 at epoch 3)." in text
    )
    assert "- Diverged: pt-small s0 at epoch 4" in text
    assert (
        "(145.00 ± 7.07 pt-small vs 95.00 ± 7.07 bert-small; pt-small s0 diverged, its best before that counted)"
        in text
    )


def test_a_tie_names_no_leader_finished_or_in_progress(tmp_path):
    from benchmarks.convergence_report import against_the_paper

    text = study_report(tmp_path, default_curves(bert_small_s0=PT_S0, bert_small_s1=PT_S1))
    assert "- pt-small, final: a tie (145.00 ± 7.07 pt-small vs 145.00 ± 7.07 bert-small): neither is ahead" in text
    assert against_the_paper([120.0, 100.0], [130.0, 100.0]).startswith("PT: at epoch 2, a tie (100.0 PT vs 100.0")


def test_a_gap_within_the_seeds_spread_ranks_neither_clearly(tmp_path):
    text = study_report(tmp_path, default_curves(bert_small_s0=[300.0, 146.0], bert_small_s1=[300.0, 147.0]))
    [line] = [line for line in text.splitlines() if line.startswith("- pt-small, final:")]
    assert line.startswith(
        "- pt-small, final: neither is clearly ahead: PT's mean best perplexity is the lower, BERT's 1.0% higher"
    )
    # a gap the report calls too small to rank neither agrees with the paper's ranking nor reverses it
    assert (
        "a gap no larger than a seed's standard deviation (7.07): too small to rank with 2 seeds; for comparison, "
        "the PT paper's converged ranking" in line
    )
    assert "reverse" not in line and "agrees" not in line and "PT is ahead" not in line


@given(st.lists(st.tuples(st.floats(1.0, 1e5), st.booleans()), min_size=1, max_size=5))
def test_the_final_mean_and_sd_are_over_every_seed_and_only_once_all_have_finished(seeds):
    from benchmarks.convergence_report import arm_result, final_best

    rows = [
        {"config": "pt-small", "seed": seed, "best_perplexity": best, "best_epoch": 1, "finished": done}
        | {"status": "stopped early" if done else "in progress", "diverged_at": None}
        for seed, (best, done) in enumerate(seeds)
    ]
    rows.append(rows[0] | {"config": "bert-small", "best_perplexity": 1.0, "finished": True})  # another arm
    bests = [best for best, _ in seeds]
    if not all(done for _, done in seeds):
        assert final_best(rows, "pt-small") is None and "±" not in arm_result(rows, "pt-small")
        return
    mean, sd = final_best(rows, "pt-small")
    expected_mean = sum(bests) / len(bests)
    assert math.isclose(mean, expected_mean, rel_tol=1e-12)
    if len(bests) == 1:
        assert sd is None and "(one seed)" in arm_result(rows, "pt-small")
    else:
        expected_sd = math.sqrt(sum((b - expected_mean) ** 2 for b in bests) / (len(bests) - 1))
        assert math.isclose(sd, expected_sd, rel_tol=1e-9, abs_tol=1e-9 * expected_mean)


def test_the_report_reads_the_run_folders_given_and_writes_its_section_plot_and_data(tmp_path, monkeypatch):
    import sys

    from benchmarks import convergence_report

    runs = tmp_path / "copy"
    for name, values in default_curves().items():
        _write_run(runs / name, values, 7, stopped_early=True, finished=True)
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    for name, path in {"DOC": page, "PLOT": tmp_path / "c.png", "RESULTS": tmp_path / "c.json"}.items():
        monkeypatch.setattr(convergence_report, name, path)
    monkeypatch.setattr(sys, "argv", ["convergence_report", "--models", "pt,bert,ut", "--runs", str(runs)])
    convergence_report.main()
    assert "pt-small: final best validation perplexity 145.00 ± 7.07" in page.read_text()
    assert (tmp_path / "c.png").stat().st_size > 0
    assert [r["best_perplexity"] for r in json.loads((tmp_path / "c.json").read_text())["runs"]][:2] == [150.0, 140.0]
    monkeypatch.setattr(sys, "argv", ["convergence_report", "--runs", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="--runs"):
        convergence_report.main()


def test_each_model_is_ranked_at_its_better_rate_only_once_every_arm_has_finished(tmp_path):
    from benchmarks.convergence_claims import at_their_better_rates

    text = study_report(tmp_path, default_curves())
    assert (
        "- Each model at its better learning rate, the lowest final best perplexity first: "
        "bert-small 95.00 ± 7.07; ut-small 105.00 ± 0.00; pt-small 145.00 ± 7.07." in text
    )

    def seeds(config, *bests, finished=True):
        return [{"config": config, "finished": finished, "best_perplexity": b} for b in bests]

    models = {"pt-small": "pt", "pt-small-lr0.01": "pt", "bert-small": "bert", "bert-small-lr0.001": "bert"}
    rows = seeds("pt-small", 280.0, 130.0) + seeds("pt-small-lr0.01", 82.0, 84.0) + seeds("bert-small", 76.0, 78.0)
    finished = rows + seeds("bert-small-lr0.001", 90.0, 91.0)
    assert at_their_better_rates(finished, models) == (
        "Each model at its better learning rate, the lowest final best perplexity first: "
        "bert-small 77.00 ± 1.41; pt-small-lr0.01 83.00 ± 1.41."
    )
    assert at_their_better_rates(rows + seeds("bert-small-lr0.001", 70.0, 71.0, finished=False), models) is None
    assert "Each model at its better" not in study_report(tmp_path / "running", default_curves(), ("ut-small-s1",))
