"""ATen operator calls per step of ``inference.SMC.filter``: the CPU-countable proxy for the
filter's rate on a GPU, where a step of a small model is bound by operator launches, not
arithmetic.

    .venv/bin/python -m benchmarks.smc_ops [--tiny] [--rounds 3] [--json PATH]

The model and sizes are the GPU check's (``benchmarks/gpu_check_stages.py``,
``smc_against_smcfilter``): a 1-D linear-Gaussian model as float32 tensor callables, 64
filters x 1,000 particles x 50 steps, systematic resampling at ESS / N < 1/2; run on the
CPU with one thread, with ``record_ancestors`` True and False.

Counted with a ``torch.utils._python_dispatch.TorchDispatchMode``: every operator that
reaches the dispatcher below autograd from Python-level code, once (the operators a kernel
calls inside itself are not seen, as a profiler would list them). The calls made inside the
model's ``init`` and ``step`` are the user's; the rest are the filter's own. Each call is a
view (no kernel: ``slice``, ``detach``, ...), an allocation (``empty``) or a compute
operator (a kernel launch on a GPU). Per step: the difference between runs of T and 2T
steps, divided by T (the counts are deterministic: the filter takes no branch on data); per
run: what is left, the filter's setup and its reading of the records after the last step.

``--rounds``: also the CPU seconds per step without the counting mode (best of that many
runs; 0: no timing). On a shared machine they are rough; the counts are exact.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu_check_stages import TINY, Sizes
from inference import SMC

A, Q, R = 0.9, 0.5, 0.3  # the GPU check's model: x_t = A x_{t-1} + N(0, Q), y_t = x_t + N(0, R)
ALLOCATIONS = ("aten.empty.memory_format", "aten.empty_strided.default")


class OperatorCount(TorchDispatchMode):
    """Counts each operator call, by who made it (``user``: inside the model's callables) and kind."""

    def __init__(self):
        super().__init__()
        self.in_user_code = False
        self.calls = collections.Counter()  # (who, kind, operator name) -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        who = "user" if self.in_user_code else "filter"
        name = str(func)
        kind = "view" if func.is_view else "allocation" if name in ALLOCATIONS else "compute"
        self.calls[who, kind, name] += 1
        return func(*args, **(kwargs or {}))

    def total(self, who: str, kind: str | None = None) -> int:
        return sum(n for (w, k, _), n in self.calls.items() if w == who and kind in (None, k))


def gpu_check_model(sizes: Sizes, num_steps: int, generator: torch.Generator, count: OperatorCount | None = None):
    """``(init, step)`` of the GPU check's model on the CPU in float32, observing ``num_steps``
    steps; with ``count``, the calls they make are marked as the user's."""
    ys = torch.randn(sizes.smc_filters, num_steps, generator=generator)

    def user(function):
        if count is None:
            return function

        def marked(*args):
            count.in_user_code = True
            try:
                return function(*args)
            finally:
                count.in_user_code = False

        return marked

    @user
    def step(t, x):
        x = A * x + Q**0.5 * torch.randn(x.shape, generator=generator)
        return x, -0.5 / R * (ys[:, t, None] - x) ** 2

    @user
    def init(batch):
        return torch.randn(batch, sizes.smc_particles, generator=generator)

    return init, step


def count_run(sizes: Sizes, num_steps: int, record_ancestors: bool) -> OperatorCount:
    generator = torch.Generator().manual_seed(0)
    count = OperatorCount()
    init, step = gpu_check_model(sizes, num_steps, generator, count)
    smc = SMC(sizes.smc_particles, generator=generator, record_ancestors=record_ancestors)
    with count:
        smc.filter(init, step, num_steps=num_steps, batch_size=sizes.smc_filters)
    return count


def operator_counts(sizes: Sizes, record_ancestors: bool) -> dict:
    """Per step (user's, filter's by kind, total), the filter's per run, and its per-step operators by name."""
    T = sizes.smc_steps
    short, long = count_run(sizes, T, record_ancestors), count_run(sizes, 2 * T, record_ancestors)

    def per_step(who, kind=None):
        return (long.total(who, kind) - short.total(who, kind)) / T

    row = {"record_ancestors": record_ancestors, "user": per_step("user")}
    row.update({f"filter_{kind}": per_step("filter", kind) for kind in ("compute", "view", "allocation")})
    row["filter"] = per_step("filter")
    row["total"] = row["user"] + row["filter"]
    row["filter_per_run"] = short.total("filter") - T * row["filter"]
    row["filter_operators"] = {
        name: (long.calls[key] - short.calls[key]) / T
        for key in sorted(long.calls, key=lambda k: -long.calls[k])
        if key[0] == "filter" and long.calls[key] > short.calls[key]
        for name in [f"{key[2]} ({key[1]})"]
    }
    return row


def seconds_per_step(sizes: Sizes, record_ancestors: bool, rounds: int) -> float:
    """The best of ``rounds`` runs' CPU seconds (this thread) per step."""
    best = float("inf")
    for _ in range(rounds):
        generator = torch.Generator().manual_seed(0)
        init, step = gpu_check_model(sizes, sizes.smc_steps, generator)
        smc = SMC(sizes.smc_particles, generator=generator, record_ancestors=record_ancestors)
        start = time.thread_time()
        smc.filter(init, step, num_steps=sizes.smc_steps, batch_size=sizes.smc_filters)
        best = min(best, (time.thread_time() - start) / sizes.smc_steps)
    return best


def table(rows: list[dict]) -> str:
    columns = ("record_ancestors", "user", "filter_compute", "filter_view", "filter_allocation", "filter", "total")
    lines = [
        "| " + " | ".join(columns) + " | filter per run | CPU ms per step |",
        "|" + "---|" * (len(columns) + 2),
    ]
    for row in rows:
        cells = [f"{row[c]:g}" if not isinstance(row[c], bool) else str(row[c]) for c in columns]
        seconds = row.get("cpu_seconds_per_step")
        cells += [f"{row['filter_per_run']:g}", "-" if seconds is None else f"{seconds * 1e3:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the GPU check's dry-run sizes (a test's run)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per variant (0: no timing)")
    parser.add_argument("--json", help="write the counts and timings here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = TINY if args.tiny else Sizes()
    rows = []
    for record_ancestors in (True, False):
        row = operator_counts(sizes, record_ancestors)
        if args.rounds > 0:
            row["cpu_seconds_per_step"] = seconds_per_step(sizes, record_ancestors, args.rounds)
        rows.append(row)
    report = {
        "sizes": {"filters": sizes.smc_filters, "particles": sizes.smc_particles, "steps": sizes.smc_steps},
        "dtype": "float32",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
    }
    print(f"aten calls per step, B={sizes.smc_filters} N={sizes.smc_particles} T={sizes.smc_steps}, CPU float32:")
    print(table(rows))
    print("the filter's own calls per step, by operator (record_ancestors=True):")
    for name, calls in rows[0]["filter_operators"].items():
        print(f"  {calls:g}  {name}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
    return report


if __name__ == "__main__":
    main()
