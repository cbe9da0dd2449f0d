"""The flex_attention head kernel against the fused and naive kernels.

One head step, forward + backward: label marginals ``q_z [B, N, d]`` projected by the
CRF's tables (``[K, C, d, r]``), the head messages of a kernel (async mean field: value =
key, value_rev = query), a loss reading forward, reverse and lse, and its gradient back to
the tables. d = 256, C = 8, r = 64, topology "full", gamma = 3 (K = 8 groups), float32.

    .venv/bin/python benchmarks/flex_kernel.py                 # CPU, 2 threads
    .venv/bin/python benchmarks/flex_kernel.py --device cuda   # where a GPU is lent
    .venv/bin/python benchmarks/flex_kernel.py --masks         # the block masks' build time

CPU: time (best of 3 after a warm-up) at B = 2, n = 128 and 512, then the peak resident
memory of one step at B = 1, n = 2048, each kernel in a fresh process (growth of the peak
RSS over the process's size after setup, capped by an address-space limit). On the CPU the
flex kernel runs flex_attention's eager reference (its compiled CPU kernel returns no lse
and has no backward), which materialises the scores of all K * C heads: it is there for
correctness, not speed. CUDA: time (median of 5 after a warm-up that includes compilation,
reported apart) and ``torch.cuda.max_memory_allocated`` over what the inputs hold, at
B = 1, n = 512 .. 8192; a kernel that runs out of memory is reported as such.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, os.getcwd())  # the tree it is run in, not an installed copy
import torch  # noqa: E402

import graphs  # noqa: E402
from inference.mean_field.kernels import flex as flex_kernel  # noqa: E402
from inference.mean_field.kernels import head_kernels
from inference.mean_field.kernels.head_kernels import HeadStructure  # noqa: E402

LABELS, CHANNELS, RANK, GAMMA = 256, 8, 64, 3
KERNELS = {"naive": head_kernels.naive, "fused": head_kernels.fused, "flex": flex_kernel.flex}
CPU_MEMORY_CAP = 12 * 2**30  # bytes of address space a measured CPU step may add


def setup(n: int, batch: int, device: str):
    """The structure of a full batch of length n, label marginals and the tables (leaves)."""
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=10, labels=LABELS, channels=CHANNELS, rank=RANK, topology="full", gamma=GAMMA)
    mask = torch.ones(batch, n, dtype=torch.bool, device=device)
    structure = HeadStructure(
        n=n,
        gamma=crf.gamma,
        cuts=crf.distance_cuts,
        groups=crf.distance_groups(n, device),
        arcs=crf.arc_mask(mask),
        nodes=crf.node_mask(mask),
        token_arcs=crf.topology.mask(n, device)[:n, :n],
        band=crf.topology.band,
    )
    q_z = torch.randn(batch, n, LABELS, device=device).softmax(-1)
    tables = [t.detach().to(device).requires_grad_() for t in (crf.ternary_u, crf.ternary_v)]
    return structure, q_z, tables


def step(kernel: str, structure, q_z, tables) -> None:
    u, v = tables
    query = torch.einsum("bnd,kcdr->bnkcr", q_z, u)
    key = torch.einsum("bnd,kcdr->bnkcr", q_z, v)
    messages = KERNELS[kernel](query, key, key, query, 1.0, structure)
    loss = messages.forward.square().sum() + messages.reverse.square().sum() + messages.lse.sum()
    loss.backward()
    for t in tables:
        t.grad = None


def cpu_times() -> list[dict]:
    rows = []
    for n in (128, 512):
        inputs = setup(n, 2, "cpu")
        for kernel in KERNELS:
            step(kernel, *inputs)  # warm-up
            best = math.inf
            for _ in range(3):
                start = time.perf_counter()
                step(kernel, *inputs)
                best = min(best, time.perf_counter() - start)
            rows.append({"device": "cpu", "kernel": kernel, "B": 2, "n": n, "ms": round(best * 1000, 1)})
            print(rows[-1], flush=True)
    return rows


def cpu_peak(kernel: str, n: int, batch: int) -> dict:
    """One step in this process: the growth of the peak RSS over the size after setup."""
    inputs = setup(n, batch, "cpu")
    with open("/proc/self/status") as status:
        sizes = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if line.startswith("Vm")}
    resource.setrlimit(resource.RLIMIT_AS, (sizes["VmSize"] + CPU_MEMORY_CAP, resource.RLIM_INFINITY))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        step(kernel, *inputs)
    except (MemoryError, RuntimeError) as error:
        return {"kernel": kernel, "n": n, "B": batch, "peak_MiB": None, "error": str(error).splitlines()[0][:120]}
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"device": "cpu", "kernel": kernel, "B": batch, "n": n, "peak_MiB": round(grown / 2**20)}


def cpu_peaks(n: int = 2048, batch: int = 1) -> list[dict]:
    rows = []
    for kernel in ("naive", "flex"):
        command = [sys.executable, __file__, "--peak", kernel, str(n), str(batch)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = result.stdout.strip().splitlines()
        rows.append(json.loads(lines[-1]) if lines else {"kernel": kernel, "error": result.stderr[-300:]})
        print(rows[-1], flush=True)
    return rows


def cuda_rows(lengths=(512, 1024, 2048, 4096, 8192), batch: int = 1) -> list[dict]:
    rows = []
    for n in lengths:
        for kernel in KERNELS:
            row = {"device": torch.cuda.get_device_name(), "kernel": kernel, "B": batch, "n": n}
            try:
                inputs = setup(n, batch, "cuda")
                torch.cuda.synchronize()
                start = time.perf_counter()
                step(kernel, *inputs)  # warm-up: compiles the flex kernel on first use of a shape
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - start, 2)
                times = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    step(kernel, *inputs)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                row["ms"] = round(statistics.median(times) * 1000, 2)
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
                step(kernel, *inputs)
                torch.cuda.synchronize()
                row["peak_MiB"] = round((torch.cuda.max_memory_allocated() - held) / 2**20)
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            inputs = None
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    return rows


def mask_build_times(lengths=(2048, 4096), batch: int = 8) -> list[dict]:
    """Seconds to build the flex kernel's block masks for a new batch of a full-topology PT
    (K = 8 groups, C = 8 channels) through ``MeanField.structure``: the first batch of a
    length (the topology's block table built and cached) and a later one (only the batch's
    own step), each the best of 3, on one thread."""
    from inference import MeanField
    from inference.mean_field.kernels import flex_masks

    rows = []
    for n in lengths:
        crf = graphs.CRF(vocab_size=10, labels=16, channels=CHANNELS, rank=4, topology="full", gamma=GAMMA)
        engine = MeanField(crf, kernel="flex")
        tokens = torch.randint(0, 10, (batch, n))
        times = {}
        for case in ("first", "later"):
            best = math.inf
            for _ in range(3):
                if case == "first":
                    flex_masks._band_blocks.cache_clear()
                structure = engine.structure(tokens, None)[2]
                start = time.perf_counter()
                flex_masks.block_masks(structure, flex_masks.group_count(structure), CHANNELS)
                best = min(best, time.perf_counter() - start)
            times[case] = round(best * 1000, 2)
        rows.append({"n": n, "B": batch, "first_batch_ms": times["first"], "later_batch_ms": times["later"]})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--peak", nargs=3, metavar=("KERNEL", "N", "B"), help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--masks", action="store_true", help="only the block masks' build time (CPU)")
    args = parser.parse_args()
    torch.set_num_threads(1 if args.masks else 2)
    if args.masks:
        mask_build_times()
    elif args.peak:
        kernel, n, batch = args.peak
        print(json.dumps(cpu_peak(kernel, int(n), int(batch))))
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
        cuda_rows(tuple(args.lengths))
    else:
        cpu_times()
        cpu_peaks()


if __name__ == "__main__":
    main()
