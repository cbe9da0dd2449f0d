"""A tuned PT vs BERT vs UT comparison on PTB MLM: a learning-rate sweep per
model on a log grid (seed 0), then more seeds at each model's best learning rate.

    .venv/bin/python benchmarks/lr_sweep.py --sizes small          # run / resume the sweep
    .venv/bin/python benchmarks/lr_sweep.py --sizes small --report # the markdown table

Runs one after another on one thread, each into runs/lr_sweep/<config>-lr<lr>-s<seed>.
Each finished run is appended to docs/benchmarks/ptb_lr_sweep.json at once (a kill loses
at most the run in progress) and runs already there are skipped (resumable). Order: every
model at its grid's centre first, then outward one grid step at a time (the side of the
best lr so far first), so a partial sweep is still a sweep; a best lr on the grid's edge
gets one more point beyond it (at most --max-extend times); then seeds 1, 2, ... at each
model's best lr.
`--dry-run STEPS` trains STEPS steps per run into runs/lr_sweep_dry/ and never touches
the results file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import subprocess
from pathlib import Path

import torch

from probformer.mup.coord_check import progress_bar
from probformer.training import run_config
from probformer.training.trainer import train

MODELS = ("pt", "bert", "ut")
SIZES = ("small", "medium")
# One half-decade grid (x3.16) for all three: it brackets PT's untuned 3e-3 and the
# baselines' untuned 1e-3, and treats the models alike.
DEFAULT_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
RESULTS = Path("docs/benchmarks/ptb_lr_sweep.json")
RUNS = Path("runs/lr_sweep")


def lr_name(lr: float) -> str:
    return f"{lr:.3g}"


def run_key(config: str, lr: float, seed: int) -> str:
    return f"{config}-lr{lr_name(lr)}-s{seed}"


def load_results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"] if path.is_file() else []


def append_result(path: Path, row: dict) -> None:
    rows = load_results(path) + [row]
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps({"runs": rows}, indent=1))
    temporary.replace(path)  # atomic: a kill mid-write leaves the previous file


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    # other work may be uncommitted in the checkout: say whether the library itself was
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "probformer", "graphs", "inference"], capture_output=True, text=True
    ).stdout.strip()
    return head + ("+dirty" if dirty else "")


def ppl_by_lr(rows: list[dict], config: str, seed: int = 0) -> dict[float, float]:
    return {r["lr"]: r["valid_perplexity"] for r in rows if r["config"] == config and r["seed"] == seed}


def best_lr(rows: list[dict], config: str) -> float | None:
    by_lr = ppl_by_lr(rows, config)
    return min(by_lr, key=by_lr.get) if by_lr else None


def grid_step(lr: float, direction: int) -> float:
    """The next point of the half-decade grid (1, 3, 10, 30, ...) below or above ``lr``."""
    exponent = round(2 * (math.log10(lr) + direction / 2)) / 2
    return float(f"{10**exponent:.1g}")


def ring(lrs: list[float], distance: int, best: float | None) -> list[float]:
    """The grid points ``distance`` steps from the grid's centre, the one on the side of
    the best lr so far first (lower first when the best is the centre or unknown)."""
    centre = len(lrs) // 2
    points = [lr for lr in lrs if abs(lrs.index(lr) - centre) == distance]
    toward_higher = best is not None and best > lrs[centre]
    return sorted(points, reverse=toward_higher)


def train_one(config_name: str, lr: float, seed: int, steps: int, root: Path, code: str) -> dict:
    config = run_config.load(Path("configs") / f"{config_name}.toml")
    overrides = {"lr": lr, "seed": seed, "threads": 1}
    if steps:
        overrides["steps"] = steps
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, **overrides))
    run = root / run_key(config_name, lr, seed)
    if run.exists():  # an interrupted run: start it again so its seconds are one clean run
        shutil.rmtree(run)
    summary = train(config, run, progress=False)
    return {
        "config": config_name,
        "lr": lr,
        "seed": seed,
        "valid_perplexity": summary["valid"]["perplexity"],
        "valid_loss": summary["valid"]["loss"],
        "valid_tokens": summary["valid"]["tokens"],
        "parameters": summary["parameters"],
        "steps": summary["steps"],
        "tokens": summary["tokens"],
        "seconds": summary["seconds"],
        "tokens_per_second": summary["tokens_per_second"],
        "threads": 1,
        "commit": code,
        "run": str(run),
        "command": f"probformer train --config configs/{config_name}.toml --set train.lr={lr_name(lr)} "
        f"--set train.seed={seed} --set train.threads=1",
    }


def sweep(configs: list[str], grids: dict[str, list[float]], seeds: int, max_extend: int, steps: int) -> None:
    results, root = (
        (RESULTS, RUNS) if not steps else (Path("runs/lr_sweep_dry/results.json"), Path("runs/lr_sweep_dry"))
    )
    if steps and results.exists():
        results.unlink()
    # the library is imported once, here, so every run of this process uses the code of this commit
    code = commit()
    # the sweep adapts (an edge best adds a grid step), so the total is the planned grid, an estimate
    planned = sum(len(grids[c]) for c in configs) + (seeds - 1) * len(configs)
    done_before = {run_key(r["config"], r["lr"], r["seed"]) for r in load_results(results)}
    bar = progress_bar(planned, f"lr sweep of {len(configs)} configs, runs")
    bar.update(min(len(done_before), planned))

    def ensure(config: str, lr: float, seed: int) -> None:
        done = {run_key(r["config"], r["lr"], r["seed"]) for r in load_results(results)}
        if run_key(config, lr, seed) in done:
            return
        bar.write(f"training {run_key(config, lr, seed)}")
        row = train_one(config, lr, seed, steps, root, code)
        append_result(results, row)
        bar.write(json.dumps(row))
        bar.total = max(bar.total, bar.n + 1)
        bar.update(1)

    # ring by ring, one point per model per pass, so every model advances at the same pace
    for distance in range(max(len(grid) for grid in grids.values()) // 2 + 1):
        for side in (0, 1):
            for config in configs:
                points = ring(grids[config], distance, best_lr(load_results(results), config))
                if side < len(points):
                    ensure(config, points[side], 0)
    for config in configs:  # a best lr on the edge: one more grid step beyond it
        for _ in range(max_extend):
            tried = sorted(ppl_by_lr(load_results(results), config))
            best = best_lr(load_results(results), config)
            if best == tried[0]:
                ensure(config, grid_step(best, -1), 0)
            elif best == tried[-1]:
                ensure(config, grid_step(best, +1), 0)
            else:
                break
    for seed in range(1, seeds):
        for config in configs:
            ensure(config, best_lr(load_results(results), config), seed)
    bar.close()


def mean_sd(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.1f} (1 seed)"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def cell(ppl: float, best: bool) -> str:
    """A perplexity beyond the unigram's by orders of magnitude (or not finite) is a divergence."""
    if not math.isfinite(ppl) or ppl > 1e6:
        return f"diverged ({ppl:.1e})"
    return f"**{ppl:.1f}**" if best else f"{ppl:.1f}"


