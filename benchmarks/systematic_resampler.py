"""The in-filter systematic resampler alone, against its version at another commit, in one
process (interleaved rounds, so that a shared machine's load hits both alike).

    .venv/bin/python -m benchmarks.systematic_resampler --baseline HEAD~1 [--rounds 15]

Times ``SystematicResampler`` as the SMC engine calls it (float32 weights whose largest is 1,
their row sums given) at ``[B, N]`` = ``--shape`` (default 64,1000), one thread; prints the
best microseconds per call of each version and their ratio. The baseline is the file
``inference/smc/resamplers.py`` read from git at ``--baseline`` (it must define the same
``SystematicResampler`` interface).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from inference.smc.resamplers import SystematicResampler


def baseline_class(revision: str):
    """``SystematicResampler`` of ``inference/smc/resamplers.py`` at git ``revision``."""
    source = subprocess.run(
        ["git", "show", f"{revision}:inference/smc/resamplers.py"], check=True, capture_output=True, text=True
    ).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "baseline_resamplers.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("baseline_resamplers", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.SystematicResampler


def best_microseconds(resampler, weights, total, calls: int) -> float:
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(calls):
        resampler(weights, total, None, generator)
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision of the version to compare with")
    parser.add_argument("--shape", default="64,1000", help="B,N")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    B, N = (int(x) for x in args.shape.split(","))
    weights = torch.rand(B, N, generator=torch.Generator().manual_seed(0))
    weights = weights / weights.amax(-1, keepdim=True)
    total = weights.sum(-1)
    versions = {
        "current": SystematicResampler(B, N, None, torch.float32, row_sums=True),
        args.baseline: baseline_class(args.baseline)(B, N, None, torch.float32, row_sums=True),
    }
    best = dict.fromkeys(versions, float("inf"))
    for resampler in versions.values():  # warm-up
        best_microseconds(resampler, weights, total, 50)
    for _ in range(args.rounds):
        for name, resampler in versions.items():
            best[name] = min(best[name], best_microseconds(resampler, weights, total, args.calls))
    for name, value in best.items():
        print(f"{name}: {value:.1f} us per call at [{B}, {N}]")
    print(f"current / {args.baseline}: {best['current'] / best[args.baseline]:.2f}")


if __name__ == "__main__":
    main()
