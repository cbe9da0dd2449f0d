"""The fused and flex kernels allocate nothing of N^2 elements: memory linear in n.

A dispatch mode records the size of every tensor an operator allocates (outputs that share
no storage with an input: views and in-place results are not allocations) during a forward
and backward of the whole engine at n = 4096, after a warm-up call that fills the caches
kept per (topology, n, device) (the topology's token table and what is derived from it).
Nothing may reach N^2 = 16.8M elements (64 MiB in float32); the largest allocation is
reported. The naive kernel is the positive control: it allocates [B, C, N, N].

flex on the CPU runs flex_attention's eager reference (it materialises the scores; the
compiled CUDA kernel does not), without gradients (the engine refuses them there): the
allocations inside that one call are left out, and everything around it (block masks,
mask_mod data, lse merges, messages) is recorded, at n = 512.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import graphs
from inference.mean_field.engine import MeanField
from inference.mean_field.kernels import flex as flex_kernel

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/inference/conftest.py

N_TOKENS = 4096
FUSED_TOPOLOGIES = ["full", "causal", "window(16)", "segments(256)", "full | root()", "star()", "clusters(4)"]


class Allocations(TorchDispatchMode):
    """The element count of every new storage an operator returns, with the operator."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _dense(t)}
        for out in tree_flatten(result)[0]:
            if _dense(out) and out.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((out.untyped_storage().nbytes() // out.element_size(), str(func)))
        return result

    def largest(self) -> tuple[int, str]:
        return max(self.sizes, default=(0, ""))


def _dense(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


def engine_run(topology: str, kernel: str, n: int, grad: bool = True):
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=11, labels=4, channels=2, rank=4, topology=topology, gamma=1)
    engine = MeanField(crf, iterations=1, kernel=kernel)
    tokens = torch.randint(0, 11, (2, n))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n - 100 :] = False  # padding: the rows' nodes differ

    def run():
        with torch.set_grad_enabled(grad):
            post = engine(tokens, mask)
            if grad:
                post.logits.square().sum().backward()

    def warm_up():  # the caches kept per (topology, n, device): the token table, its float copy
        assert engine.structure(tokens, mask)[2].has_head.any()

    run.warm_up = warm_up
    return crf, run


@pytest.mark.parametrize("topology", FUSED_TOPOLOGIES)
def test_the_fused_engine_allocates_nothing_quadratic(topology):
    crf, run = engine_run(topology, "fused", N_TOKENS)
    run.warm_up()
    with Allocations() as allocations:
        run()
    N = crf.topology.num_nodes(N_TOKENS)
    largest, operator = allocations.largest()
    assert largest < N * N, f"{operator} allocated {largest} elements (N^2 = {N * N})"
    assert largest > 0


@pytest.mark.parametrize("topology", ["causal | root()", "segments(64)", "window(8) | clusters(4)"])
def test_the_flex_kernel_allocates_nothing_quadratic_around_the_attention(topology, monkeypatch):
    reference = flex_kernel._flex_reference
    calls = []

    def unrecorded(*args, **kwargs):  # the eager reference's own scores are left out
        calls.append(1)
        with _disable_current_modes():
            return reference(*args, **kwargs)

    monkeypatch.setattr(flex_kernel, "_flex_reference", unrecorded)
    n = 512  # the eager reference materialises [B, C K, N, N] scores: a smaller n keeps it quick
    crf, run = engine_run(topology, "flex", n, grad=False)
    run()
    with Allocations() as recorder:
        run()
    assert calls  # the kernel ran through the (unrecorded) attention
    N = crf.topology.num_nodes(n)
    largest, operator = recorder.largest()
    assert 0 < largest < N * N, f"{operator} allocated {largest} elements (N^2 = {N * N})"


def test_the_naive_kernel_is_caught():
    """Positive control: the recorder sees the materialised head marginals."""
    n = 256
    crf, run = engine_run("full", "naive", n)
    with Allocations() as allocations:
        run()
    assert allocations.largest()[0] >= 2 * crf.channels * n * n
