"""Kill a tiny training run with SIGKILL at random moments and resume it.

    .venv/bin/python benchmarks/kill_resume.py [--trials 100] [--seed 0] [--workers 2] [--out DIR]

Each trial starts ``probformer train`` (a subprocess) on a tiny PT run (24 steps, a
checkpoint after every step, so much of the run is spent inside saves; a metrics line
every fifth step, so checkpoints fall inside loss windows; a validation at step 12),
waits until the run folder exists (imports and data preparation are over), sleeps a
random delay drawn uniformly over the time the uninterrupted run took from there to
its ``summary.json``, and sends SIGKILL. A trial whose run had written its summary
before the kill is drawn again (it tested nothing). Then
``probformer train --resume`` (a second subprocess) finishes the run, and the trial
counts as identical when the final weights (``model/model.safetensors``) are equal
byte for byte to an uninterrupted run's and ``metrics.jsonl`` is equal line for line
once the wall-clock fields (``elapsed``, ``tokens_per_second``) are dropped (and so is
``metrics.csv``, row for row), with
no temporary file or folder left behind.

Where each kill landed is read from what it left on disk: a temporary checkpoint
folder (inside a save), a complete checkpoint the pointer does not name yet (between
rename and pointer move), an older checkpoint not yet pruned, half a metrics line,
the final model folder mid-write, the final validation line without the model, or
none of these (inside a step, an evaluation or the loss plot).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WALL_CLOCK_KEYS = ("elapsed", "tokens_per_second")  # as probformer.training.run_log says

sys.path.insert(0, str(ROOT))
from tests.probformer.training.test_resume import TINY as TEST_RUN  # noqa: E402  (one tiny run for both)

# the test's tiny PT run, longer: more steps to land kills in, a validation mid-run
TINY = TEST_RUN.replace("steps = 6", "steps = 24").replace("eval_every = 3", "eval_every = 12")
TINY = TINY.replace("log_every = 2", "log_every = 5")
assert TINY.count("steps = 24") == 1 and "eval_every = 12" in TINY and "log_every = 5" in TINY


def start(config: Path, run: Path, *extra: str) -> subprocess.Popen:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    command = [sys.executable, "-m", "probformer", "train", "--config", str(config), "--out", str(run), *extra]
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def comparable(run: Path) -> tuple[bytes, list[dict], list[dict]]:
    """The final weights, metrics.jsonl and metrics.csv, wall-clock fields dropped."""
    import csv

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    with open(run / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    drop = lambda record: {k: v for k, v in record.items() if k not in WALL_CLOCK_KEYS}  # noqa: E731
    return (run / "model" / "model.safetensors").read_bytes(), [drop(r) for r in records], [drop(r) for r in rows]


def where_killed(run: Path) -> str:
    """Which stage the kill interrupted, read from the files it left."""
    folder = run / "checkpoints"
    pointer = folder / "latest"
    latest = pointer.read_text().strip() if pointer.is_file() else None
    steps = sorted(p.name for p in folder.glob("step-*")) if folder.is_dir() else []
    metrics = run / "metrics.jsonl"
    if list(run.glob(".model.*")):
        return "final model write"
    if folder.is_dir() and list(folder.glob(".step-*.tmp-*")):
        return "save: temporary checkpoint"
    if latest is None:
        return "before the first checkpoint"
    if steps and steps[-1] > latest:
        return "save: renamed, pointer not moved"
    if len(steps) > 1:
        return "save: pointer moved, older not pruned"
    if metrics.is_file() and metrics.read_text() and not metrics.read_text().endswith("\n"):
        return "half a metrics line"
    if (run / "model").is_dir():
        return "after the final model"
    if metrics.is_file() and '"final": true' in metrics.read_text():
        return "final: validation logged, model not written"
    return "training step / evaluation / plot"


def leftovers(run: Path) -> list[str]:
    names = [p.relative_to(run).as_posix() for p in run.rglob("*")]
    return [n for n in names if ".tmp-" in n or ".old-" in n or "/.tmp" in n]


def reference_run(folder: Path, config: Path) -> tuple[tuple[bytes, list[dict]], float]:
    """The uninterrupted run and how long it takes from its folder to its summary."""
    run = folder / "reference"
    process = start(config, run)
    while not (run / "run.json").is_file() and process.poll() is None:
        time.sleep(0.002)
    began = time.perf_counter()
    while not (run / "summary.json").is_file() and process.poll() is None:
        time.sleep(0.002)
    duration = time.perf_counter() - began
    _, error = process.communicate()
    if process.returncode:
        raise RuntimeError(f"the reference run failed: {error.decode()[-2000:]}")
    return comparable(run), duration


def trial(index: int, folder: Path, config: Path, expected, duration: float, seed: int) -> dict:
    generator = random.Random(seed * 1_000_003 + index)
    for attempt in range(20):
        run = folder / f"trial-{index:03d}-{attempt}"
        process = start(config, run)
        while not (run / "run.json").is_file() and process.poll() is None:
            time.sleep(0.002)
        delay = generator.uniform(0.0, duration)
        time.sleep(delay)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()
        if process.returncode != -signal.SIGKILL or (run / "summary.json").is_file():
            shutil.rmtree(run, ignore_errors=True)  # the run had ended before the kill: draw again
            continue
        stage = where_killed(run)
        resumed = start(config, run, "--resume")
        _, error = resumed.communicate()
        result = {"trial": index, "delay": round(delay, 4), "stage": stage, "attempts": attempt + 1}
        if resumed.returncode:
            return {**result, "identical": False, "why": f"resume failed: {error.decode()[-600:]}"}
        got = comparable(run)
        why = []
        if got[0] != expected[0]:
            why.append("final weights differ")
        if got[1] != expected[1]:
            why.append("metrics differ")
        if got[2] != expected[2]:
            why.append("metrics.csv differs")
        if leftovers(run):
            why.append(f"left behind: {leftovers(run)}")
        if not why:
            shutil.rmtree(run)  # keep only what failed, for a look
        return {**result, "identical": not why, "why": "; ".join(why)}
    return {"trial": index, "identical": False, "killed": False, "why": "never killed before the run ended"}


def kill_and_resume(trials: int = 100, folder=None, seed: int = 0, workers: int = 2) -> dict:
    folder = Path(folder or tempfile.mkdtemp(prefix="kill-resume-"))
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "tiny.toml"
    config.write_text(TINY)
    expected, duration = reference_run(folder, config)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda i: trial(i, folder, config, expected, duration, seed), range(trials)))
    stages: dict[str, int] = {}
    for r in results:
        if r.get("stage"):
            stages[r["stage"]] = stages.get(r["stage"], 0) + 1
    return {
        "trials": trials,
        "killed": sum(1 for r in results if r.get("killed", True)),
        "identical": sum(1 for r in results if r["identical"]),
        "redrawn": sum(r.get("attempts", 1) - 1 for r in results),  # runs that ended before their kill
        "run_seconds_after_folder": round(duration, 3),
        "stages": dict(sorted(stages.items(), key=lambda kv: -kv[1])),
        "failures": [r for r in results if not r["identical"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="trials run side by side (default 2)")
    parser.add_argument("--out", help="folder for the runs (default: a new temporary folder)")
    args = parser.parse_args()
    if args.trials < 1 or args.workers < 1:
        parser.error("--trials and --workers must be >= 1")
    started = time.perf_counter()
    result = kill_and_resume(args.trials, args.out, args.seed, args.workers)
    print(json.dumps({**result, "seconds": round(time.perf_counter() - started, 1)}, indent=1))
    print(f"{result['identical']} of {result['trials']} resumed identically ({result['killed']} killed)")


if __name__ == "__main__":
    main()
