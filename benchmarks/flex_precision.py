"""The flex kernel's float32 dot-product precision on CUDA: speed and error of each choice.

    python3 -m benchmarks.flex_precision --precision tf32x3 --lengths 512 4096

For one Triton ``input_precision`` (``ieee``: float32 without tensor cores; ``tf32``;
``tf32x3``: three TF32 products, the kernel's default on CUDA) builds the PT engine of
``benchmarks/gpu_check_stages.py`` and prints, per length, one JSON line: seconds of a
forward + backward in bf16 autocast (the GPU targets' step), the same for
``nn.TransformerEncoderLayer`` applied T times, and the largest error of the float32 logits
against the float64 fused kernel with the same weights, relative to the largest logit.
One precision per process: each is a compile of its own.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import replace

import torch

import inference.mean_field.kernels.flex as flex_module
from benchmarks.gpu_check_stages import TINY, Sizes, pt_engine, pt_step, reference_layer_step, timed


def logit_error(engine, n: int, sizes: Sizes, device: torch.device) -> float:
    tokens = torch.randint(0, 100, (2, n), device=device)
    exact = copy.deepcopy(engine).double()
    exact.kernel = "fused"
    with torch.no_grad():
        ours = engine(tokens).logits.double()
        truth = exact(tokens).logits
    return ((ours - truth).abs().max() / truth.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["ieee", "tf32", "tf32x3"], default="tf32x3")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run's sizes (checks the script only)")
    parser.add_argument("--threads", type=int, default=8, help="CPU threads (the GPU machine has 16 cores)")
    args = parser.parse_args()
    if args.threads < 1 or min(args.lengths) < 1:
        parser.error(f"--threads and --lengths must be at least 1, got {args.threads} and {args.lengths}")
    torch.set_num_threads(args.threads)
    flex_module._CUDA_FLOAT32_PRECISION = f"'{args.precision}'"
    device = torch.device(args.device)
    for n in args.lengths:
        sizes = replace(TINY if args.tiny else Sizes(), lengths=(n,))
        torch.manual_seed(0)
        engine = pt_engine(sizes, "full", "grouped", device)
        start = time.perf_counter()
        pt_s = timed(pt_step(engine, n, sizes, device), device, sizes)
        layer_s = timed(reference_layer_step(sizes, n, device), device, sizes)
        row = {"precision": args.precision, "n": n, "pt_s": pt_s, "layer_s": layer_s, "ratio": pt_s / layer_s,
               "relative_logit_error": logit_error(engine, min(n, 1024), sizes, device),
               "stage_s": round(time.perf_counter() - start, 1)}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
