"""Message assembly (inference.mean_field.kernels.fused.message_assembly) equals the sum of
the padded parts written here."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.mean_field.kernels.fused.message_assembly import Part, assemble

pytestmark = pytest.mark.usefixtures("one_thread")


@settings(max_examples=30, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(1, 6), st.integers(0, 6), st.booleans()),
        min_size=1,
        max_size=6,
    )
)
def test_assemble_equals_the_sum_of_padded_parts(layout):
    """Each slot is the sum of its parts, zero elsewhere, in values and in gradients."""
    torch.manual_seed(len(layout))
    B, N, S, C, r = 2, 12, 4, 2, 3
    sources = [torch.randn(B, N, C, r, dtype=torch.float64) for _ in range(2)]
    weight = torch.rand(B, N, C, 1, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (*sources, weight)]
    parts, expected = [], torch.zeros(B, N, S, C, r, dtype=torch.float64)
    for index, (slot, row, length, source_row, weighted) in enumerate(layout):
        length = min(length, N - row, N - source_row)
        if length < 1:
            continue
        source = leaves[index % 2]
        parts.append(Part(slot, row, length, source, source_row, leaves[2] if weighted else None, source_row))
        value = source[:, source_row : source_row + length]
        if weighted:
            value = weight[:, source_row : source_row + length] * value
        expected = (
            expected
            + torch.nn.functional.pad(value, (0, 0, 0, 0, row, N - row - length))[:, :, None]
            * (torch.arange(S) == slot).to(value)[None, None, :, None, None]
        )
    if not parts:
        return
    got = assemble(parts, S, N)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    direction = torch.randn(B, N, S, C, r, dtype=torch.float64)
    ours = torch.autograd.grad((got * direction).sum(), leaves, allow_unused=True)
    theirs = torch.autograd.grad((expected * direction).sum(), leaves, allow_unused=True)
    for a, b in zip(ours, theirs, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
