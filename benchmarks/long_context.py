"""Long inputs: what each topology and long-context model costs as n grows.

    .venv/bin/python benchmarks/long_context.py --topologies [--n 2048] [--rounds 5]
    .venv/bin/python benchmarks/long_context.py --topologies --against REV [--pairs 3]
    .venv/bin/python benchmarks/long_context.py --table [--lengths 512,1024,...] [--rounds 3]

``--topologies``: the fused PT iteration (d = 16, C = 8, r = 64, gamma = 3 so K = 8 groups,
B = 1, T = 1, forward + backward) on full, causal, window(64) and segments(128), all built in
this process and timed interleaved, min over rounds; prints each topology's time over full's.
Its rank 64 above the 16 labels is computed at rank 16 (``projections.at_label_rank``).
``--against REV``: the same for git revision REV and this checkout, in alternating fresh
processes (``benchmarks/topologies_against.py``).

``--table``: for every length, each model's forward + backward time (min over rounds, in this
process) and peak memory (one fresh process per cell: peak RSS during a step above the RSS
after setup and a warm-up step), then the slope of log time and log memory against log n
over the lengths measured (PT full and causal, quadratic, only up to ``--quadratic-up-to``).
SwarmFormer: width 64, 4 heads, 2 layers, FFN 256, window 3, 16 clusters; FoldedContext:
width 64, 4 heads, 2 local + 2 global blocks, FFN 256, segments of 64. Models:
PT (d = 16, C = 8, r = 64, T = 1, fused kernel) on full, causal, window(64) and
segments(128); ``probformer.SwarmFormer``; ``probformer.FoldedContext``.

Everything runs on one torch thread (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

from probformer.training.placement import hold_freed_memory  # noqa: E402

PT_TOPOLOGIES = ("full", "causal", "window(64)", "segments(128)")
MODELS = tuple(f"pt:{t}" for t in PT_TOPOLOGIES) + ("swarmformer", "folded")


def build_pt(n: int, topology: str, d: int = 16, C: int = 8, r: int = 64, B: int = 1):
    """A PT iteration as a user builds it: ``graphs.CRF`` + ``inference.MeanField``."""
    import graphs
    import inference

    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=1000, labels=d, channels=C, rank=r, topology=topology, gamma=3)
    engine = inference.MeanField(crf, iterations=1, kernel="fused", weights="reference")
    tokens = torch.randint(0, 1000, (B, n))
    return lambda: engine(tokens).logits.square().mean().backward()


def build_swarmformer(n: int):
    import probformer

    torch.manual_seed(0)
    config = probformer.SwarmConfig(
        vocab_size=1000, width=64, heads=4, layers=2, ffn_width=256, window=3, clusters=16, max_length=n, dropout=0.0
    )
    model = probformer.SwarmFormer(config)
    tokens = torch.randint(0, 1000, (1, n))
    return lambda: model(tokens)[0].square().mean().backward()


def build_folded(n: int):
    import probformer

    torch.manual_seed(0)
    config = probformer.FoldedContextConfig(
        vocab_size=1000, width=64, heads=4, local_layers=2, global_layers=2, ffn_width=256, segment=64
    )
    model = probformer.FoldedContext(config)
    tokens = torch.randint(0, 1000, (1, n))
    return lambda: model(tokens)[0].square().mean().backward()


def build(model: str, n: int):
    if model.startswith("pt:"):
        return build_pt(n, model[3:])
    return {"swarmformer": build_swarmformer, "folded": build_folded}[model](n)


def time_interleaved(steps: dict, rounds: int) -> dict:
    best = {name: math.inf for name in steps}
    for step in steps.values():  # warm-up
        step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def topologies(n: int, rounds: int) -> dict:
    steps = {t: build_pt(n, t) for t in PT_TOPOLOGIES}
    best = time_interleaved(steps, rounds)
    ratios = {t: best[t] / best["full"] for t in PT_TOPOLOGIES}
    print(f"n = {n}, fused, forward + backward, 1 thread, min of {rounds}:")
    for t in PT_TOPOLOGIES:
        print(f"  {t:14s} {best[t]:8.4f} s   / full {ratios[t]:.3f}")
    return {"n": n, "rounds": rounds, "seconds": best, "over_full": ratios}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_peak(model: str, n: int) -> float:
    """In this process: MiB of peak RSS during the first forward + backward above the RSS
    after setup (the kernel's peak counter, VmHWM, is reset after setup). No warm-up step:
    memory it freed would stay in the process and hide the step's own peak."""
    step = build(model, n)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - base) / 1024


