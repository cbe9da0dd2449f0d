"""The shared ternary form against the grouped one and a standard transformer layer.

    .venv/bin/python benchmarks/shared_form.py [--lengths 512,128] [--rounds 3] [--kinds ...] [--out FILE]

Workload: forward + backward through T = 4 unrolled async
iterations of ``inference.MeanField(..., weights="reference")`` at d = 256, C = 8, r = 64,
B = 8, full topology, gamma = 3 (K = 8 distance groups), for

    shared-naive   ternary_form="shared" (one U, V per channel, a bias per group and
                   channel), kernel="naive" (materialised head marginals: plain GEMMs)
    shared-fused   the same, kernel="fused" (memory-linear)
    grouped-fused  ternary_form="low_rank" (U, V per group and channel), kernel="fused"
    standard       nn.TransformerEncoderLayer(d, C, 4d, norm_first=True, batch_first=True)
                   applied 4 times (tied weights; SDPA inside)

In one process, 2 threads, interleaved (each kind once per round), min over rounds; the
fp32 matmul peak (2048^3) is measured in the same run, before and after. "% of peak" counts
algorithmic forward FLOPs times 3 for forward + backward:

    PT iteration     8 B n d G C r + 6 B C n^2 r    (G = 1 shared, K grouped: projections to
                                                     and from the groups; three n x n
                                                     contractions of width C r)
    standard layer   24 B n d^2 + 4 B n^2 d         (QKV/O and a 4d FFN; two n x n products)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402

sys.path.insert(0, os.getcwd())  # the tree it is run in, as benchmarks/fused_step.py
from benchmarks.mean_field import matmul_throughput as matmul_peak  # noqa: E402

THREADS = 2
D, C, R, B, ITERATIONS, GAMMA = 256, 8, 64, 8, 4, 3
KINDS = ("shared-naive", "shared-fused", "grouped-fused", "standard")


def make(kind: str, n: int, seed: int = 0):
    """``(model, inputs)`` for one kind at length n."""
    torch.manual_seed(seed)
    if kind == "standard":
        layer = torch.nn.TransformerEncoderLayer(D, C, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        return layer, torch.randn(B, n, D)
    import graphs
    import inference

    form, kernel = kind.split("-")
    form = "low_rank" if form == "grouped" else form
    crf = graphs.CRF(vocab_size=1000, labels=D, channels=C, rank=R, topology="full", gamma=GAMMA, ternary_form=form)
    if form == "shared":
        with torch.no_grad():  # a trained-looking distance prior (0 at init would be a special case)
            crf.shared_bias.normal_()
    engine = inference.MeanField(crf, iterations=ITERATIONS, kernel=kernel, weights="reference")
    return engine, torch.randint(0, 1000, (B, n))


def step(kind: str, model, inputs) -> None:
    if kind == "standard":
        hidden = inputs
        for _ in range(ITERATIONS):
            hidden = model(hidden)
        hidden.square().mean().backward()
    else:
        model(inputs).logits.square().mean().backward()


def forward_flops(kind: str, n: int) -> float:
    """Algorithmic forward FLOPs of the whole workload (4 iterations or 4 layers)."""
    if kind == "standard":
        return ITERATIONS * (24 * B * n * D * D + 4 * B * n * n * D)
    groups = 1 if kind.startswith("shared") else 2 * (GAMMA + 1)
    return ITERATIONS * (8 * B * n * D * groups * C * R + 6 * B * C * n * n * R)


def time_interleaved(n: int, rounds: int, kinds) -> dict[str, float]:
    """Min over ``rounds`` (after one warm-up step each) of each kind, interleaved."""
    models = {kind: make(kind, n) for kind in kinds}
    for kind in kinds:
        step(kind, *models[kind])
    best = {kind: math.inf for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            start = time.perf_counter()
            step(kind, *models[kind])
            best[kind] = min(best[kind], time.perf_counter() - start)
        print(f"n={n}: {best}", flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="512,128", help="comma-separated n")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {list(KINDS)}")
    parser.add_argument("--out", default="", help="write the raw numbers as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or "standard" not in kinds:
        raise ValueError(f"--kinds must name kinds of {list(KINDS)}, 'standard' among them; unknown: {unknown}")
    peak = matmul_peak()
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        seconds = time_interleaved(n, args.rounds, kinds)
        over = {k: seconds[k] / seconds["standard"] for k in kinds}
        percent = {k: 100 * 3 * forward_flops(k, n) / seconds[k] / (peak * 1e9) for k in kinds}
        rows.append({"n": n, "seconds": seconds, "over_standard": over, "percent_of_peak": percent})
    peak_again = matmul_peak()  # the machine is shared: report whether the peak held
    print(f"fp32 matmul peak (2048^3, {THREADS} threads): {peak:.0f} GFLOP/s before, {peak_again:.0f} after")
    print(f"d={D}, C={C}, r={R}, B={B}, T={ITERATIONS}, gamma={GAMMA}, forward + backward, min of {args.rounds}")
    print("| n | kind | seconds | / standard x4 | % of matmul peak |")
    print("|---|---|---|---|---|")
    for row in rows:
        for k in kinds:
            print(
                f"| {row['n']} | {k} | {row['seconds'][k]:.3f} | {row['over_standard'][k]:.2f} "
                f"| {row['percent_of_peak'][k]:.0f}% |"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"matmul_gflops": [peak, peak_again], "threads": THREADS, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
