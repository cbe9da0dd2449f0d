"""The SMC filter eager against torch.compile'd, the GPU check's model and sizes, in one process.

    python3 -m benchmarks.smc_compiled --device cuda                       # on the GPU machine
    python3 -m benchmarks.smc_compiled --device cpu --tiny --backend aot_eager   # the dry run (make test)

On a GPU the eager filter is launch-bound: a few dozen small kernels per step (docs/benchmarks.md,
"SMC: aten calls per filter step"). Compiled, a run of ``--steps`` steps is traced
as one graph (the model draws from torch's global generator: a ``torch.Generator`` argument
would break Dynamo's graph at every draw, and each step's frame would then be compiled apart,
the step number differing), so inductor fuses the elementwise passes of all ``--steps`` steps,
and ``reduce-overhead`` replays them as one CUDA graph. The compile grows with the steps (the
loop is unrolled). The graphs a variant compiled are counted.
Compiled runs draw other random numbers than eager ones, so each variant is checked against
the Kalman filter's exact log evidence of the same observations: the mean error over the
filters and its standard error.

Variants: ``eager``, ``compiled`` (``--backend``, default mode) and, on CUDA,
``reduce-overhead``. One JSON line per variant goes to ``--out``, with the compile seconds
(the first call) and the particle-steps per second after it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.getcwd())  # the tree it is run in, not an installed copy
import torch  # noqa: E402

from benchmarks import gpu_check_stages as stages  # noqa: E402


def kalman_log_evidence(ys: torch.Tensor, a: float, q: float, r: float) -> torch.Tensor:
    """``[F]`` exact log p(y_1..T) of each series under x_0 ~ N(0, 1), x_t = a x_(t-1) + N(0, q),
    y_t = x_t + N(0, r), plus ``T/2 log(2 pi r)``: the filter's weights leave out the
    observation density's constant."""
    ys = ys.double().cpu()
    mean, variance = torch.zeros(ys.shape[0], dtype=torch.float64), torch.ones(ys.shape[0], dtype=torch.float64)
    total = torch.zeros_like(mean)
    for t in range(ys.shape[1]):
        mean, variance = a * mean, a * a * variance + q
        spread = variance + r
        total -= 0.5 * (torch.log(2 * math.pi * spread) + (ys[:, t] - mean) ** 2 / spread)
        gain = variance / spread
        mean, variance = mean + gain * (ys[:, t] - mean), (1 - gain) * variance
    return total + 0.5 * ys.shape[1] * math.log(2 * math.pi * r)


def measure(name: str, run, exact: torch.Tensor, device: torch.device, sizes: stages.Sizes) -> dict:
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    run()  # the first call compiles
    stages.synchronise(device)
    first = time.perf_counter() - started
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    seconds = stages.timed(run, device, sizes)
    errors = (run().double().cpu() - exact).tolist()
    particle_steps = sizes.smc_filters * sizes.smc_particles * sizes.smc_steps
    return {
        "variant": name,
        "first_call_s": round(first, 3),
        "graphs": graphs,
        "run_s": seconds,
        "particle_steps_per_s": particle_steps / seconds,
        "log_evidence_error_mean": statistics.mean(errors),
        "log_evidence_error_se": statistics.stdev(errors) / math.sqrt(len(errors)) if len(errors) > 1 else None,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the GPU check's)")
    parser.add_argument("--filters", type=int, default=None, help="filters per run (default: the GPU check's)")
    parser.add_argument("--particles", type=int, default=None, help="particles per filter (default: the GPU check's)")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run's sizes")
    parser.add_argument("--out", default="smc_compiled.jsonl")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    sizes = stages.TINY if args.tiny else stages.Sizes()
    for name, field in (("steps", "smc_steps"), ("filters", "smc_filters"), ("particles", "smc_particles")):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                parser.error(f"--{name} must be at least 1, got {value}")
            sizes = replace(sizes, **{field: value})
    torch.manual_seed(0)
    # torch's global generator: a torch.Generator argument breaks Dynamo's graph at every draw;
    # validate=False: no host read after the last step either
    filter_once, ys = stages.smc_run(device, sizes, None, validate=False)

    def run():
        return filter_once().log_evidence

    exact = kalman_log_evidence(ys, *stages.SMC_MODEL)
    modes = {"eager": None, "compiled": "default"} | (
        {"reduce-overhead": "reduce-overhead"} if device.type == "cuda" else {}
    )
    lines = []
    for name, mode in modes.items():
        # each variant compiles from a clean Dynamo: what an earlier compile in this process
        # left (sizes it saw change, now dynamic) would make this one another experiment
        torch._dynamo.reset()
        variant = run if mode is None else torch.compile(run, backend=args.backend, mode=mode)
        try:
            line = measure(name, variant, exact, device, sizes)
        except Exception as error:  # a variant that fails is recorded; the others still run
            line = {"variant": name, "error": f"{type(error).__name__}: {error}"[:300]}
        line.update(device=str(device), backend=args.backend, filters=sizes.smc_filters,
                    particles=sizes.smc_particles, steps=sizes.smc_steps, threads=torch.get_num_threads())  # fmt: skip
        stages.write_line(line, args.out)
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
