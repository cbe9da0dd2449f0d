"""Where the PT training step of ``make gpu-check`` synchronises with the host, and how often.

    python3 -m benchmarks.gpu_sync_sites --device cuda       # on the GPU machine

``make gpu-check`` counts the CUDA sync warnings of a 50-step loop, but a warning names the
Python frame that was running when it was raised, not always the operation that synchronised.
This runs the same step (``gpu_check_stages``: PT, AdamW, bf16 autocast) after warm-up under
``torch.cuda.set_sync_debug_mode("error")``, so the first synchronising call raises where it
happens, and prints that traceback; then it counts the warnings of loops of two lengths, so a
per-step sync (the count grows with the steps) is told from a one-off.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.getcwd())  # the tree it is run in, not an installed copy
import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import gpu_check_stages as stages  # noqa: E402


def pt_step(device: torch.device, sizes: stages.Sizes):
    models, _ = stages._training_models(sizes, device)
    model = models["pt"]
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(1, sizes.train_vocab, (sizes.batch, sizes.train_length), device=device)

    def step():
        with stages.autocast(device):
            logits = model(tokens)[0]
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)

    return step


def count_syncs(step, steps: int) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return len(stages.sync_warnings(caught))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("--device: a CUDA device is needed (sync debug mode is CUDA's)")
    sizes = stages.Sizes()
    step = pt_step(device, sizes)
    for _ in range(sizes.warmup):
        step()
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    done = 0
    try:
        while done < 5:
            step()
            done += 1
        print("no synchronising call in 5 steps under sync debug mode 'error'", flush=True)
    except RuntimeError:
        print(f"step {done} synchronised:\n{traceback.format_exc()}", flush=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for steps in (10, 40):
        print(f"sync warnings in {steps} steps: {count_syncs(step, steps)}", flush=True)


if __name__ == "__main__":
    main()
