"""Where a run computes: its device, its thread count, how its CPU memory is reused and,
under ``torchrun``, the processes of a data-parallel run (gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import ctypes
import os
import sys

import torch

__all__ = ["resolve_device", "default_threads", "hold_freed_memory", "init_distributed", "all_sum", "barrier"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_NEVER_TRIM = 2**31 - 1  # the largest value mallopt takes (an int): the heap is never trimmed


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a torch device: "auto" is CUDA when present, else the CPU;
    under torchrun each process takes the CUDA device of its local rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():  # the config refuses this first; a guard
        raise ValueError("config key 'train.device' is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    if name != "cuda":
        return torch.device(name)
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def default_threads(world: int) -> int:
    """OMP_NUM_THREADS when set (benchmarks run jobs side by side), else the cores split
    between processes, at most 2: oversubscribed threads have made runs far slower."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, min(2, os.cpu_count() or 1) // world)


def hold_freed_memory() -> bool:
    """Keep the memory this process frees for its next allocations instead of handing it back
    to the operating system (glibc's malloc: no block served by its own mmap, the heap never
    trimmed). True where glibc took both settings (Linux), False elsewhere; a malloc loaded
    in glibc's place (tcmalloc, jemalloc) may accept the call and ignore it.

    Why: glibc serves each large block (the threshold adapts up to 32 MiB) with a fresh mmap
    and unmaps it when freed, so every CPU training step faults its large tensors' pages in
    again and the kernel zeroes each one (docs/benchmarks.md, "Long inputs"). The price:
    freed memory is never returned while the process lives, and blocks of many sizes freed
    around survivors fragment the heap, so the resident memory can grow past the peak of
    live tensors. There is no undo: it is for a process of its own (a training run), so the
    trainer applies it on the CPU only when ``train.hold_freed_memory`` is true, and a
    script calls this once, at its start, before starting threads."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))


def init_distributed(device: str) -> tuple[int, int]:
    """``(rank, world size)`` of this process in the ``torchrun`` group, joined here."""
    import torch.distributed as dist

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")  # nccl moves CUDA tensors only
    return dist.get_rank(), dist.get_world_size()


def all_sum(value: torch.Tensor, world: int) -> torch.Tensor:
    """``value`` summed over the processes, in place (itself on one process)."""
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(value)
    return value


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
