"""Mean-field engine benchmarks (issue: mean-field engine).

    .venv/bin/python benchmarks/mean_field.py [--quick] [--out docs/benchmarks/mean_field.json]
    .venv/bin/python benchmarks/mean_field.py --against REV [--rounds 6]
    .venv/bin/python benchmarks/mean_field.py --causal [--rounds 6] [--threads 1] [--tree DIR]
    .venv/bin/python benchmarks/mean_field.py --floor [--rounds 3] [--threads 1] [--tree DIR]

Measures, on this machine, with torch.set_num_threads(2):
  1. fused vs naive head kernel: forward+backward of T = 4 iterations, time (interleaved in
     one process, min over rounds) and peak RSS (one fresh process per measurement);
  2. one PT iteration vs one standard pre-LN transformer encoder layer (torch SDPA) of the
     same width and heads;
  3. MeanField vs Pyro SVI (mean-field guide, TraceEnum_ELBO) wall time to the same ELBO;
  4. achieved fraction of the machine's fp32 matmul throughput;
  5. eager vs torch.compile.
Prints markdown tables and writes the raw numbers as JSON.

``--floor`` times only the reference configuration (d = 256, C = 8,
r = 64, n = 512, B = 8, T = 4, gamma = 3, full topology, forward + backward): the fused
PT iteration and the standard layer x4 interleaved in one process (min over rounds), with
the fp32 matmul peak measured in the same run, before and after them; the fraction of the
peak counts the algorithmic FLOPs of ``flops_per_iteration``. ``--threads`` sets the thread
count of every mode (default 2; the subprocesses of ``--against`` too).

``--against REV`` times only the fused forward+backward (T = 4, d = 256, C = 8, r = 64)
of this checkout against the code of git revision REV (e.g. the commit before a
refactoring): REV is extracted with ``git archive`` to a temporary folder, and the two
trees run in alternating fresh processes (one tree's packages per process), each
reporting its minimum over a few steps; the figure is the ratio of the minima.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402

from probformer.training.placement import hold_freed_memory  # noqa: E402

THREADS = 2


def _set_threads(threads: int) -> None:
    """This process's torch threads, and those of the processes ``against`` starts."""
    global THREADS
    THREADS = threads
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def build(d, C, r, n, B, kernel, seed=0, topology="full"):
    import graphs
    import inference

    torch.manual_seed(seed)
    crf = graphs.CRF(vocab_size=1000, labels=d, channels=C, rank=r, topology=topology, gamma=3)
    engine = inference.MeanField(crf, iterations=4, kernel=kernel, weights="reference")
    tokens = torch.randint(0, 1000, (B, n))
    return engine, tokens


def build_reference(d, C, n, B, seed=0):
    """A pre-LN transformer encoder layer (SDPA inside), applied 4 times with tied weights."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d, C, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
    x = torch.randn(B, n, d)
    return layer, x


def step(kind, model, inputs):
    if kind == "reference":
        h = inputs
        for _ in range(4):
            h = model(h)
        h.square().mean().backward()
    else:
        model(inputs).logits.square().mean().backward()


def make(kind, d, C, r, n, B):
    if kind == "reference":
        return build_reference(d, C, n, B)
    return build(d, C, r, n, B, kind)


def time_interleaved(kinds, d, C, r, n, B, rounds):
    models = {k: make(k, d, C, r, n, B) for k in kinds}
    best = {k: math.inf for k in kinds}
    for k in kinds:  # warm-up
        step(k, *models[k])
    for _ in range(rounds):
        for k in kinds:
            start = time.perf_counter()
            step(k, *models[k])
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_peak(kind, d, C, r, n, B) -> float:
    """In this process: GiB of peak RSS during one forward+backward above the RSS after
    setup. The kernel's peak counter (VmHWM) is reset after setup (clear_refs = 5)."""
    model = make(kind, d, C, r, n, B)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    step(kind, *model)
    return (_status_kib("VmHWM") - base) / 2**20


