"""The convergence study's report, read from the run folders alone: the validation
perplexity curves (a plot), per run the best perplexity and its epoch, tokens/s and CPU
hours, the crossing point of PT's curve with each baseline's, the claim the curves support
so far and, once every seed of an arm has finished, its final best perplexity (mean ± sd
over seeds), the final ranking against the paper's and each model at its better rate
(``convergence_claims``), written to docs/benchmarks.md between its markers:

    .venv/bin/python -m benchmarks.convergence_report [--seeds 2] [--models pt,bert,ut,pt@0.01] [--runs FOLDER]

--runs reads the run folders from FOLDER (default runs/convergence; a copy of a live
study's, say); the report is written to this checkout's docs either way.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from benchmarks.convergence import (
    ARMS,
    MAX_EPOCHS,
    PATIENCE,
    PLOT,
    RESULTS,
    ROOT,
    Arm,
    epoch_validations,
    finished,
    parse_arms,
    read_cpu_seconds,
    records,
)
from benchmarks.convergence_claims import (
    against_the_paper,
    arm_result,
    at_their_better_rates,
    final_against_the_paper,
    final_best,
    ppl,
)
from benchmarks.convergence_plot import plot

DOC = Path("docs/benchmarks.md")
START, END = "<!-- convergence:start -->", "<!-- convergence:end -->"
HEADING = "## Does PT's one-epoch lead survive to convergence? PT vs BERT vs UT trained until validation stops"

COMMAND = ".venv/bin/python -m benchmarks.convergence --workers 2 && .venv/bin/python -m benchmarks.convergence_report"


def curve(run: Path) -> list[float]:
    """Validation perplexity after each epoch (index 0: epoch 1), the last epoch of a run
    trained to the end included (its final validation)."""
    return [r["perplexity"] for r in epoch_validations(run)]


def tokens_per_second(run: Path) -> float | None:
    """The median over the run's logging windows (robust to windows paused by other work)."""
    speeds = [r["tokens_per_second"] for r in records(run) if r["split"] == "train" and "tokens_per_second" in r]
    return statistics.median(speeds) if speeds else None


def cpu_hours(run: Path) -> float:
    return sum(read_cpu_seconds(run)) / 3600  # the ended turns, and the one running now


def status(run: Path, summary: dict | None) -> str:
    if summary:
        return "stopped early" if summary["stopped_early"] else f"{MAX_EPOCHS} epochs"
    return "in progress" if run.is_dir() else "not started"


DIVERGED = 10.0  # a validation perplexity this many times the best before it: the run diverged there


def best_epoch(points: list[float]) -> int | None:
    """The epoch (1-based) of the lowest perplexity, the first of equals; a NaN is never the
    best (as in early stopping, which keeps the same epoch)."""
    measured = [epoch for epoch, value in enumerate(points) if not math.isnan(value)]
    return min(measured, key=points.__getitem__) + 1 if measured else None


def diverged_at(points: list[float]) -> int | None:
    """The first epoch (1-based) whose perplexity is ``DIVERGED`` times the best before it,
    or NaN after one."""
    for epoch in range(1, len(points)):
        best = best_epoch(points[:epoch])
        if best is not None and not points[epoch] <= DIVERGED * points[best - 1]:
            return epoch + 1
    return None


def trained_with(run: Path, arm: Arm) -> dict:
    """The run's learning rate, batch size and warm-up as its run.json records them (what it
    trains with), else the arm's rate before the run has started."""
    path = run / "run.json"
    if not path.is_file():
        return {"lr": arm.learning_rate, "batch_size": None, "warmup_steps": None}
    train = json.loads(path.read_text())["train"]
    return {key: train[key] for key in ("lr", "batch_size", "warmup_steps")}


def summarise(arm: Arm, seed: int, runs: Path = ROOT) -> dict:
    run = runs / arm.folder(seed).name
    points = curve(run)
    best = best_epoch(points)
    summary = json.loads((run / "summary.json").read_text()) if finished(run) else None
    return {
        "config": arm.name,
        "model": arm.model,
        "seed": seed,
        **trained_with(run, arm),
        "lr_from": "the one-epoch sweep" if arm.lr is None else "fixed",
        "curve": points,
        "epochs": len(points),
        "best_perplexity": points[best - 1] if best else None,
        "best_epoch": best,
        "status": status(run, summary),
        "finished": summary is not None,
        "diverged_at": diverged_at(points),
        "tokens_per_second": tokens_per_second(run),
        "cpu_hours": cpu_hours(run),
    }


