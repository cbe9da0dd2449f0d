"""Learning-rate transfer: sweep the learning rate on a x2 grid at several widths, under
μP and under the standard parametrisation, on PTB MLM with a small fixed budget
(configs/mup-base.toml: 80 steps of 32 sentences). μP's promise: the best learning
rate does not move with width (within one grid step of the smallest width's best).

    .venv/bin/python benchmarks/mup_transfer.py [--widths 16,32,64,128] [--lrs 7] [--steps 80]

Writes docs/benchmarks/mup_transfer.json and prints the table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from probformer import mup
from probformer.mup.coord_check import progress_bar
from probformer.training import run_config
from probformer.training.trainer import train


def sweep(base: run_config.RunConfig, widths, lrs, use_mup: bool, scratch: Path, bar) -> dict:
    results = {}
    for width in widths:
        model = base.model_config(vocab_size=8)
        model = mup.widen(dataclasses.replace(model, mup=use_mup), width)
        keys = {k: v for k, v in dataclasses.asdict(model).items() if k not in ("vocab_size", "task", "num_classes")}
        for lr in lrs:
            config = dataclasses.replace(
                base, model={"kind": base.kind, **keys}, train=dataclasses.replace(base.train, lr=lr)
            )
            started = time.perf_counter()
            summary = train(config, scratch / f"{use_mup}-{width}-{lr}", progress=False)
            loss = summary["valid"]["loss"]
            results.setdefault(width, {})[lr] = loss
            bar.write(
                f"{'mup' if use_mup else 'standard':8s} d={width:4d} lr={lr:.2e} valid loss {loss:.4f} "
                f"({time.perf_counter() - started:.0f} s, {summary['parameters'] / 1e6:.2f}M params)"
            )
            bar.update((width / widths[0]) ** 2)  # a run's cost grows about as width squared
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/mup-base.toml")
    parser.add_argument("--widths", default="16,32,64,128")
    parser.add_argument("--lrs", type=int, default=7, help="grid size (x2 steps)")
    parser.add_argument("--centre", type=float, default=1.6e-2, help="the grid's middle learning rate")
    parser.add_argument("--steps", type=int, default=0, help="override train.steps")
    parser.add_argument("--out", default="docs/benchmarks/mup_transfer.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = run_config.load(args.config)
    if args.steps:
        base = dataclasses.replace(base, train=dataclasses.replace(base.train, steps=args.steps))
    widths = [int(w) for w in args.widths.split(",")]
    centre = args.centre
    lrs = [centre * 2.0 ** (k - args.lrs // 2) for k in range(args.lrs)]
    report = {"config": args.config, "steps": base.train.steps, "widths": widths, "lrs": lrs}
    total = 2 * len(lrs) * sum((w / widths[0]) ** 2 for w in widths)
    bar = progress_bar(total, f"μP transfer, {2 * len(lrs) * len(widths)} runs")
    with tempfile.TemporaryDirectory() as scratch, bar:
        for name, use_mup in (("mup", True), ("standard", False)):
            losses = sweep(base, widths, lrs, use_mup, Path(scratch), bar)
            best = {w: min(losses[w], key=losses[w].get) for w in widths}
            shift = {w: round(math.log2(best[w] / best[widths[0]])) for w in widths}
            report[name] = {"losses": losses, "best_lr": best, "grid_steps_from_smallest": shift}
    report["mup_transfers"] = all(abs(s) <= 1 for s in report["mup"]["grid_steps_from_smallest"].values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("\n| parametrisation | " + " | ".join(f"d={w}" for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for name in ("mup", "standard"):
        cells = []
        for w in widths:
            best = report[name]["best_lr"][w]
            cells.append(f"{best:.1e} ({report[name]['losses'][w][best]:.3f})")
        print(f"| {name} best lr (loss) | " + " | ".join(cells) + " |")
    print(f"\nμP best learning rate within one x2 step of d={widths[0]}'s at every width: {report['mup_transfers']}")


if __name__ == "__main__":
    main()
