"""Where one PT iteration's time goes on a device: torch.profiler over a forward + backward.

    python3 -m benchmarks.gpu_profile --device cuda --n 512 --out profile.txt
    python3 -m benchmarks.gpu_profile --device cuda --n 8192 --batch 1 --topology "window(256)"

Builds the engine of ``benchmarks/gpu_check_stages.py`` (``pt_engine``, ``pt_step``) at the
GPU targets' reference sizes, warms it up, then profiles ``--rounds`` steps and writes the
operators sorted by device time and by host time, the number of kernel launches per step,
and the seconds per step with and without the profiler. ``--tiny`` runs the CPU dry-run sizes.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_check_stages import TINY, Sizes, pt_engine, pt_step, synchronise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--form", choices=["grouped", "shared"], default="grouped")
    parser.add_argument("--topology", default="full")
    parser.add_argument("--batch", type=int, default=None, help="sentences per step (default: the GPU targets')")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--threads", type=int, default=8, help="CPU threads (the GPU machine has 16 cores)")
    args = parser.parse_args()
    for name in ("n", "rounds", "rows", "threads", "batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = replace(TINY if args.tiny else Sizes(), lengths=(args.n,))
    if args.batch is not None:
        sizes = replace(sizes, batch=args.batch)
    engine = pt_engine(sizes, args.topology, args.form, device)
    run = pt_step(engine, args.n, sizes, device)
    for _ in range(2):
        run()
    synchronise(device)
    start = time.perf_counter()
    run()
    synchronise(device)
    plain_s = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.rounds):
            run()
        synchronise(device)
    averages = prof.key_averages()
    device_key = "self_device_time_total" if device.type == "cuda" else "cpu_time_total"
    launch_calls = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
    launches = sum(e.count for e in averages if e.key in launch_calls)
    lines = [f"n={args.n} form={args.form} topology={args.topology} device={device} sizes={sizes}",
             f"seconds per step without profiler: {plain_s:.4f}",
             f"kernel launches per step: {launches / args.rounds:.0f}",
             "== by device time ==", averages.table(sort_by=device_key, row_limit=args.rows, max_name_column_width=70),
             "== by host time (self) ==", averages.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                          max_name_column_width=70)]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