def mean_curve(rows: list[dict], config: str) -> list[float]:
    """The mean over seeds at each epoch every seed of ``config`` has reached, a diverged
    seed's curve cut before its divergence (a mean with 1e40 in it compares nothing)."""
    curves = [r["curve"][: r["diverged_at"] - 1] if r.get("diverged_at") else r["curve"] for r in rows]
    curves = [c for r, c in zip(rows, curves) if r["config"] == config]
    if not curves or not all(curves):  # a seed without a curve yet: no mean over the seeds
        return []
    return [statistics.mean(c[e] for c in curves) for e in range(min(len(c) for c in curves))]


def sign_changes(gaps: list[float]) -> list[int]:
    """The epochs e (1-based) after which the gap's sign flips: the curves cross between e and e + 1."""
    return [e for e in range(1, len(gaps)) if (gaps[e] > 0) != (gaps[e - 1] > 0)]


def crossing(pt: list[float], baseline: list[float], ended: bool = False) -> str:
    """Where PT's curve crosses the baseline's (every crossing, then the gaps since the
    first), or how the gap moves so far (where it would close, unless both arms have ``ended``)."""
    common = min(len(pt), len(baseline))
    if common == 0:
        return "no common epoch yet"
    gaps = [baseline[e] - pt[e] for e in range(common)]  # > 0: PT lower (better)
    flips = sign_changes(gaps)
    if flips:
        where = ", then ".join(f"between epochs {e} and {e + 1}" for e in flips)
        ahead = "PT" if gaps[-1] > 0 else "the baseline"
        since = ", ".join(ppl(g, signed=True) for g in gaps[flips[0] - 1 :])
        return (
            f"the curves cross {where}; {ahead} is ahead at epoch {common}; "
            f"gap (baseline − PT) from epoch {flips[0]} on: {since}"
        )
    text = f"no crossing in {common} common epoch(s); gap (baseline − PT) by epoch: " + ", ".join(
        ppl(g, signed=True) for g in gaps
    )
    if common >= 3 and abs(gaps[-1]) < abs(gaps[-3]):
        rate = (abs(gaps[-3]) - abs(gaps[-1])) / 2
        text += f"; shrinking by {rate:.1f} per epoch over the last two"
        if not ended:
            text += f", which would close it near epoch {common + math.ceil(abs(gaps[-1]) / rate)} if that rate "
            text += "held (an extrapolation, not a result)"
    elif common >= 3:
        text += "; not shrinking over the last two epochs"
    return text


def seed_by_seed(rows: list[dict], pt: str, baseline: str) -> str:
    """Where each seed's PT curve crosses the same seed's baseline curve, and the gap at the
    last epoch both have (the current state, also where the mean over seeds ends earlier)."""
    curves = {(r["config"], r["seed"]): r["curve"] for r in rows}
    parts = []
    for seed in sorted({r["seed"] for r in rows}):
        a, b = curves.get((pt, seed), []), curves.get((baseline, seed), [])
        common = min(len(a), len(b))
        flips = sign_changes([b[e] - a[e] for e in range(common)])
        where = ", then ".join(f"{e}-{e + 1}" for e in flips) if flips else f"none in {common} epoch(s)"
        last = f" (gap {ppl(b[common - 1] - a[common - 1], signed=True)} at epoch {common})" if common else ""
        parts.append(f"s{seed} {where}{last}")
    return "; ".join(parts)


def divergence_note(rows: list[dict], config: str) -> str:
    """Why the mean over seeds of ``config`` may end before its seeds do: a seed that diverged
    (it may end earlier still, where another seed is shorter)."""
    cut = sorted((r["diverged_at"], r["seed"]) for r in rows if r["config"] == config and r.get("diverged_at"))
    if not cut:
        return ""
    epoch, seed = cut[0]
    return f"; s{seed} diverged at epoch {epoch}: the mean stops before it"


def shared(rows: list[dict], key: str) -> str:
    """The value every started run records for ``key``, or where they differ or none has started."""
    values = sorted({r[key] for r in rows if r[key] is not None})
    return f"{values[0]:g}" if len(values) == 1 else "per run" if values else "not started"


def collect(arms: list[Arm], seeds: int, runs: Path = ROOT) -> list[dict]:
    """One row per arm and seed, read from the run folders under ``runs``."""
    return [summarise(arm, seed, runs) for arm in arms for seed in range(seeds)]


