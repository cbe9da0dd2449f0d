"""Particle Transformer benchmarks (issue: SMC engine and the Particle Transformer).

    .venv/bin/python benchmarks/particle_transformer.py

1. Cost of a resampling layer relative to one attention block (B = 8, n = 512,
   d = 256, 8 heads, FFN 1024), forward and forward + backward, interleaved, min of 5:
   resampling="mix" (Gumbel straight-through over the attention rows) and "copy"
   (systematic ancestors and the straight-through-with-baseline estimator).
2. Eager vs torch.compile of a whole Particle Transformer (eval mode, 4 layers).
torch.set_num_threads(2).
"""

from __future__ import annotations

import json
import math
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402

from probformer.models.particle_transformer import ParticleConfig, ParticleTransformer  # noqa: E402


def best_of(fn, rounds=5):
    fn()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    B, n, d = 8, 512, 256
    model = ParticleTransformer(
        ParticleConfig(
            vocab_size=1000, width=d, heads=8, layers=2, ffn_width=4 * d, max_length=n, dropout=0.0, ess_threshold=1.0
        )
    ).train()
    copying = ParticleTransformer(
        ParticleConfig(
            vocab_size=1000, width=d, heads=8, layers=2, ffn_width=4 * d, max_length=n, dropout=0.0, resampling="copy"
        )
    ).train()
    block = model.blocks[0]
    x = torch.randn(B, n, d, requires_grad=True)
    mask = torch.ones(B, n, dtype=torch.bool)
    bias = torch.zeros(B, n)
    attention = torch.rand(B, n, n).softmax(-1)
    log_weights = torch.randn(B, n, requires_grad=True)
    active = torch.ones(B, dtype=torch.bool)

    def block_forward():
        with torch.no_grad():
            block(x, bias)

    def block_backward():
        block(x, bias)[0].square().mean().backward()

    def resample_forward():
        with torch.no_grad():
            model.resample_mix(x, attention, mask, active)

    def resample_backward():
        model.resample_mix(x, attention, mask, active)[0].square().mean().backward()

    def copy_forward():
        with torch.no_grad():
            copying.resample_copy(x, log_weights, mask, active)

    def copy_backward():
        copying.resample_copy(x, log_weights, mask, active)[0].square().mean().backward()

    times = {}
    for _ in range(2):  # interleave
        for name, fn in (
            ("block forward", block_forward),
            ("resampling forward", resample_forward),
            ("copy forward", copy_forward),
            ("block forward+backward", block_backward),
            ("resampling forward+backward", resample_backward),
            ("copy forward+backward", copy_backward),
        ):
            times[name] = min(times.get(name, math.inf), best_of(fn, 3))
    print("| B=8, n=512, d=256 | block (SDPA) s | mix layer s | ratio | copy layer s | ratio |")
    print("|---|---|---|---|---|---|")
    for phase in ("forward", "forward+backward"):
        b, r, c = times[f"block {phase}"], times[f"resampling {phase}"], times[f"copy {phase}"]
        print(f"| {phase} | {b:.4f} | {r:.4f} | {r / b:.2f} | {c:.4f} | {c / b:.2f} |")

    small = ParticleTransformer(
        ParticleConfig(vocab_size=1000, width=d, heads=8, layers=4, ffn_width=4 * d, max_length=128, dropout=0.0)
    ).eval()
    tokens = torch.randint(0, 1000, (8, 128))
    compiled = torch.compile(lambda t: small(t)[0])
    start = time.perf_counter()
    with torch.no_grad():
        compiled(tokens)
    first = time.perf_counter() - start
    with torch.no_grad():
        eager_s = best_of(lambda: small(tokens)[0])
        compiled_s = best_of(lambda: compiled(tokens))
    print(
        f"\nParticle Transformer (4 layers, d=256, B=8, n=128, eval): eager {eager_s:.3f} s, compiled "
        f"{compiled_s:.3f} s ({eager_s / compiled_s:.2f}x); first compiled call {first:.1f} s"
    )
    os.makedirs("docs/benchmarks", exist_ok=True)
    with open("docs/benchmarks/particle_transformer.json", "w") as f:
        json.dump({**times, "eager": eager_s, "compiled": compiled_s, "first_compile": first}, f, indent=1)


if __name__ == "__main__":
    main()
