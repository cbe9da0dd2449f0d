"""SMC engine benchmark (issue: SMC engine and the Particle Transformer).

    .venv/bin/python benchmarks/smc.py [--threads 1] [--rounds 3] [--out docs/benchmarks/smc.json]

Particle-steps per second of ``inference.SMC`` against ``pyro.infer.SMCFilter`` on the
same 1-D linear-Gaussian state-space model: N = 1,000 particles, 50 steps, 64
independent filters (Pyro runs them one after another; ours as one batch); bootstrap
proposal, systematic resampling at ESS / N < 1/2 in both. Each engine's figure is the
best of ``--rounds`` runs, the rounds interleaved (SMCFilter, then each of ours, then
again) so that a change in the machine's load reaches every engine alike; the ratio is
taken in the same process. Also the model's steps alone (the floor a filter of this model
cannot go below), and the eager vs torch.compile time of one filter step.
torch.set_num_threads(--threads) for every engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402

from inference import SMC  # noqa: E402

A, Q, R, STEPS, N, FILTERS = 0.9, 0.5, 0.3, 50, 1000, 64


class Model:
    def init(self, state):
        state["x"] = pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y=None):
        state["x"] = pyro.sample("x", dist.Normal(A * state["x"], Q**0.5))
        pyro.sample("y", dist.Normal(state["x"], R**0.5), obs=y)


class Guide:
    def init(self, state):
        pyro.sample("x_init", dist.Normal(0.0, 1.0))

    def step(self, state, y=None):
        pyro.sample("x", dist.Normal(A * state["x"], Q**0.5))


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, ys = torch.zeros(FILTERS), []
    for _ in range(STEPS):
        x = A * x + Q**0.5 * torch.randn(FILTERS, generator=g)
        ys.append(x + R**0.5 * torch.randn(FILTERS, generator=g))
    return torch.stack(ys, 1)  # [filters, steps]


def run_pyro(ys):
    for f in range(FILTERS):
        smc = pyro.infer.SMCFilter(Model(), Guide(), num_particles=N, max_plate_nesting=0)
        smc.init()
        for t in range(STEPS):
            smc.step(ys[f, t])


def callables(ys, g):
    """The model as tensor callables: x_t = A x_{t-1} + sqrt(Q) noise, log N(y_t; x_t, R) up
    to its constant, as SMCFilter's Pyro model (whose Normal log-density adds the constant:
    it shifts every log-weight alike, so filtering and resampling are the same). Written
    as careful tensor code: the noise scaled and the transition added in place, the
    constants of the log-density folded into one multiplication."""

    def init(B):
        return torch.randn(B, N, generator=g)

    def step(t, x):
        x = torch.randn(x.shape, generator=g).mul_(Q**0.5).add_(x, alpha=A)
        return x, (ys[:, t, None] - x).square_().mul_(-0.5 / R)

    return init, step


def model_steps(ys, g):
    """The tensor callables' init and steps with nothing of a filter: no weights, no resampling."""
    init, step = callables(ys, g)
    x = init(FILTERS)
    for t in range(STEPS):
        x, _ = step(t, x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/smc.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # SMCFilter runs in float64: in float32 its systematic resampler can index past N
    # (cumulative weights rounding below the last position). Ours runs in both.
    ys64 = data().double()
    ys32 = ys64.float()
    g = torch.Generator().manual_seed(0)
    runs = (
        ("pyro.infer.SMCFilter, float64 (64 filters, one after another)", torch.float64, lambda: run_pyro(ys64)),
        (
            "inference.SMC, Pyro model object, float64 (batched)",
            torch.float64,
            lambda: SMC(N, generator=g).filter(Model(), ys64, batch_size=FILTERS),
        ),
        (
            "inference.SMC, tensor callables, float64 (batched)",
            torch.float64,
            lambda: SMC(N, generator=g).filter(*callables(ys64, g), num_steps=STEPS, batch_size=FILTERS),
        ),
        (
            "inference.SMC, tensor callables, float32 (batched)",
            torch.float32,
            lambda: SMC(N, generator=g).filter(*callables(ys32, g), num_steps=STEPS, batch_size=FILTERS),
        ),
        (
            # SMCFilter keeps no ancestry either
            "inference.SMC, tensor callables, float32, record_ancestors=False (batched)",
            torch.float32,
            lambda: SMC(N, generator=g, record_ancestors=False).filter(
                *callables(ys32, g), num_steps=STEPS, batch_size=FILTERS
            ),
        ),
        (
            # not a filter: the floor that the model's own work sets (its draws and log-densities)
            "the float32 model's steps alone, no filtering (batched)",
            torch.float32,
            lambda: model_steps(ys32, g),
        ),
    )
    # wall-clock seconds, and the process's CPU seconds beside them: on a shared machine the
    # wall clock also counts the time other processes held the cores
    timings = {name: math.inf for name, _, _ in runs}
    cpu_timings = dict(timings)
    for _name, dtype, fn in runs:  # warm-up
        torch.set_default_dtype(dtype)
        fn()
    for _ in range(args.rounds):
        for name, dtype, fn in runs:
            torch.set_default_dtype(dtype)
            start, cpu_start = time.perf_counter(), time.process_time()
            fn()
            timings[name] = min(timings[name], time.perf_counter() - start)
            cpu_timings[name] = min(cpu_timings[name], time.process_time() - cpu_start)
    baseline, cpu_baseline = timings[runs[0][0]], cpu_timings[runs[0][0]]
    print(f"{args.threads} thread(s), best of {args.rounds} interleaved rounds")
    print("| engine | seconds | particle-steps/s | speed-up vs SMCFilter | CPU seconds | speed-up in CPU time |")
    print("|---|---|---|---|---|---|")
    for name, seconds in timings.items():
        cpu = cpu_timings[name]
        print(
            f"| {name} | {seconds:.3f} | {FILTERS * N * STEPS / seconds:.3g} | {baseline / seconds:.0f}x "
            f"| {cpu:.3f} | {cpu_baseline / cpu:.0f}x |"
        )

    # eager vs compiled filter step (the bootstrap step on [64, 1000] particles)
    torch.set_default_dtype(torch.float32)
    ys = ys32
    x = torch.randn(FILTERS, N)

    def one_step(x, y):
        x = torch.randn_like(x).mul_(Q**0.5).add_(x, alpha=A)
        return x, (y[:, None] - x).square_().mul_(-0.5 / R)

    compiled = torch.compile(one_step)
    compiled(x, ys[:, 0])
    step_times = {}
    for name, fn in (("eager", one_step), ("compiled", compiled)):
        best = math.inf
        for _ in range(20):
            start = time.perf_counter()
            fn(x, ys[:, 0])
            best = min(best, time.perf_counter() - start)
        step_times[name] = best
    print(
        f"\nfilter step [64 x 1000]: eager {step_times['eager'] * 1e6:.0f} us, compiled "
        f"{step_times['compiled'] * 1e6:.0f} us"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        record = {"threads": args.threads, "rounds": args.rounds, "timings": timings, "cpu_timings": cpu_timings}
        json.dump({**record, "step": step_times}, f, indent=1)


if __name__ == "__main__":
    main()