def report(arms: list[Arm], rows: list[dict]) -> str:
    """The section's text from ``collect``'s rows (the plot and the data file are written apart)."""
    lines = [
        f"Recipe: each config at its tuned lr, linear warm-up ({shared(rows, 'warmup_steps')} steps) then "
        "linear decay to 0 at "
        f"{MAX_EPOCHS} epochs, full-validation perplexity after every epoch, early stopping after "
        f"{PATIENCE} epochs without a new best validation loss, batch {shared(rows, 'batch_size')}, one thread "
        "per run. The "
        "learning rates are the one-epoch sweep's best (linear decay over one epoch there); over a "
        f"{MAX_EPOCHS}-epoch decay the best rate may differ, PT's (10x the baselines') most of all. "
        "An arm named `-lr<rate>` trains at that fixed rate instead (a sensitivity check of that choice). "
        "tokens/s are medians over logging windows on a shared 2-core machine: compare them only roughly.",
        "",
        "| run | lr | epochs | status | best ppl (epoch) | last ppl | tokens/s (median) | CPU hours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = f"{ppl(r['best_perplexity'])} ({r['best_epoch']})" if r["best_epoch"] else "—"
        last = f"{ppl(r['curve'][-1])}" if r["curve"] else "—"
        status = r["status"] + (f", diverged at epoch {r['diverged_at']}" if r["diverged_at"] else "")
        speed = f"{r['tokens_per_second']:,.0f}" if r["tokens_per_second"] else "—"
        lines.append(
            f"| {r['config']} s{r['seed']} | {r['lr']:g} | {r['epochs']} | {status} | {best} | {last} | "
            f"{speed} | {r['cpu_hours']:.2f} |"
        )
    done = all(r["finished"] for r in rows)
    lines += ["", f"Total CPU hours{'' if done else ' so far'}: {sum(r['cpu_hours'] for r in rows):.2f}.", ""]
    for r in (r for r in rows if r["diverged_at"]):
        epoch = r["diverged_at"]
        before = r["curve"][best_epoch(r["curve"][: epoch - 1]) - 1]
        lines.append(
            f"- Diverged: {r['config']} s{r['seed']} at epoch {epoch} (validation perplexity "
            f"{ppl(r['curve'][epoch - 1])}, after a best of {ppl(before)}); early stopping "
            "ends it once its patience runs out, and its best epoch stands."
        )
    pts = [arm.name for arm in arms if arm.model == "pt"]
    for pt in pts:
        for baseline in [arm.name for arm in arms if arm.model != "pt"]:
            ended = final_best(rows, pt) is not None and final_best(rows, baseline) is not None
            gap = crossing(mean_curve(rows, pt), mean_curve(rows, baseline), ended)
            seeds = seed_by_seed(rows, pt, baseline)
            note = divergence_note(rows, pt)
            lines.append(f"- {pt} vs {baseline} (mean over seeds{note}): {gap}. Crossings seed by seed: {seeds}.")
    for arm in arms:
        lines.append(f"- {arm_result(rows, arm.name)}")
    for pt in pts:  # every PT arm: the sweep's rate and the sensitivity arms alike
        if final_best(rows, pt) is not None and final_best(rows, "bert-small") is not None:
            lines.append(f"- {final_against_the_paper(rows, pt)}")
        else:
            lines.append(f"- {against_the_paper(mean_curve(rows, pt), mean_curve(rows, 'bert-small'), pt)}")
    ranking = at_their_better_rates(rows, {arm.name: arm.model for arm in arms})
    if ranking is not None:
        lines.append(f"- {ranking}")
    lines.append(
        "\nEvery run has finished: the best perplexities and their means above are final."
        if done
        else "\nNot converged: every figure above is a curve so far, not a final result (no run has stopped)."
        if not any(r["finished"] for r in rows)
        else "\nSome runs are still in progress ("
        + ", ".join(sorted({r["config"] for r in rows if not r["finished"]}))
        + "): what compares with them is partial; an arm's final number above is final once every seed of it has "
        "finished."
    )
    return "\n".join(lines)


def write_section(text: str) -> None:
    """The report between the convergence markers of docs/benchmarks.md (a section added at
    the end the first time); everything else in the page is left as it is."""
    page = DOC.read_text()
    body = f"{START}\n{text}\n\nCommand: `{COMMAND}` (the figure: `{PLOT}`, the data: `{RESULTS}`).\n{END}"
    if START in page:
        head, _, rest = page.partition(START)
        page = head + body + rest.partition(END)[2]
    else:
        page = page.rstrip("\n") + f"\n\n{HEADING}\n\n{body}\n"
    DOC.write_text(page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2, help="seeds per model (0, 1, ...)")
    parser.add_argument("--models", default=ARMS, help="arms, MODEL or MODEL@LR, MODEL one of pt,bert,ut")
    parser.add_argument("--runs", type=Path, default=ROOT, help="the folder holding the run folders")
    args = parser.parse_args()
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1, got {args.seeds}")
    if not args.runs.is_dir():
        raise SystemExit(f"--runs: {args.runs} is not a folder")
    arms = parse_arms(args.models)
    rows = collect(arms, args.seeds, args.runs)
    plot(rows, PLOT)
    RESULTS.write_text(json.dumps({"command": COMMAND, "runs": rows}, indent=1))
    text = report(arms, rows)
    write_section(text)
    print(text)


if __name__ == "__main__":
    main()
