"""A finer search of the μP base point before the neighbourhood check.

The neighbourhood check (``python -m probformer.mup neighbourhood``) ranked the base point of
configs/mup-base.toml 5th of 60: its learning rate came from a ×2 grid, and its information
weights were the reference's, never tuned. This script tunes all 7 hyper-parameters (lr
and the six information weights) by coordinate search with the neighbourhood check's own
budget and loss: for each step factor in ``--steps`` (×√2, then ×2^¼), one pass over the 7
coordinates, each tried at ``value × step`` and ``value / step`` and moved to the better
of the two when it lowers the validation loss. Training is deterministic (the config's
seed), so a loss is a function of the point.

    .venv/bin/python benchmarks/mup_base_search.py                 # ~30 runs of ~25 s, 1 thread
    .venv/bin/python -m probformer.mup neighbourhood --config configs/mup-base-tuned.toml --seed 1

The found point goes by hand into configs/mup-base-tuned.toml (printed at the end). The
neighbourhood check of the tuned point then draws *fresh* perturbations (``--seed 1``): the
search never saw them, so its rank there is not the search's own optimism.
Results: docs/benchmarks/mup_base_search.json (rewritten after every run; resumable).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

from probformer.mup.coord_check import progress_bar  # noqa: E402
from probformer.mup.neighbourhood import base_point, with_point  # noqa: E402
from probformer.training import run_config  # noqa: E402
from probformer.training.trainer import train  # noqa: E402

OUT = Path("docs/benchmarks/mup_base_search.json")


def key(point: dict[str, float]) -> str:
    return json.dumps({k: round(v, 10) for k, v in point.items()}, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/mup-base.toml")
    parser.add_argument("--steps", default="1.41421356,1.18920712", help="comma-separated step factors > 1")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    steps = [float(s) for s in args.steps.split(",")]
    if any(s <= 1 for s in steps):
        raise SystemExit(f"--steps must all be > 1, got {steps}")
    torch.set_num_threads(1)
    config = run_config.load(args.config)
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.is_file() else {"config": args.config, "runs": {}}
    losses: dict[str, float] = {k: v["valid_loss"] for k, v in record["runs"].items()}
    # at most one base run and two trials per hyper-parameter and step factor (the saved ones are skipped)
    bar = progress_bar(1 + 2 * 7 * len(steps), "μP base search, runs (at most)")

    def loss(point: dict[str, float]) -> float:
        bar.update(1)
        if key(point) not in losses:
            with tempfile.TemporaryDirectory() as scratch:
                summary = train(with_point(config, point), Path(scratch) / "run", progress=False)
            losses[key(point)] = summary["valid"]["loss"]
            record["runs"][key(point)] = {"point": point, "valid_loss": losses[key(point)]}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=1))
            bar.write(f"{losses[key(point)]:.5f} {point}")
        return losses[key(point)]

    point = base_point(config)
    best = loss(point)
    record["base"] = {"point": dict(point), "valid_loss": best}
    for step in steps:
        for name in list(point):
            trials = [dict(point, **{name: point[name] * factor}) for factor in (step, 1 / step)]
            scored = min(((loss(t), t) for t in trials), key=lambda pair: pair[0])
            if scored[0] < best:
                best, point = scored
    bar.close()
    record["tuned"] = {"point": point, "valid_loss": best, "improvement": 1 - best / record["base"]["valid_loss"]}
    out.write_text(json.dumps(record, indent=1))
    weights = ", ".join(f"{k} = {v:.6g}" for k, v in point.items() if k != "lr")
    print(f"tuned: loss {best:.5f} (base {record['base']['valid_loss']:.5f})")
    print(f"lr = {point['lr']:.6g}\nweights = {{ {weights} }}")


if __name__ == "__main__":
    main()
