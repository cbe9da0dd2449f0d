"""Eager vs torch.compile forward time of every model kind on CPU.

    .venv/bin/python -m benchmarks.compile

One thread, eval mode, no_grad, batch 8 x 128 tokens, the default sizes of each config
(the PT at labels 128, channels 4, rank 32, 4 iterations). Each forward is timed as the
median of 20 after warm-up, eager and compiled alternating in one process; compile time is
reported separately. Writes docs/benchmarks/compile.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

from probformer.models.baselines import Transformer, TransformerConfig  # noqa: E402
from probformer.models.folded_context import FoldedContext, FoldedContextConfig  # noqa: E402
from probformer.models.particle_transformer import ParticleConfig, ParticleTransformer  # noqa: E402
from probformer.models.probabilistic_transformer import ProbabilisticTransformer, PTConfig  # noqa: E402
from probformer.models.swarmformer import SwarmConfig, SwarmFormer  # noqa: E402

V, B, N = 1000, 8, 128
PT = dict(vocab_size=V, labels=128, channels=4, rank=32, iterations=4, dropout=0.0)
MODELS = {
    "ProbabilisticTransformer (naive kernel)": lambda: ProbabilisticTransformer(PTConfig(**PT, kernel="naive")),
    "ProbabilisticTransformer (fused kernel)": lambda: ProbabilisticTransformer(PTConfig(**PT, kernel="fused")),
    "ParticleTransformer": lambda: ParticleTransformer(ParticleConfig(vocab_size=V)),
    "Transformer (BERT)": lambda: Transformer(TransformerConfig(vocab_size=V)),
    "SwarmFormer": lambda: SwarmFormer(SwarmConfig(vocab_size=V)),
    "FoldedContext": lambda: FoldedContext(FoldedContextConfig(vocab_size=V)),
}


def median_seconds(fn, tokens, mask, repeats=20):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(tokens, mask)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens = torch.randint(0, V, (B, N))
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, N // 2 :] = False
    rows = {}
    for name, build in MODELS.items():
        model = build().eval()
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            start = time.perf_counter()
            try:
                compiled(tokens, mask)
            except Exception as error:  # reported, not hidden: the table says which kind fails and how
                rows[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
                print(f"| {name} | - | - | fails: {rows[name]['error']} | - |", flush=True)
                continue
            compile_seconds = time.perf_counter() - start
            model(tokens, mask)
            eager = median_seconds(model, tokens, mask)
            fast = median_seconds(compiled, tokens, mask)
        rows[name] = {"eager_ms": eager * 1e3, "compiled_ms": fast * 1e3, "compile_s": compile_seconds}
        row = f"| {name} | {eager * 1e3:.1f} | {fast * 1e3:.1f} | {eager / fast:.2f}x | {compile_seconds:.0f} |"
        print(row, flush=True)
    os.makedirs("docs/benchmarks", exist_ok=True)
    with open("docs/benchmarks/compile.json", "w") as f:
        json.dump({"batch": B, "tokens": N, "threads": 1, "models": rows}, f, indent=1)


if __name__ == "__main__":
    print("| model | eager ms | compiled ms | speed-up | compile s |\n|---|---|---|---|---|")
    main()
