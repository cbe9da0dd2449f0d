"""The far attentions read only the keys a topology lets a row reach (``KeySpan``): a band
for ``window(w)``, the segment and the one before (or after, transposed) for
``segments(l)``. Checked against answers written here: the masked softmax from its
definition (values, lse and every gradient, float64), the naive kernel on each topology with
random padding (values and gradients), and the key slices against the arcs by brute force.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.mean_field.kernels.fused import far_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def definition(q, k, v, key_bias, scale, shift, side, token_mask):
    """Row i over keys j <= i - shift (left) or j >= i + shift (right) with token_mask[i, j]
    and a key bias above ``ABSENT`` (not padding): outputs (0 for a row with no key), lse and
    which rows have a key."""
    n = q.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = ((j <= i - shift) if side == "left" else (j >= i + shift)) & token_mask
    allowed = allowed & (key_bias > far_attention.ABSENT / 2).permute(0, 2, 1)[:, :, None, :]
    scores = scale * torch.einsum("bicr,bjcr->bcij", q, k) + key_bias.permute(0, 2, 1)[:, :, None, :]
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = scores.logsumexp(-1)
    probs = torch.where(allowed, (scores - lse[..., None]).exp(), 0.0)
    return torch.einsum("bcij,bjcr->bicr", probs, v), lse, allowed.any(-1)


def span_mask(n: int, span: far_attention.KeySpan) -> torch.Tensor:
    """``[n, n]`` bool: the pairs (i, j) the span allows, by its definition."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    inside = (i - j).abs() <= span.width if span.width != math.inf else torch.ones(n, n, dtype=torch.bool)
    if span.segment is not None:
        gap = j // span.segment - i // span.segment
        inside = inside & (gap >= -span.before) & (gap <= span.after)
    return inside


spans = st.builds(
    lambda width, segment, before: far_attention.KeySpan(
        width=math.inf if width is None else width,
        segment=segment,
        before=before if segment is not None else 0,
        after=1 - before if segment is not None else 0,
    ),
    st.one_of(st.none(), st.integers(1, 40)),
    st.one_of(st.none(), st.integers(1, 50)),
    st.integers(0, 1),
)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 140),
    shift=st.integers(1, 4),
    side=st.sampled_from(["left", "right"]),
    span=spans,
    density=st.floats(0.3, 1.0),
    padded=st.integers(0, 30),
    seed=st.integers(0, 2**16),
)
def test_far_attention_in_a_span_equals_its_definition(n, shift, side, span, density, padded, seed):
    """Random arcs inside a random span, padding keys: outputs, lse and the gradients of q, k,
    v and the key bias equal the masked softmax's, to float64 round-off."""
    generator = torch.Generator().manual_seed(seed)
    B, C, r = 2, 2, 3
    q, k, v = (2 * torch.randn(B, n, C, r, dtype=torch.float64, generator=generator) for _ in range(3))
    key_bias = torch.randn(B, n, C, dtype=torch.float64, generator=generator)
    key_bias[1, n - min(padded, n - 1) :] = far_attention.ABSENT
    token_mask = (torch.rand(n, n, generator=generator) < density) & span_mask(n, span)
    leaves = [t.requires_grad_() for t in (q, k, v, key_bias)]
    out, lse, has_key = definition(*leaves, 0.7, shift, side, token_mask)
    d_out = torch.randn(out.shape, dtype=out.dtype, generator=generator)
    d_lse = torch.randn(lse.shape, dtype=lse.dtype, generator=generator)

    def outputs_and_gradients(out, lse):
        # a row with no key: neither compared nor differentiated (the kernel weighs it by 0)
        out = torch.where(has_key.transpose(1, 2)[..., None], out, 0.0)
        lse = torch.where(has_key, lse, 0.0)
        loss = (out * d_out).sum() + (lse * d_lse).sum()
        return [out, lse, *torch.autograd.grad(loss, leaves)]

    expected = outputs_and_gradients(out, lse)
    ours = far_attention.far_attention(*leaves, 0.7, shift, side, token_mask, span=span)
    # a row with no key has an lse far below any real score (the kernel's merge drops it)
    assert (ours[1][~has_key] <= far_attention.MASKED / 2).all() and ours[0].isfinite().all()
    got = outputs_and_gradients(*ours)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 400), shift=st.integers(1, 4), side=st.sampled_from(["left", "right"]), span=spans)
