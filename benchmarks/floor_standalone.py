"""The fused PT iteration at the reference size, timed as a user would run it, on its own.

    .venv/bin/python benchmarks/floor_standalone.py [--rounds 5]

A fresh process that shares nothing with ``benchmarks/mean_field.py --floor``: it builds
``graphs.CRF(...)`` and ``inference.MeanField(..., kernel="fused", weights="reference")`` the
way the README does, and a standard layer (``nn.TransformerEncoderLayer``, pre-LN, applied 4
times with tied weights); times forward + backward of each, interleaved, min over rounds; and
measures the fp32 matmul peak itself (the best of 2048^3 products before and after). d = 256,
C = 8, r = 64, n = 512, B = 8, T = 4, gamma = 3 (K = 8 groups), full topology, 1 thread.

Its own FLOP count, forward per iteration: projections to the K groups' queries and keys
and the back-projection of forward and reverse messages, 2 GEMMs each way of B n d x K C r
(8 B n d K C r), and three n x n contractions of width C r per sentence (the scores, A k and
A^T q: 6 B C n^2 r); x 3 for forward + backward.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.getcwd())  # the tree it is run in, not an installed copy
import torch  # noqa: E402

import graphs  # noqa: E402
import inference  # noqa: E402
from probformer.training.placement import hold_freed_memory  # noqa: E402

d, C, r, n, B, T, K = 256, 8, 64, 512, 8, 4, 8


def peak_gflops() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--default-malloc", action="store_true", help="without hold_freed_memory")
    args = parser.parse_args()
    rounds = args.rounds
    torch.set_num_threads(1)
    if not args.default_malloc:
        hold_freed_memory()  # what docs/training.md tells a script on the CPU to call
    peak = peak_gflops()

    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=1000, labels=d, channels=C, rank=r, topology="full", gamma=3)
    engine = inference.MeanField(crf, iterations=T, kernel="fused", weights="reference")
    tokens = torch.randint(0, 1000, (B, n))
    layer = torch.nn.TransformerEncoderLayer(d, C, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
    x = torch.randn(B, n, d)

    def pt_step():
        engine.zero_grad()
        engine(tokens).logits.square().mean().backward()

    def standard_step():
        layer.zero_grad()
        h = x
        for _ in range(T):
            h = layer(h)
        h.square().mean().backward()

    steps = {"fused PT": pt_step, "standard layer x4": standard_step}
    best = {name: math.inf for name in steps}
    for step in steps.values():  # warm-up
        step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    peak = max(peak, peak_gflops())
    flops = 3 * T * (8 * B * n * d * K * C * r + 6 * B * C * n * n * r)
    achieved = flops / best["fused PT"] / 1e9
    print(
        f"standalone, 1 thread, min of {rounds}: fused PT {best['fused PT']:.3f} s, standard layer x4 "
        f"{best['standard layer x4']:.3f} s, ratio {best['fused PT'] / best['standard layer x4']:.2f}; "
        f"{achieved:.1f} GFLOP/s = {100 * achieved / peak:.0f}% of the fp32 matmul peak {peak:.1f} GFLOP/s"
    )


if __name__ == "__main__":
    main()
