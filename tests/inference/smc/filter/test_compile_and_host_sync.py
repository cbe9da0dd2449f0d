"""The filter compiled and on a device: ``torch.compile`` of a run equals eager under a fixed
generator, and no filter step reads a tensor's value on the host (with ``validate=False``
nothing at all; with validation once, after the last step)."""

import pytest
import torch

from inference import SMC
from inference.smc.filter import RESAMPLERS
from tests.builders import lgssm
from tests.inference.smc.filter.bootstrap import bootstrap


def normal_init(num_particles: int):
    return lambda B: torch.randn(B, num_particles)


def ar1_step(t, x):
    """The compile tests' model step, drawing from torch's global generator (a
    ``torch.Generator`` argument would break Dynamo's graph at every draw)."""
    x = 0.9 * x + torch.randn(x.shape)
    return x, -0.5 * (x - 1.0) ** 2


def test_compiled_filter_equals_eager_under_a_fixed_generator():
    ys, A, Q, H, R, m0, P0 = lgssm(1, seed=5, steps=6)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        result = SMC(64, generator=g).filter(*bootstrap(ys, A, Q, H, R, m0, P0, 64, g), num_steps=6, batch_size=3)
        return result.log_evidence, result.particles

    compiled = torch.compile(run)
    (eager_z, eager_x), (compiled_z, compiled_x) = run(11), compiled(11)
    torch.testing.assert_close(compiled_z, eager_z)
    torch.testing.assert_close(compiled_x, eager_x)


@pytest.mark.parametrize("method", RESAMPLERS)
def test_a_compiled_run_of_more_steps_than_the_recompile_limit_is_one_graph(method):
    """With torch's global generator (a ``torch.Generator`` argument breaks Dynamo's graph at
    every draw) and no validation (its host read after the loop breaks it once), a run traces
    into one graph: one compile per configuration, not one per step (each step's frame would
    differ in the step number and fall back to eager past the limit)."""
    torch.manual_seed(0)
    steps = torch._dynamo.config.recompile_limit + 4
    smc = SMC(16, resample=method, ess_threshold=0.9, validate=False)
    explained = torch._dynamo.explain(lambda: smc.filter(normal_init(16), ar1_step, steps, 3).log_evidence)()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.slow  # inductor compiles the unrolled run, once per resampler
@pytest.mark.parametrize("method", RESAMPLERS)
def test_the_one_graph_run_under_inductor_equals_eager(method):
    """The graph a run with torch's global generator compiles to (no break) gives eager's
    answer exactly under inductor when inductor draws eager's random numbers."""
    from torch._inductor import config

    def run():
        result = SMC(32, resample=method, ess_threshold=0.9, validate=False).filter(normal_init(32), ar1_step, 10, 3)
        return result.log_evidence, result.particles, result.ancestors

    torch._dynamo.reset()
    with config.patch(fallback_random=True):
        torch.manual_seed(3)
        compiled = torch.compile(run)()
    torch.manual_seed(3)
    for got, expected in zip(compiled, run()):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_filters_of_several_particle_counts_compile_in_one_process():
    """Each particle count compiles once (the resampler's fixed-point shift is a function of
    N, so Dynamo specialises on it) and a count seen before reuses its graph."""
    torch._dynamo.reset()

    def run(start):  # the particle count comes from the input's shape
        smc = SMC(start.shape[1], ess_threshold=0.9, validate=False)
        return smc.filter(lambda B: start.clone(), ar1_step, 5, start.shape[0]).log_evidence

    compiled = torch.compile(run, backend="aot_eager")
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for count in (16, 40, 16):
        assert torch.isfinite(compiled(torch.randn(3, count))).all()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on every operator that reads a tensor's value on the host (.item(), bool(),
    .tolist() of a device tensor): on CUDA each is a synchronisation."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise AssertionError(f"host synchronisation: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", RESAMPLERS)
def test_filter_reads_nothing_on_the_host_per_step(method, monkeypatch):
    """no host sync in a filter step. With validate=False a run reads nothing on
    the host; with validate=True it reads once, after the last step."""
    g = torch.Generator().manual_seed(0)
    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(self.shape)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)

    def init(B):
        return torch.randn(B, 16, generator=g)

    def step(t, x):
        x = 0.9 * x + torch.randn(x.shape, generator=g)
        return x, -0.5 * (x - 1.0) ** 2

    with _NoHostSync():
        result = SMC(16, resample=method, ess_threshold=0.9, generator=g, validate=False).filter(init, step, 6, 3)
    assert reads == [] and bool(result.resampled.any())  # it did resample (read outside the mode)
    with _NoHostSync():
        SMC(16, resample=method, ess_threshold=0.9, generator=g).filter(init, step, 6, 3)
    assert len(reads) == 1
