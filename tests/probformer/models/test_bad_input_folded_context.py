"""FoldedContext takes a non-contiguous batch (a transposed or strided view, whose default
mask keeps its strides) as it takes its contiguous copy: it failed with a bare view error."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probformer


def model() -> probformer.FoldedContext:
    torch.manual_seed(0)
    config = probformer.FoldedContextConfig(
        vocab_size=11, width=8, heads=2, local_layers=1, global_layers=1, ffn_width=16, segment=3
    )
    return probformer.FoldedContext(config).eval()


MODEL = model()


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), segments=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_strided_batch_gives_the_logits_of_its_contiguous_copy(batch, segments, seed):
    tokens = torch.randint(0, 11, (batch, 6 * segments), generator=torch.Generator().manual_seed(seed))[:, ::2]
    assert not tokens.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(MODEL(tokens)[0], MODEL(tokens.contiguous())[0], rtol=0, atol=0)


def test_a_transposed_mask_is_read_as_its_contiguous_copy():
    tokens = torch.randint(0, 11, (2, 6))
    mask = torch.ones(6, 2, dtype=torch.bool).t()
    with torch.no_grad():
        torch.testing.assert_close(MODEL(tokens, mask)[0], MODEL(tokens)[0], rtol=0, atol=0)
