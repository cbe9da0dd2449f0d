"""The flex kernel's block masks (inference.mean_field.kernels.flex_masks) cover exactly the
arcs of each head, by brute force."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import graphs
from inference.mean_field.kernels import flex_masks
from tests.builders import flex_batch as batch
from tests.builders import head_structure_of as structure_of

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the block masks the compiled kernel walks -------------------------------------


def dense_blocks(num_blocks, indices, num_columns):
    """``[B, H, rows, columns]`` bool from flex's ordered block lists."""
    B, H, rows = num_blocks.shape
    dense = torch.zeros(B, H, rows, num_columns, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for row in range(rows):
                dense[b, h, row, indices[b, h, row, : num_blocks[b, h, row]].long()] = True
    return dense


def as_elements(blocks, size, block):
    return blocks.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :size, :size]


def every_other_token(n: int) -> torch.Tensor:
    """A function of the length (``graphs.topology.from_callable``): its rows get a table each."""
    return ~torch.eye(n, dtype=torch.bool)


@pytest.mark.parametrize("block", [flex_masks.BLOCK, 64, 32])
@pytest.mark.parametrize(
    "topology, buckets, n, some_full",
    [
        ("full", 2, 400, True),
        ("full | root()", [2, 130], 520, True),
        ("causal", 0, 300, True),
        ("window(2)", 1, 200, False),
        ("window(1) | star(wrap=True)", 1, 300, False),
        (graphs.topology.from_callable(every_other_token), 2, 400, True),
    ],
    ids=str,
)
def test_block_masks_cover_exactly_the_arcs_of_each_head(topology, buckets, n, some_full, block):
    """What the compiled kernel attends to: full blocks whole, partial blocks through the
    mask_mod, nothing else. It must be head h's arcs, arcs of group h // C, in both the
    forward and the (transposed) reverse mask, and in the backward's column-major lists."""
    channels = 2
    structure, projections = batch(topology, buckets, n, channels)
    if some_full:  # padding only at the end: a block is full only where every sentence has all its nodes
        crf = graphs.CRF(vocab_size=5, labels=3, channels=channels, rank=3, topology=topology, gamma=buckets)
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, n - 3 :] = False
        structure = structure_of(crf, mask)
    K, N = projections[0].shape[2], structure.nodes.shape[1]
    forward, reverse = flex_masks.block_masks(structure, K, channels, block)
    head_group = torch.arange(channels * K) % K  # head h = c * K + k
    arcs = structure.arcs[:, None] & (structure.groups == head_group[:, None, None])  # [B, H, N, N]
    for block_mask, expected in ((forward, arcs), (reverse, arcs.transpose(-1, -2))):
        nb = block_mask.kv_indices.shape[-1]
        partial = dense_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, nb)
        full = dense_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nb)
        mask_mod = create_mask(block_mask.mask_mod, *expected.shape[:2], N, N, device="cpu")
        attended = as_elements(full, N, block) | (as_elements(partial, N, block) & mask_mod)
        assert torch.equal(attended, expected)
        assert full.any() == some_full  # the full-block path is exercised where blocks can be full
        assert block_mask.BLOCK_SIZE == (block, block)
        # the backward walks the same blocks column by column
        assert torch.equal(dense_blocks(block_mask.q_num_blocks, block_mask.q_indices, nb), partial.transpose(-1, -2))
        assert torch.equal(
            dense_blocks(block_mask.full_q_num_blocks, block_mask.full_q_indices, nb), full.transpose(-1, -2)
        )


@pytest.mark.parametrize("block", [0, 8, 48, 100, 128.0, True, "64"])
def test_a_block_size_other_than_a_power_of_two_of_at_least_16_is_refused(block):
    structure, projections = batch("full", 1, 20, 2)
    with pytest.raises(ValueError, match="block must be a power of two of at least 16"):
        flex_masks.block_masks(structure, projections[0].shape[2], 2, block)