def peak_memory(model: str, n: int) -> float:
    code = (
        "import sys, torch; sys.path.insert(0, '.'); torch.set_num_threads(1);"
        f"from benchmarks.long_context import measure_peak; print(measure_peak({model!r}, {n}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return math.nan
    return float(out.stdout.strip().splitlines()[-1])


def slope(lengths, values) -> float:
    """Least-squares slope of log value against log n (NaN-free points only)."""
    points = [(math.log(n), math.log(v)) for n, v in zip(lengths, values) if v == v and v > 0]
    if len(points) < 2:
        return math.nan
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


QUADRATIC = ("pt:full", "pt:causal")


def table(lengths, models, rounds: int, memory: bool, quadratic_up_to: int, timing: bool = True) -> dict:
    """Every model at every length (the quadratic ones up to ``quadratic_up_to``: NaN past it)."""
    results = {m: {"seconds": [], "peak_mib": []} for m in models}
    for n in lengths:
        here = [m for m in models if m not in QUADRATIC or n <= quadratic_up_to]
        best = time_interleaved({m: build(m, n) for m in here}, rounds) if timing else {}
        for m in models:
            results[m]["seconds"].append(best.get(m, math.nan))
            results[m]["peak_mib"].append(peak_memory(m, n) if memory and m in here else math.nan)
            print(f"n = {n:6d} {m:18s} {results[m]['seconds'][-1]:9.4f} s  {results[m]['peak_mib'][-1]:9.1f} MiB")
            sys.stdout.flush()
    for m in models:
        results[m]["time_slope"] = slope(lengths, results[m]["seconds"])
        results[m]["memory_slope"] = slope(lengths, results[m]["peak_mib"])
    header = "| model | " + " | ".join(f"n = {n}" for n in lengths) + " | time slope | memory slope |"
    print(header)
    print("|---" * (len(lengths) + 3) + "|")
    for m in models:
        cells = " | ".join(f"{s:.3g} s, {p:.0f} MiB" for s, p in zip(results[m]["seconds"], results[m]["peak_mib"]))
        print(f"| {m} | {cells} | {results[m]['time_slope']:.2f} | {results[m]['memory_slope']:.2f} |")
    return {"lengths": list(lengths), "rounds": rounds, "models": results}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--topologies", action="store_true", help="fused PT: each topology's time over full's")
    parser.add_argument("--table", action="store_true", help="time and peak memory of every model as n grows")
    parser.add_argument("--n", type=int, default=2048, help="--topologies: the length")
    parser.add_argument("--against", metavar="REV", help="--topologies: also git revision REV, alternating processes")
    parser.add_argument("--pairs", type=int, default=3, help="--against: alternations of the two trees")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192,16384", help="--table: the lengths")
    parser.add_argument("--models", default=",".join(MODELS), help="--table: the models")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true", help="--table: time only")
    parser.add_argument("--memory-only", action="store_true", help="--table: peak memory only")
    parser.add_argument("--quadratic-up-to", type=int, default=8192, help="--table: PT full and causal up to this n")
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--default-malloc", action="store_true", help="time without hold_freed_memory (the trainer's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    held = not args.default_malloc and hold_freed_memory()  # in this process; memory peaks run in fresh ones
    if args.topologies and args.against:
        sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
        from benchmarks.topologies_against import against

        result = against(args.against, args.n, args.rounds, args.pairs, args.default_malloc)
    elif args.topologies:
        result = topologies(args.n, args.rounds)
    elif args.table:
        lengths = [int(x) for x in args.lengths.split(",")]
        models = args.models.split(",")
        result = table(lengths, models, args.rounds, not args.no_memory, args.quadratic_up_to, not args.memory_only)
    else:
        parser.error("give --topologies or --table")
    if args.out:
        with open(args.out, "w") as f:
            malloc = {"malloc": "held" if held else "default"}  # this process's: the timing
            if args.table and not args.no_memory:
                malloc["memory_malloc"] = "default (peak memory: a fresh process per cell)"
            json.dump({**result, **malloc}, f, indent=1)


if __name__ == "__main__":
    main()