def peak_memory(kind, d, C, r, n, B) -> float:
    """``measure_peak`` in a fresh process (so earlier allocations cannot hide the peak)."""
    code = (
        f"import sys, torch; sys.path.insert(0, '.'); torch.set_num_threads({THREADS});"
        f"from benchmarks.mean_field import measure_peak; print(measure_peak({kind!r}, {d}, {C}, {r}, {n}, {B}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return math.nan
    return float(out.stdout.strip().splitlines()[-1])


def flops_per_iteration(d, C, r, n, B, K=8):
    """Algorithmic forward FLOPs of one PT iteration: query/key projections and the two
    back-projections (8 B n d K C r) and three n x n contractions of width C r."""
    return 8 * B * n * d * K * C * r + 6 * B * C * n * n * r


def matmul_throughput() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e9


def svi_vs_mean_field():
    import pyro
    from pyro.infer import SVI, TraceEnum_ELBO
    from pyro.optim import Adam

    import graphs
    import inference

    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    crf = graphs.CRF(vocab_size=5, labels=2, channels=1, rank=2, global_labels=2, topology="full")
    with torch.no_grad():
        for p in crf.parameters():
            p.mul_(0.7)
    crf.requires_grad_(False)
    tokens = torch.tensor([[1, 2, 3], [4, 0, 2]])
    B, n = tokens.shape

    start = time.perf_counter()
    with torch.no_grad():
        target = inference.MeanField(crf, iterations=20, schedule="async")(tokens).elbo.sum().item()
    mean_field_time = time.perf_counter() - start
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        with torch.no_grad():
            inference.MeanField(crf, iterations=20, schedule="async")(tokens).elbo.sum().item()
    mean_field_time = (time.perf_counter() - start) / reps

    guide = inference.mean_field_guide(crf, tokens)

    elbo = TraceEnum_ELBO(max_plate_nesting=1)
    svi = SVI(crf.model, guide, Adam({"lr": 0.1}), elbo)
    start, steps, reached = time.perf_counter(), 0, None
    while steps < 3000:
        loss = svi.step(tokens)
        steps += 1
        if steps % 10 == 0 and -loss >= target - 1e-3:
            reached = time.perf_counter() - start
            break
    return {
        "target_elbo": target,
        "mean_field_seconds": mean_field_time,
        "svi_steps": steps,
        "svi_seconds": reached if reached is not None else math.nan,
    }


def compile_comparison(d=256, C=8, r=64, n=512, B=8):
    engine, tokens = build(d, C, r, n, B, "fused")
    compiled = torch.compile(lambda t: engine(t).logits)
    start = time.perf_counter()
    compiled(tokens).square().mean().backward()
    first = time.perf_counter() - start
    best = {"eager": math.inf, "compiled": math.inf}
    for _ in range(3):
        for name, fn in (("eager", lambda t: engine(t).logits), ("compiled", compiled)):
            start = time.perf_counter()
            fn(tokens).square().mean().backward()
            best[name] = min(best[name], time.perf_counter() - start)
    return {"first_call_seconds": first, **best}


def floor(rounds: int, d: int = 256, C: int = 8, r: int = 64, n: int = 512, B: int = 8) -> dict:
    """The fused iteration against the standard layer at the reference size, with the matmul
    peak measured in this run (the best of a measurement before and one after the timings)."""
    peak_before = matmul_throughput()
    best = time_interleaved(["fused", "reference"], d, C, r, n, B, rounds)
    peak = max(peak_before, matmul_throughput())
    flops = 3 * 4 * flops_per_iteration(d, C, r, n, B)
    result = {
        "threads": THREADS,
        "d": d,
        "C": C,
        "r": r,
        "n": n,
        "B": B,
        "rounds": rounds,
        **best,
        "fp32_matmul_gflops": peak,
        "fused_gflops": flops / best["fused"] / 1e9,
        "fused_over_standard": best["fused"] / best["reference"],
    }
    result["fraction_of_peak"] = result["fused_gflops"] / peak
    print(
        f"d = {d}, C = {C}, r = {r}, n = {n}, B = {B}, T = 4, {THREADS} thread(s), min of {rounds}: fused "
        f"{best['fused']:.3f} s, standard layer x4 {best['reference']:.3f} s, fused / standard "
        f"{result['fused_over_standard']:.2f}; fused {result['fused_gflops']:.1f} GFLOP/s = "
        f"{100 * result['fraction_of_peak']:.0f}% of the fp32 matmul peak {peak:.1f} GFLOP/s"
    )
    return result


def causal_vs_full(rounds: int, n: int = 2048, B: int = 1, d: int = 256, C: int = 8, r: int = 64) -> dict:
    """Fused forward+backward (T = 4) on the causal topology against the full one, in this
    process, interleaved, min over rounds (causal <= 0.6x full at n = 2048)."""
    models = {topology: build(d, C, r, n, B, "fused", topology=topology) for topology in ("full", "causal")}
    best = {topology: math.inf for topology in models}
    for engine, tokens in models.values():  # warm-up
        engine(tokens).logits.square().mean().backward()
    for _ in range(rounds):
        for topology, (engine, tokens) in models.items():
            start = time.perf_counter()
            engine(tokens).logits.square().mean().backward()
            best[topology] = min(best[topology], time.perf_counter() - start)
    result = {"threads": THREADS, "rounds": rounds, "n": n, "B": B, "d": d, "C": C, "r": r, **best}
    result["ratio"] = best["causal"] / best["full"]
    print(
        f"fused, n = {n}, B = {B}: full {best['full']:.3f} s, causal {best['causal']:.3f} s, "
        f"causal / full {result['ratio']:.3f}"
    )
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    parser.add_argument("--out", default="docs/benchmarks/mean_field.json")
    parser.add_argument("--against", metavar="REV", help="only: the fused iteration vs git revision REV's")
    parser.add_argument("--rounds", type=int, default=6, help="alternations for --against")
    parser.add_argument("--causal", action="store_true", help="only: causal vs full topology, n = 2048")
    parser.add_argument("--current", metavar="REV", help="with --against: time git REV instead of this checkout")
    parser.add_argument("--floor", action="store_true", help="only: fused vs standard layer and %% of peak, n = 512")
    parser.add_argument("--threads", type=int, default=THREADS, help="threads of every timing (default 2)")
    parser.add_argument("--tree", metavar="DIR", help="--floor, --causal: the engine's code from DIR (a git archive)")
    parser.add_argument("--default-malloc", action="store_true", help="--floor: without hold_freed_memory")
    args = parser.parse_args()
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    _set_threads(args.threads)
    if args.tree:  # an exported older tree: its graphs and inference, not this checkout's
        sys.path.insert(0, os.path.abspath(args.tree))
        import inference

        if not inference.__file__.startswith(os.path.abspath(args.tree)):
            raise SystemExit(f"--tree {args.tree}: inference was imported from {inference.__file__}")
    default_out = args.out == parser.get_default("out")
    if args.floor:
        held = not args.default_malloc and hold_freed_memory()  # as docs/training.md tells a script to
        results = {"tree": args.tree or "this checkout", "malloc": "held" if held else "default", **floor(args.rounds)}
        return _write(results, "docs/benchmarks/mean_field_floor.json" if default_out else args.out)
    if args.causal:
        results = {"tree": args.tree or "this checkout", **causal_vs_full(args.rounds)}
        return _write(results, "docs/benchmarks/mean_field_causal.json" if default_out else args.out)
    if args.against:
        sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
        from benchmarks.mean_field_against import against

        results = against(args.against, args.rounds, THREADS, current=args.current)
        return _write(results, "docs/benchmarks/mean_field_against.json" if default_out else args.out)
    _write(full_run(args.quick), args.out)


def _write(results: dict, out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def full_run(quick: bool) -> dict:
    """Every table of the module docstring: kernels, memory, SVI, compile."""
    results = {"threads": THREADS, "torch": torch.__version__, "kernels": [], "memory": []}

    gemm = matmul_throughput()
    results["fp32_matmul_gflops"] = gemm
    print(f"fp32 matmul (2048^3, {THREADS} threads): {gemm:.1f} GFLOP/s\n")

    configs = [("d256", 256, 8, 64), ("ptb", 384, 16, 64)]
    shapes = [(128, 8), (512, 8)] if quick else [(128, 8), (512, 8), (2048, 1)]
    print(
        "| config | n | B | naive s | fused s | standard layer x4 s | naive/fused | fused/standard | "
        "fused % of matmul peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, d, C, r in configs:
        for n, B in shapes:
            rounds = 3 if n <= 512 else 1
            best = time_interleaved(["naive", "fused", "reference"], d, C, r, n, B, rounds)
            achieved = 3 * 4 * flops_per_iteration(d, C, r, n, B) / best["fused"] / 1e9 / gemm
            row = dict(config=name, d=d, C=C, r=r, n=n, B=B, **best, achieved_fraction=achieved)
            results["kernels"].append(row)
            print(
                f"| {name} | {n} | {B} | {best['naive']:.3f} | {best['fused']:.3f} | {best['reference']:.3f} | "
                f"{best['naive'] / best['fused']:.2f} | {best['fused'] / best['reference']:.2f} | "
                f"{100 * achieved:.0f}% |"
            )

    print("\n| config | n | B | naive GiB | fused GiB | standard layer x4 GiB | fused/naive |")
    print("|---|---|---|---|---|---|---|")
    memory_shapes = [(128, 8), (512, 8)] if quick else [(512, 8), (512, 1), (2048, 1), (8192, 1)]
    for name, d, C, r in configs[:1] if not quick else configs:
        for n, B in memory_shapes:
            kinds = ["naive", "fused", "reference"] if n <= 2048 else ["fused", "reference"]
            mem = {k: peak_memory(k, d, C, r, n, B) for k in kinds}
            mem.setdefault("naive", math.nan)
            results["memory"].append(dict(config=name, n=n, B=B, **mem))
            print(
                f"| {name} | {n} | {B} | {mem['naive']:.2f} | {mem['fused']:.2f} | {mem['reference']:.2f} | "
                f"{mem['fused'] / mem['naive']:.2f} |"
            )

    svi = svi_vs_mean_field()
    results["svi"] = svi
    print(
        f"\nMeanField (20 async iterations) {svi['mean_field_seconds'] * 1e3:.2f} ms vs Pyro SVI "
        f"{svi['svi_seconds']:.2f} s ({svi['svi_steps']} steps) to ELBO {svi['target_elbo']:.4f} - 1e-3: "
        f"{svi['svi_seconds'] / svi['mean_field_seconds']:.0f}x"
    )

    comp = compile_comparison() if not quick else compile_comparison(n=128, B=2)
    results["compile"] = comp
    print(
        f"\neager {comp['eager']:.3f} s vs torch.compile {comp['compiled']:.3f} s "
        f"({comp['eager'] / comp['compiled']:.2f}x); first compiled call {comp['first_call_seconds']:.1f} s"
    )
    return results


if __name__ == "__main__":
    main()
