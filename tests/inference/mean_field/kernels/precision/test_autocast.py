"""Head kernels under bfloat16 autocast compute in float32 (inference.mean_field.kernels.precision).

Oracle: the messages and log-normalisers of head_kernels' docstring, materialised here in
float64 from the same inputs. The inputs are bfloat16 numbers (held in float32), so rounding
the inputs costs nothing and any error is the kernel's own arithmetic. Under CPU autocast
each kernel must err no more than the fused kernel in float32 without autocast (plus a
sliver), with scores large enough for log-normalisers near 430, where bfloat16 arithmetic
inside a kernel errs by whole units.
"""

from dataclasses import replace

import pytest
import torch

import graphs
from inference.mean_field import engine as mean_field
from inference.mean_field.kernels import flex as flex_kernel
from inference.mean_field.kernels import head_kernels
from inference.mean_field.projections import back_project
from tests.builders import head_kernel_problem as problem
from tests.oracles import dense_head_messages as dense
from tests.oracles import relative_errors

pytestmark = pytest.mark.usefixtures("one_thread")


KERNELS = {
    "naive": head_kernels.naive,
    "fused": head_kernels.fused,
    "flex": flex_kernel.flex,
    "shared": head_kernels.naive,  # the naive kernel on one projection for every group: shared_heads
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernels_under_bf16_autocast_err_no_more_than_fused_float32(kernel):
    structure, projections = problem(kernel)
    expected = dense(*projections, 1.0, structure)
    assert float(expected[2].abs().max()) > 300  # log-normalisers in the hundreds
    baseline = relative_errors(head_kernels.fused(*projections, 1.0, structure), expected)
    own_float32 = relative_errors(KERNELS[kernel](*projections, 1.0, structure), expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = KERNELS[kernel](*projections, 1.0, structure)
    assert result.forward.dtype == torch.float32 and result.lse.dtype == torch.float32
    # measured: flex's eager reference errs up to ~3.6x the fused kernel in float32 (its reverse
    # messages); unguarded bfloat16 arithmetic errs by 1e-3 to 1 (test below)
    for ours, fused, own in zip(relative_errors(result, expected), baseline, own_float32):
        assert ours <= 4 * fused + 1e-6, (ours, fused)
        assert ours <= own + 1e-7, (ours, own)


@pytest.mark.parametrize("kernel", ["naive", "fused", "flex"])
def test_autocast_would_have_erred_without_the_guard(kernel):
    """The oracle can tell: the same kernels with autocast's bfloat16 arithmetic err by far more."""
    structure, projections = problem(kernel)
    expected = dense(*projections, 1.0, structure)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        raw = KERNELS[kernel].__wrapped__(*projections, 1.0, structure)
    assert max(relative_errors(raw, expected)) > 1e-3


def test_the_engine_under_autocast_matches_float32():
    """MeanField's head messages through kernel_choice: the same numbers with and without
    autocast from the same (bfloat16-valued) projections, for the kernels a CPU runs."""
    torch.manual_seed(1)
    crf = graphs.CRF(vocab_size=9, labels=4, channels=2, rank=4, topology="causal", gamma=2)
    engine = mean_field.MeanField(crf, iterations=2)
    tokens = torch.randint(0, 9, (2, 12))
    _, _, structure = engine.structure(tokens, None)
    N = structure.nodes.shape[1]
    projections = [(5.0 * torch.randn(2, N, crf.num_groups, 2, 4)).bfloat16().float() for _ in range(2)]
    for kernel in ("naive", "fused"):
        plain = engine.heads(*projections, *projections[::-1], structure, kernel)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = engine.heads(*projections, *projections[::-1], structure, kernel)
        for a, b in ((cast.forward, plain.forward), (cast.reverse, plain.reverse), (cast.lse, plain.lse)):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the fused kernel's own back-projection: float32 under autocast, and the messages' one
    tables = engine.gemm_tables()
    plain = engine.heads(*projections, *projections[::-1], structure, "fused", tables=tables)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = engine.heads(*projections, *projections[::-1], structure, "fused", tables=tables)
    expected = back_project(plain.stacked.double(), replace(tables, back=tables.back.double())).float()
    for message in (plain.label_message, cast.label_message):
        assert message.dtype == torch.float32
        torch.testing.assert_close(message, expected, atol=1e-4, rtol=1e-5)
