"""What the per-forward parameter check costs a training step.

Every model's forward refuses a parameter that holds NaN or an infinity
(``graphs.device_checks.refuse_non_finite_parameters``: one fused max-norm pass over the
parameters, no host read). This times one training step (forward, loss, backward) of each
model kind at its small config, with the check and with it replaced by a no-op, paired and
interleaved in one process on one thread:

    .venv/bin/python -m benchmarks.parameter_check --rounds 7

Results to docs/benchmarks/parameter_check.json; the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from probformer.training import run_config

CONFIGS = {
    "probabilistic_transformer": "configs/pt-small.toml",
    "transformer (BERT)": "configs/bert-small.toml",
    "universal_transformer": "configs/ut-small.toml",
    "particle_transformer": "configs/particle-small.toml",
    "swarmformer": "configs/variants/swarm-contiguous.toml",
    "folded_context": "configs/variants/folded-lm.toml",
}
MODEL_MODULES = [
    "probformer.models.probabilistic_transformer",
    "probformer.models.baselines",
    "probformer.models.particle_transformer",
    "probformer.models.swarmformer",
    "probformer.models.folded_context",
    "probformer.models.pt_layer",
]
VOCAB, BATCH, LENGTH = 10_000, 32, 48


@contextlib.contextmanager
def without_parameter_check():
    modules = [importlib.import_module(name) for name in MODEL_MODULES]
    saved = [module.refuse_non_finite_parameters for module in modules]
    for module in modules:
        module.refuse_non_finite_parameters = lambda model: None
    try:
        yield
    finally:
        for module, check in zip(modules, saved, strict=True):
            module.refuse_non_finite_parameters = check


def build(path: str) -> torch.nn.Module:
    from probformer.models import registry

    config = run_config.load(Path(path))
    torch.manual_seed(0)
    _, model_cls = registry.classes(config.kind)
    return model_cls(config.model_config(VOCAB, 0)).train()


def step_seconds(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> float:
    start = time.perf_counter()
    logits, _ = model(tokens, mask)
    F.cross_entropy(logits.float().transpose(1, 2), tokens).backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def check_seconds(model: torch.nn.Module) -> float:
    from graphs.device_checks import refuse_non_finite_parameters

    start = time.perf_counter()
    refuse_non_finite_parameters(model)
    return time.perf_counter() - start


def measure(name: str, path: str, rounds: int) -> dict:
    model = build(path)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.bool)
    step_seconds(model, tokens, mask)  # warm up both paths
    with without_parameter_check():
        step_seconds(model, tokens, mask)
    checked, unchecked, ratios = [], [], []
    for _ in range(rounds):
        with_check = step_seconds(model, tokens, mask)
        with without_parameter_check():
            without = step_seconds(model, tokens, mask)
        checked.append(with_check)
        unchecked.append(without)
        ratios.append(with_check / without)
    check_alone = min(check_seconds(model) for _ in range(20))
    return {
        "model": name,
        "config": path,
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_with_check_s": min(checked),
        "step_without_check_s": min(unchecked),
        "median_ratio": statistics.median(ratios),
        "check_alone_s": check_alone,
        "check_share_of_step": check_alone / min(unchecked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/parameter_check.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(name, path, args.rounds) for name, path in CONFIGS.items()]
    command = f".venv/bin/python -m benchmarks.parameter_check --rounds {args.rounds}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "batch": [BATCH, LENGTH], "rows": rows}, indent=1))
    print("| model | parameters | step with check (s) | without (s) | median paired ratio | check alone (ms) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['model']} | {row['parameters'] / 1e6:.2f}M | {row['step_with_check_s']:.3f} | "
            f"{row['step_without_check_s']:.3f} | {row['median_ratio']:.3f} | {row['check_alone_s'] * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
