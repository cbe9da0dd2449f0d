"""SwarmFormer against full attention as the sequence grows: FLOPs and time.

    .venv/bin/python benchmarks/swarmformer.py

Both models: width 128, 4 heads, 3 layers, FFN 512, batch 1, one torch thread, eval mode.
SwarmFormer: window 3 (7 keys per query), clusters 16 -> 8 -> 4, Gumbel routing (argmax
at evaluation), top half of tokens update the clusters. FLOPs are counted by
``torch.utils.flop_counter`` with torch's fused attention swapped for the same
computation written as matmuls (the counter does not see the CPU fused kernel);
time is the median of 5 forward passes after one warm-up, both models measured in the
same run. Results: docs/benchmarks/swarmformer.json (and the table in
docs/benchmarks.md). The per-layer costs the design claims, O(n w d + p n C d + n d^2)
against O(n^2 d), are checked by the slope of FLOPs in n.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from probformer.models.baselines import Transformer, TransformerConfig
from probformer.models.swarmformer import SwarmConfig, SwarmFormer

LENGTHS = (128, 256, 512, 1024, 2048, 4096)
OUT = Path("docs/benchmarks/swarmformer.json")
SHAPE = dict(width=128, heads=4, layers=3, ffn_width=512, max_length=max(LENGTHS), dropout=0.0)


def _math_attention(q, k, v, attn_mask=None, dropout_p=0.0, **_):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if attn_mask is not None:
        scores = scores + attn_mask
    return scores.softmax(-1) @ v


def flops(model, tokens) -> int:
    fused = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _math_attention
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(tokens)
    finally:
        F.scaled_dot_product_attention = fused
    return counter.get_total_flops()


def seconds(model, tokens, repeats: int = 5) -> float:
    with torch.no_grad():
        model(tokens)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            model(tokens)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab = 1000
    swarm = SwarmFormer(SwarmConfig(vocab_size=vocab, window=3, clusters=16, **SHAPE)).eval()
    full = Transformer(TransformerConfig(vocab_size=vocab, **SHAPE)).eval()
    rows = []
    for n in LENGTHS:
        tokens = torch.randint(0, vocab, (1, n))
        row = {
            "n": n,
            "swarm_flops": flops(swarm, tokens),
            "full_flops": flops(full, tokens),
            "swarm_seconds": seconds(swarm, tokens),
            "full_seconds": seconds(full, tokens),
        }
        row["flops_ratio"] = row["swarm_flops"] / row["full_flops"]
        row["time_ratio"] = row["swarm_seconds"] / row["full_seconds"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for key in ("swarm_flops", "full_flops", "swarm_seconds", "full_seconds"):  # growth exponent, last doubling
        rows[-1][f"{key}_exponent"] = math.log2(rows[-1][key] / rows[-2][key])
    result = {
        "command": ".venv/bin/python benchmarks/swarmformer.py",
        "parameters": {
            "swarmformer": sum(p.numel() for p in swarm.parameters()),
            "full": sum(p.numel() for p in full.parameters()),
        },
        "rows": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
