"""The compiled flex path compiles once per configuration and never falls back to eager.

Dynamo recompiles a compiled function when a guarded shape or constant changes, and after
its recompile limit (8) it runs the function eagerly with only a warning: for flex, the
O(n^2) path. The kernel compiles per configuration (inference.mean_field.kernels.flex._compiled) with
dynamic shapes. On the CPU the compiled path runs with the aot_eager backend and without
gradients (inductor's CPU flex has no lse and no backward); the oracle is the eager
reference on the same inputs, and the counts are Dynamo's own counters.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import graphs
from inference.mean_field.engine import MeanField
from inference.mean_field.kernels import flex as flex_kernel
from inference.mean_field.kernels.flex import flex

pytestmark = pytest.mark.usefixtures("one_thread")


# (batch, length, padded tokens of row 1): lengths past one 128-block, batch sizes >= 2
SHAPES = [(2, 130, 0), (3, 140, 5), (2, 200, 60), (4, 150, 1), (2, 257, 100), (3, 300, 0),
          (2, 180, 90), (5, 131, 30), (2, 400, 7), (3, 256, 128), (4, 210, 0), (2, 333, 200)]  # fmt: skip


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    monkeypatch.setattr(flex_kernel, "COMPILED_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(flex_kernel, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    flex_kernel._compiled.cache_clear()
    counters.clear()
    yield
    torch._dynamo.reset()
    flex_kernel._compiled.cache_clear()


def engine_and_batch(batch: int, n: int, padded: int, seed: int, topology: str = "causal | root()"):
    torch.manual_seed(seed)
    crf = graphs.CRF(vocab_size=7, labels=3, channels=2, rank=3, topology=topology, gamma=1)
    engine = MeanField(crf, iterations=1, kernel="flex")
    tokens = torch.randint(0, 7, (batch, n))
    mask = torch.ones(batch, n, dtype=torch.bool)
    if padded:
        mask[1, n - padded :] = False
    _, _, structure = engine.structure(tokens, mask)
    N = structure.nodes.shape[1]
    projections = [torch.randn(batch, N, crf.num_groups, 2, 3) for _ in range(4)]
    return structure, projections


def test_twelve_shapes_compile_at_most_three_times_and_never_fall_back(compiled_on_cpu):
    compiled_equals_eager(SHAPES)
    graphs_compiled = counters["stats"]["unique_graphs"]
    assert 1 <= graphs_compiled <= 3, dict(counters["stats"])  # the forward and the reverse masks: two configurations
    assert not counters["recompile_limit"] and not counters["cache_size_limit"]


def test_a_topology_of_the_sentence_length_compiles_its_table_per_row(compiled_on_cpu):
    """``star(wrap=True)``: the mask_mod reads each row's own token table ``[B, n, n]``."""
    compiled_equals_eager(SHAPES[:4], "window(1) | star(wrap=True)")
    assert 1 <= counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    assert not counters["recompile_limit"] and not counters["cache_size_limit"]


def compiled_equals_eager(shapes, topology: str = "causal | root()"):
    """The compiled kernel's messages and lse against the eager reference's, shape by shape."""
    for seed, (batch, n, padded) in enumerate(shapes):
        structure, projections = engine_and_batch(batch, n, padded, seed, topology)
        with torch.no_grad():
            compiled = flex(*projections, 0.5, structure)
            with pytest.MonkeyPatch.context() as eager:
                eager.setattr(flex_kernel, "COMPILED_DEVICES", frozenset())
                reference = flex(*projections, 0.5, structure)
        for ours, theirs in ((compiled.forward, reference.forward), (compiled.reverse, reference.reverse)):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled.lse, reference.lse, atol=1e-5, rtol=1e-5)


def test_a_recompile_past_the_limit_raises_instead_of_running_eagerly(compiled_on_cpu):
    seen = []

    def attend(*args, **kwargs):
        seen.append(torch._dynamo.config.fail_on_recompile_limit_hit)
        raise RuntimeError("stop")

    structure, projections = engine_and_batch(2, 130, 0, 0)
    with pytest.MonkeyPatch.context() as patch, torch.no_grad(), pytest.raises(RuntimeError, match="stop"):
        patch.setattr(flex_kernel, "_compiled", lambda configuration: attend)
        flex(*projections, 0.5, structure)
    assert seen == [True]
    assert not torch._dynamo.config.fail_on_recompile_limit_hit  # only while the kernel runs
