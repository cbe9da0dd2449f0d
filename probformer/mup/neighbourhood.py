"""Random-search optimality check (the μP paper's local test): perturb each of the 7
hyper-parameters (learning rate and the six information weights) independently and
uniformly within +-``radius`` of the base point, train every sample with the same
budget, and report the base point's rank by final validation loss.

With ``n`` samples, "no sample beats the base" puts the base in the top ``p`` of its
neighbourhood with confidence 1 - alpha when (1 - p)^n <= alpha: n = 59 for p = alpha = 0.05.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path

import torch

import inference
from graphs.limits import is_real
from probformer.mup import base_width
from probformer.mup.coord_check import progress_bar
from probformer.training import run_config

__all__ = ["samples_needed", "base_point", "perturb", "run"]

WEIGHTS = [f.name for f in dataclasses.fields(inference.MessageWeights)]


def samples_needed(p: float = 0.05, alpha: float = 0.05) -> int:
    """The smallest n with (1 - p)^n <= alpha."""
    numbers_in_range = all(is_real(x) and 0 < x < 1 for x in (p, alpha))
    if not numbers_in_range:
        raise ValueError(f"p and alpha must be numbers in (0, 1), got {p!r}, {alpha!r}")
    # log1p: log(1 - p) rounds to 0 for p below 1e-16 (a division by zero)
    n = math.log(alpha) / math.log1p(-p)
    if not math.isfinite(n):  # p a subnormal float
        raise ValueError(f"p={p!r} is too small: more samples than a float can count (about 1.8e308) are needed")
    return math.ceil(n)


def base_point(config: run_config.RunConfig) -> dict[str, float]:
    """The 7 hyper-parameters of a PT run config: lr and the information weights (as
    numbers at the base width)."""
    if not isinstance(config, run_config.RunConfig):
        raise TypeError(f"config must be a RunConfig (run_config.load(path)), got {type(config).__name__}")
    if config.kind != "probabilistic_transformer":
        raise ValueError(f"the neighbourhood check tunes a probabilistic_transformer, got {config.kind!r}")
    model = config.model_config(vocab_size=8)
    weights = inference.MessageWeights.parse(model.weights, base_width(model) if model.mup else model.labels)
    return {"lr": config.train.lr, **dataclasses.asdict(weights)}


def perturb(point: dict[str, float], radius: float, generator: torch.Generator) -> dict[str, float]:
    draws = torch.rand(len(point), generator=generator, dtype=torch.float64)
    return {k: v * (1 + radius * (2 * float(u) - 1)) for (k, v), u in zip(point.items(), draws)}


def with_point(config: run_config.RunConfig, point: dict[str, float]) -> run_config.RunConfig:
    model = dict(config.model, weights={k: point[k] for k in WEIGHTS})
    return dataclasses.replace(config, model=model, train=dataclasses.replace(config.train, lr=point["lr"]))


def run(config_path, samples: int | None = None, radius: float = 0.5, seed: int = 0, out=None) -> dict:
    from probformer.training.trainer import train

    config = run_config.load(config_path)
    samples = samples_needed() if samples is None else samples
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if not 0 < radius < 1:
        raise ValueError(f"--radius must lie in (0, 1), got {radius}")
    base = base_point(config)
    generator = torch.Generator().manual_seed(seed)
    points = [base] + [perturb(base, radius, generator) for _ in range(samples)]
    results = []
    budget = f"{config.train.steps} steps" if config.train.steps else f"{config.train.epochs} epochs"
    bar = progress_bar(len(points), f"neighbourhood, {len(points)} runs of {budget}")
    with tempfile.TemporaryDirectory() as scratch, bar:
        for index, point in enumerate(points):
            summary = train(with_point(config, point), Path(scratch) / f"run-{index}", progress=False)
            results.append({"point": point, "valid_loss": summary["valid"]["loss"]})
            bar.write(f"{'base' if index == 0 else f'sample {index}'}: loss {results[-1]['valid_loss']:.4f}")
            bar.update(1)
    losses = [r["valid_loss"] for r in results]
    rank = 1 + sum(loss < losses[0] for loss in losses[1:])
    report = {
        "config": str(config_path),
        "samples": samples,
        "radius": radius,
        "base": results[0],
        "base_rank": rank,
        "of": len(points),
        "base_top_fraction": rank / len(points),
        "best": min(results, key=lambda r: r["valid_loss"]),
        "best_improvement": 1 - min(losses) / losses[0],
        "results": results,
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
    print(
        f"base point ranks {rank} of {len(points)} (top {100 * rank / len(points):.1f}%); best sample "
        f"improves the loss by {100 * report['best_improvement']:.2f}%"
    )
    return report
