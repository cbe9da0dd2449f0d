"""One fused mean-field training step, timed: forward + backward of T = 4 fused
iterations, d = 128, C = 4, r = 32, B = 4, n = 256, 1 thread, best of 5, in milliseconds.

    .venv/bin/python benchmarks/fused_step.py

To compare two commits, run it in an exported copy of each, alternating:
    git archive REV | tar -x -C /tmp/old && (cd /tmp/old && /path/to/.venv/bin/python benchmarks/fused_step.py)
"""

from __future__ import annotations

import math
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.getcwd())  # the tree it is run in, not an installed copy
import torch  # noqa: E402

import graphs  # noqa: E402
import inference  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=1000, labels=128, channels=4, rank=32, topology="full", gamma=3)
    engine = inference.MeanField(crf, iterations=4, kernel="fused", weights="reference")
    tokens = torch.randint(0, 1000, (4, 256))

    def step():
        engine.zero_grad()
        engine(tokens).logits.square().sum().backward()

    step()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    print(f"{best * 1000:.1f} ms")


if __name__ == "__main__":
    main()
