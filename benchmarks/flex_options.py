"""Which flex_attention kernel options make the PT step fastest on a GPU, in one process.

    python3 -m benchmarks.flex_options --device cuda --n 8192 --batch 1 --topologies full "window(256)" \
        --variants default backward_64 forward_64      # on the GPU machine
    python3 -m benchmarks.flex_options --device cpu --tiny     # the dry run (make test runs it)

A profile of the PT step on an H100 (docs/benchmarks.md, "The second run") put most of its
time in flex_attention's backward kernel, and showed a window topology's flex calls costing
about four times the share of blocks they read. Triton's block sizes, warps and pipeline
stages are flex_attention's ``kernel_options``; this times the step (forward + backward, the
GPU check's sizes, ``gpu_check_stages.pt_engine``) under each named variant of them, added to
the options the engine gives every call (the backend and the tf32x3 precision), and compares
each variant's logits with the default's (the largest difference: a variant must not change
the answer beyond float32 rounding; list ``default`` first to have it for every variant).
Variants run in the order given. Compiled kernels are dropped between variants, so each
variant compiles its own. One JSON line per (topology, variant) goes to ``--out``.

The dry run uses the CPU's fused kernel (flex is compiled on CUDA only), so it checks the
plumbing (each variant applied and undone, every line written), not the options.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.getcwd())  # the tree it is run in, not an installed copy
import torch  # noqa: E402

from benchmarks import gpu_check_stages as stages  # noqa: E402
from inference.mean_field.kernels import flex  # noqa: E402

# kernel_options of torch's flex templates: forward tiles (BLOCK_M x BLOCK_N), the backward's
# two passes (dk/dv: BLOCK_M1 x BLOCK_N1; dq: BLOCK_M2 x BLOCK_N2); each must divide the
# block mask's block (128). "mask_block" is no kernel option: the block masks' block size
# (fewer elements in partial blocks, where the mask_mod runs per element), with tiles that
# divide it
_TILES_64 = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64}
_TILES_32 = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32}
VARIANTS = {
    "default": {},
    "forward_64": {"BLOCK_M": 64, "BLOCK_N": 64},
    "backward_64": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64},
    "backward_32_128": {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32},
    "warps_8": {"num_warps": 8},
    "stages_2": {"num_stages": 2},
    "mask_64": {"mask_block": 64, **_TILES_64},
    "mask_64_tiles_32": {"mask_block": 64, **_TILES_32},
    "mask_32": {"mask_block": 32, **_TILES_32},
}


def with_options(extra: dict):
    """Add ``extra`` to the engine's kernel options (its ``mask_block`` to the block masks)
    until the returned function is called."""
    saved, saved_block = flex._KERNEL_OPTIONS, flex._MASK_BLOCK
    options = dict(extra)
    flex._MASK_BLOCK = options.pop("mask_block", saved_block)
    flex._KERNEL_OPTIONS = {**saved, **options}
    drop_compiled()

    def undo():
        flex._KERNEL_OPTIONS, flex._MASK_BLOCK = saved, saved_block
        drop_compiled()

    return undo


def drop_compiled() -> None:
    flex._compiled.cache_clear()
    torch._dynamo.reset()


def measure(sizes: stages.Sizes, topology: str, n: int, device: torch.device, reference):
    torch.manual_seed(0)  # the same weights for every variant
    engine = stages.pt_engine(sizes, topology, "grouped", device)
    tokens = torch.randint(0, 100, (sizes.batch, n), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad(), stages.autocast(device):
        logits = engine(tokens).logits.float()
    seconds = stages.timed(stages.pt_step(engine, n, sizes, device), device, sizes)
    difference = None if reference is None else (logits - reference).abs().max().item()
    return seconds, logits, difference


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--topologies", nargs="+", default=["full", "window(256)"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run's sizes")
    parser.add_argument("--out", default="flex_options.jsonl")
    args = parser.parse_args(argv)
    if args.n < 1 or args.batch < 1:
        parser.error(f"--n and --batch must be at least 1, got {args.n} and {args.batch}")
    device = torch.device(args.device)
    sizes = replace(stages.TINY if args.tiny else stages.Sizes(), batch=args.batch, lengths=(args.n,))
    # in the order given (a call that runs out of device time has timed the first ones); the
    # logits compared are the default's, so a variant before it, or without it, has no difference
    variants = list(dict.fromkeys(args.variants))
    lines = []
    for topology in args.topologies:
        reference = None
        for name in variants:
            undo = with_options(VARIANTS[name])
            started = time.perf_counter()
            try:
                seconds, logits, difference = measure(sizes, topology, args.n, device, reference)
                line = {"topology": topology, "variant": name, "options": VARIANTS[name], "step_s": seconds,
                        "logit_difference": difference, "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
                reference = logits if name == "default" else reference
            except Exception as error:  # a variant Triton refuses is recorded; the others still run
                line = {"topology": topology, "variant": name, "error": f"{type(error).__name__}: {error}"[:300]}
            finally:
                undo()
            line.update(n=args.n, batch=args.batch, device=str(device))
            stages.write_line(line, args.out)
            lines.append(line)
    return lines


if __name__ == "__main__":
    main()