def report(configs: list[str], path: Path = RESULTS) -> str:
    rows = load_results(path)
    lrs = sorted({r["lr"] for r in rows if r["config"] in configs and r["seed"] == 0})
    lines = [
        "Validation masked-token perplexity after one epoch of PTB (seed 0 at each lr; "
        "mean ± sd (sample sd) over seeds at the best lr).",
        "",
        "| model | parameters | "
        + " | ".join(f"lr {lr_name(lr)}" for lr in lrs)
        + " | best lr | seeds | ppl at best lr | tokens/s |",
        "|---|---|" + "---|" * len(lrs) + "---|---|---|---|",
    ]
    summary = {}
    for config in configs:
        by_lr = ppl_by_lr(rows, config)
        if not by_lr:
            continue
        best = best_lr(rows, config)
        at_best = [r for r in rows if r["config"] == config and r["lr"] == best]
        ppl = [r["valid_perplexity"] for r in at_best]
        summary[config] = (best, ppl)
        cells = [cell(by_lr[lr], lr == best) if lr in by_lr else "—" for lr in lrs]
        edge = " (edge)" if best in (min(by_lr), max(by_lr)) else ""
        speed = statistics.mean(r["tokens_per_second"] for r in rows if r["config"] == config)
        lines.append(
            f"| {config} | {at_best[0]['parameters'] / 1e6:.3f} M | "
            + " | ".join(cells)
            + f" | {lr_name(best)}{edge} | {len(ppl)} | {mean_sd(ppl)} | {speed:,.0f} |"
        )
    lines += ["", claim(summary)]
    return "\n".join(lines)