def test_each_block_reads_its_rows_keys_and_little_else(n, shift, side, span):
    """Every arc (i, j) inside the span lies in the key slice of i's block, and a bounded span's
    block reads at most its rows plus the span's reach (plus the sinks)."""
    mask = span_mask(n, span)
    blocks = far_attention._blocks(n, shift, side, mask, torch.float64, torch.device("cpu"), span)
    covered = torch.zeros(n, dtype=torch.bool)
    for rows, keys, _ in blocks:
        covered[rows] = True
        i, j = torch.arange(rows.start, rows.stop)[:, None], torch.arange(n)[None, :]
        arcs = mask[rows] & ((j <= i - shift) if side == "left" else (j >= i + shift))
        augmented = j + shift if side == "left" else j  # where token j sits among the keys
        inside = (augmented >= keys.start) & (augmented < keys.stop)
        assert not (arcs & ~inside).any()
        reach = min(span.width, 2 * span.segment if span.segment is not None else math.inf)
        if reach != math.inf:
            assert keys.stop - keys.start <= (rows.stop - rows.start) + 2 * reach + shift
    assert covered.all()


def far_reference(q, k, v, key_bias, scale, shift, side, token_mask):
    """The definition: row i over keys j <= i - shift (left) or j >= i + shift (right), and
    token_mask[i, j], and not absent (a key bias of ``ABSENT``: padding); rows with no key
    get out = 0 (their lse is not compared)."""
    n = q.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i - shift) if side == "left" else (j >= i + shift)
    if token_mask is not None:  # one table, or one per row [B, n, n]
        allowed = allowed & (token_mask if token_mask.dim() == 2 else token_mask[:, None])
    allowed = allowed & (key_bias > far_attention.ABSENT / 2).permute(0, 2, 1)[:, :, None, :]  # [B, C, n, n]
    scores = scale * torch.einsum("bicr,bjcr->bcij", q, k) + key_bias.permute(0, 2, 1)[:, :, None, :]
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = scores.logsumexp(-1)
    probs = torch.where(allowed, (scores - lse[..., None]).exp(), 0.0)
    return torch.einsum("bcij,bjcr->bicr", probs, v), lse, allowed.any(-1)


