"""``CRF.ternary_tensor(dtype)`` sums the potentials in a floating dtype: an integer dtype
truncated every potential silently, and text failed inside ``Tensor.to``."""

from __future__ import annotations

import pytest
import torch

import graphs


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, "float", float, 5])
def test_a_dtype_that_is_not_floating_is_refused_by_name(dtype):
    crf = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=2)
    with pytest.raises(TypeError, match=r"dtype must be None or a floating torch.dtype"):
        crf.ternary_tensor(dtype)


@pytest.mark.parametrize("dtype", [None, torch.float64, torch.float16, torch.bfloat16])
def test_floating_dtypes_sum_the_same_potentials(dtype):
    torch.manual_seed(0)
    crf = graphs.CRF(vocab_size=5, labels=3, channels=2, rank=2)
    table = crf.ternary_tensor(dtype)
    assert table.dtype == (dtype or torch.float32) and table.shape == (8, 2, 3, 3)
    torch.testing.assert_close(table.double(), crf.ternary_tensor(torch.float64), rtol=1e-2, atol=1e-2)