def claim(summary: dict[str, tuple[float, list[float]]]) -> str:
    """PT against each baseline of its size at each one's best lr; 'separated' when the
    seeds' ranges do not overlap (with 3 seeds, the honest strength of evidence)."""
    sentences = []
    for pt in [c for c in summary if c.startswith("pt-")]:
        size = pt.removeprefix("pt-")
        for baseline in (f"bert-{size}", f"ut-{size}"):
            if baseline not in summary:
                continue
            (lr_a, a), (lr_b, b) = summary[pt], summary[baseline]
            better = "lower" if statistics.mean(a) < statistics.mean(b) else "higher"
            separated = max(a) < min(b) or max(b) < min(a)
            strength = (
                "seed ranges do not overlap"
                if separated and min(len(a), len(b)) >= 2
                else "seed ranges overlap"
                if min(len(a), len(b)) >= 2
                else "single seed: no spread yet"
            )
            sentences.append(
                f"At the {size} size with tuned learning rates, PT (lr {lr_name(lr_a)}) reaches perplexity "
                f"{mean_sd(a)} vs {baseline} (lr {lr_name(lr_b)}) {mean_sd(b)}: PT is {better} by "
                f"{abs(statistics.mean(a) - statistics.mean(b)):.1f} ({strength})."
            )
    return "\n".join(sentences) or "No PT/baseline pair has results yet."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small", help="small, medium or small,medium")
    parser.add_argument("--models", default=",".join(MODELS), help="subset of pt,bert,ut")
    for model in MODELS:
        parser.add_argument(
            f"--lrs-{model}", default="", help=f"comma-separated lrs for {model} (default: the shared grid)"
        )
    parser.add_argument("--seeds", type=int, default=3, help="seeds at each model's best lr (seed 0 is the sweep's)")
    parser.add_argument("--max-extend", type=int, default=2, help="extra grid points when the best lr is on an edge")
    parser.add_argument("--dry-run", type=int, default=0, metavar="STEPS", help="STEPS per run into runs/lr_sweep_dry/")
    parser.add_argument("--report", action="store_true", help="print the markdown table and the claim, train nothing")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    models = args.models.split(",")
    for name, values, allowed in (("--sizes", sizes, SIZES), ("--models", models, MODELS)):
        if not values or any(v not in allowed for v in values):
            raise SystemExit(f"{name} must be a comma-separated subset of {list(allowed)}, got {','.join(values)!r}")
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1, got {args.seeds}")
    configs = [f"{model}-{size}" for size in sizes for model in models]
    if args.report:
        print(report(configs))
        return
    torch.set_num_threads(1)
    grids = {}
    for config in configs:
        text = getattr(args, f"lrs_{config.split('-')[0]}")
        grids[config] = sorted(float(v) for v in text.split(",")) if text else list(DEFAULT_LRS)
    sweep(configs, grids, args.seeds, args.max_extend, args.dry_run)


if __name__ == "__main__":
    main()
