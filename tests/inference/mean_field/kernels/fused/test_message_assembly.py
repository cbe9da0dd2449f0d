"""Message assembly (inference.mean_field.kernels.fused.message_assembly) equals the sum of
the padded parts written here."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.mean_field.kernels.fused.message_assembly import Part, assemble

pytestmark = pytest.mark.usefixtures("one_thread")


@settings(max_examples=40, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(1, 6), st.integers(0, 6), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    read=st.sampled_from(["messages", "labels", "both"]),
)
def test_assemble_equals_the_sum_of_padded_parts(layout, read):
    """Each slot is the sum of its parts, zero elsewhere, and with tables ``back`` the label
    message is sum_s slot_s back_s: in values and in gradients (of the sources, the weight
    and the tables), whichever of the two outputs the loss reads."""
    torch.manual_seed(len(layout))
    B, N, S, C, r, d = 2, 12, 4, 2, 3, 5
    sources = [torch.randn(B, N, C, r, dtype=torch.float64) for _ in range(2)]
    weight = torch.rand(B, N, C, 1, dtype=torch.float64)
    back = torch.randn(S, C * r, d, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (*sources, weight, back)]
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
    expected_labels = sum(expected[:, :, s].flatten(-2) @ back[s] for s in range(S))
    got, labels = assemble(parts, S, N, None if read == "messages" else back)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    direction = torch.randn(B, N, S, C, r, dtype=torch.float64)
    label_direction = torch.randn(B, N, d, dtype=torch.float64)
    if read == "messages":
        assert labels is None
        ours, theirs = (got * direction).sum(), (expected * direction).sum()
    else:
        torch.testing.assert_close(labels, expected_labels, atol=1e-12, rtol=1e-12)
        ours, theirs = (labels * label_direction).sum(), (expected_labels * label_direction).sum()
        if read == "both":
            ours, theirs = ours + (got * direction).sum(), theirs + (expected * direction).sum()
    ours = torch.autograd.grad(ours, leaves, allow_unused=True)
    theirs = torch.autograd.grad(theirs, leaves, allow_unused=True)
    for a, b in zip(ours, theirs, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