def values_and_gradients(fn, tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse, has_key = fn(*leaves)
    generator = torch.Generator().manual_seed(1)
    d_out = torch.randn(out.shape, generator=generator, dtype=out.dtype)
    d_lse = torch.randn(lse.shape, generator=generator, dtype=lse.dtype)
    lse = torch.where(has_key, lse, 0.0)  # a row with no key: its lse is the sinks', not compared
    loss = (out * d_out).sum() + (lse * d_lse).sum()
    return [out, lse, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("native", [False, True], ids=["blocks", "op's causal mode"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "token mask"])
@pytest.mark.parametrize("n, shift", [(3, 4), (9, 1), (150, 4), (200, 2)])
def test_far_attention_equals_its_definition(native, side, masked, n, shift, monkeypatch):
    if native:  # small n through the op's causal mode (masked sides always take the blocks)
        monkeypatch.setattr(far_attention, "NATIVE_CAUSAL_FROM", 1)
    torch.manual_seed(n + shift)
    B, C, r = 2, 2, 3
    q, k, v = (2 * torch.randn(B, n, C, r, dtype=torch.float64) for _ in range(3))
    key_bias = torch.randn(B, n, C, dtype=torch.float64)
    key_bias[1, n // 2 :] = far_attention.ABSENT  # padding keys
    token_mask = torch.rand(n, n) < 0.6 if masked else None
    has_key = far_reference(q, k, v, key_bias, 0.7, shift, side, token_mask)[2]

    def ours(*t, flash):
        out, lse = far_attention.far_attention(*t, 0.7, shift, side, token_mask, flash=flash)
        return out, lse, has_key

    def reference(*t):
        return far_reference(*t, 0.7, shift, side, token_mask)

    expected = values_and_gradients(reference, [q, k, v, key_bias])
    for flash in (True, False):  # the CPU op and the materialised path of other devices
        got = values_and_gradients(lambda *t, f=flash: ours(*t, flash=f), [q, k, v, key_bias])
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("n, shift", [(3, 4), (9, 1), (150, 4)])
def test_far_attention_with_a_mask_per_row_equals_its_definition_and_each_row_alone(side, n, shift):
    """A token mask per row ``[B, n, n]``: each block's mask made per row where it is read,
    forward and backward. Values and gradients equal the definition's, and each row's equal
    that row run alone with its own table ``[n, n]`` (the path of one table for the batch)."""
    torch.manual_seed(n + shift)
    B, C, r = 3, 2, 3
    q, k, v = (2 * torch.randn(B, n, C, r, dtype=torch.float64) for _ in range(3))
    key_bias = torch.randn(B, n, C, dtype=torch.float64)
    key_bias[1, n // 2 :] = far_attention.ABSENT  # padding keys
    token_mask = torch.rand(B, n, n) < torch.tensor([0.2, 0.6, 0.9])[:, None, None]
    has_key = far_reference(q, k, v, key_bias, 0.7, shift, side, token_mask)[2]

    def ours(*t, mask=token_mask, flash=True, with_key=has_key):
        return *far_attention.far_attention(*t, 0.7, shift, side, mask, flash=flash), with_key

    expected = values_and_gradients(lambda *t: far_reference(*t, 0.7, shift, side, token_mask), [q, k, v, key_bias])
    for flash in (True, False):
        got = values_and_gradients(lambda *t, f=flash: ours(*t, flash=f), [q, k, v, key_bias])
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    # the lse and gradients of row b alone are those of its own function: compared as values only
    batched = far_attention.far_attention(q, k, v, key_bias, 0.7, shift, side, token_mask)
    for b in range(B):
        row = (t[b : b + 1] for t in (q, k, v, key_bias))
        alone = far_attention.far_attention(*row, 0.7, shift, side, token_mask[b])
        keyed = has_key[b : b + 1]
        torch.testing.assert_close(batched[0][b : b + 1], alone[0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(batched[1][b : b + 1][keyed], alone[1][keyed], atol=1e-12, rtol=1e-12)


def test_the_blocks_of_a_mask_per_row_hold_no_mask_until_read():
    """A batch's own masks are neither kept in the cache of tables nor built ahead: each block
    holds the way to make its ``[B, 1, rows, keys]`` mask."""
    n, B = 150, 2
    token_mask = torch.rand(B, n, n) < 0.5
    kept = len(far_attention._BLOCKS)
    blocks = far_attention._blocks(n, 2, "left", token_mask, torch.float64, torch.device("cpu"))
    assert len(far_attention._BLOCKS) == kept and len(blocks) > 1
    for rows, keys, mask in blocks:
        assert not isinstance(mask, torch.Tensor)
        made = far_attention._mask_of(mask)
        assert made.shape == (B, 1, rows.stop - rows.start, keys.stop - keys.start)


def test_far_attention_without_the_op_equals_its_definition():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 80, 2, 3, dtype=torch.float64) for _ in range(3))
    key_bias = torch.randn(2, 80, 2, dtype=torch.float64)
    for side in ("left", "right"):
        has_key = far_reference(q, k, v, key_bias, 1.3, 3, side, None)[2]
        got = values_and_gradients(
            lambda *t, s=side, h=has_key: (*far_attention.far_attention(*t, 1.3, 3, s, None, flash=False), h),
            [q, k, v, key_bias],
        )
        expected = values_and_gradients(lambda *t, s=side: far_reference(*t, 1.3, 3, s, None), [q, k, v, key_bias])
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_far_attention_refuses_an_unknown_side():
    x = torch.zeros(1, 4, 1, 2)
    with pytest.raises(ValueError, match="side must be 'left' or 'right'"):
        far_attention.far_attention(x, x, x, x[..., 0], 1.0, 2, "up")
