"""The block masks of the flex head kernel (``inference.mean_field.kernels.flex``), memory-linear.

Heads h = c * K + k (channel c, distance group k). A head's mask is "arc (q -> kv) exists
and falls in group k". The mask_mod computes it by index arithmetic from O(B N) data: the
topology's band (or its cached token table ``[n, n]``), the nodes ``[B, N]`` and the arcs
touching virtual nodes (``HeadStructure.border``); never from ``[B, N, N]`` arcs. Lengths
enter as 0-d tensors, not Python numbers, so a compiled kernel does not specialise on them.

A topology whose rows have token arcs of their own length (``HeadStructure.row_tokens``) is
read from its table per row ``[B, n, n]`` bool, O(B n^2) bytes: not memory-linear.

The block metadata (which blocks, 128 x 128 unless ``block_masks`` is given another size,
hold some arc of a group, which hold only arcs) comes in two steps. Per topology, length
and device, cached: a band's blocks are computed from its offsets alone (a block pair sees
one range of 2 * 128 - 1 offsets, ``O(K n / 128)`` work), another topology's from its token
table, one group at a time (a table per row: each row's blocks, per batch). Per batch, once
per ``HeadStructure`` (every iteration and the ELBO reuse it): a block is full only where
every node of its rows and columns exists in every sentence; padding leaves it partial,
where the mask_mod decides. Blocks touching a virtual node or the padded end are always
partial.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from graphs.distances import distance_groups
from inference.mean_field.kernels.structure import HeadStructure, band_limits

__all__ = ["BLOCK", "block_masks", "group_count"]

BLOCK = 128  # flex_attention's default sparse block size; the kernels' tiles must divide it
# topology-level block tables of non-band topologies, newest last: key -> (table, blocks)
_TABLE_BLOCKS: dict = {}
_TABLE_BLOCKS_KEPT = 8


def group_count(structure: HeadStructure) -> int:
    """K: both directions' buckets, plus the virtual group where there are virtual nodes."""
    return structure.virtual_group + (1 if structure.virtual else 0)


def _offset_group(offset, cuts: tuple[int, ...], gamma: int):
    """The distance group of token offset ``offset = head - dependent`` (a tensor): the rule of
    ``graphs.topology.distance_groups`` and ``head_kernels.fused``. Offset 0 (never an arc)
    gets a left group."""
    bucket = torch.zeros_like(offset)
    for cut in cuts:
        bucket = bucket + (offset.abs() >= cut).to(offset.dtype)
    return torch.where(offset > 0, bucket, bucket + (gamma + 1))


def _arc_rule(structure: HeadStructure):
    """``arc(b, q, kv)``: is q -> kv an arc of sentence b (bool tensors, index arithmetic only)."""
    nodes, table, band, m = structure.nodes, structure.token_arcs, structure.band, structure.virtual
    per_row = structure.row_tokens  # a table per row, [B, n, n]
    # a tensor, so no recompile per length; filled on the device (torch.tensor would copy a
    # host scalar over, a host synchronisation on CUDA, once per batch)
    n = torch.full((), structure.n, dtype=torch.int64, device=nodes.device)
    to_virtual, virtual_rows = structure.border

    def arc(b, q, kv):
        qc, kc = torch.minimum(q, n - 1), torch.minimum(kv, n - 1)
        if band is None:
            token = table[b, qc, kc] if per_row else table[qc, kc]
        else:
            token = kv != q
            if band[0] != float("inf"):
                token = token & (kv - q >= -int(band[0]))
            if band[1] != float("inf"):
                token = token & (kv - q <= int(band[1]))
        token = token & nodes[b, qc] & nodes[b, kc]
        if not m:
            return token
        vq, vk = (q - n).clamp(0, m - 1), (kv - n).clamp(0, m - 1)
        from_token = torch.where(kv < n, token, to_virtual[b, qc, vk])
        return torch.where(q < n, from_token, virtual_rows[b, vq, kv])

    return arc, n


def _mask_mods(structure: HeadStructure, groups: int):
    arc, n = _arc_rule(structure)
    # plain numbers in the closures, no structure: a compiled kernel guards on what they hold
    cuts, gamma, virtual_group = structure.bucket_cuts, structure.gamma, structure.virtual_group

    def group(q, kv):
        token_group = _offset_group(kv - q, cuts, gamma)
        return torch.where((q >= n) | (kv >= n), virtual_group, token_group)

    def forward_mod(b, h, q, kv):
        return arc(b, q, kv) & (group(q, kv) == h % groups)

    def reverse_mod(b, h, q, kv):  # head q gathers its dependents kv
        return arc(b, kv, q) & (group(kv, q) == h % groups)

    return forward_mod, reverse_mod


@functools.lru_cache(maxsize=32)
def _band_blocks(
    band: tuple[int, int], n: int, size: int, structure_key, device, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(some [K, nb, nb], every [K, nb, nb])`` bool for a band's token arcs: block pair
    (a, b) covers offsets block (b - a) + t, |t| < block, all of them when neither block is an
    edge one. Blocks touching the padded end or a virtual node: some, never every."""
    gamma, cuts, groups = structure_key
    nb = -(-size // block)
    diagonals = torch.arange(-(nb - 1), nb, device=device)[:, None] * block
    offsets = diagonals + torch.arange(-(block - 1), block, device=device)  # [2 nb - 1, 2 block - 1]
    legal = (offsets != 0) & (offsets >= -band[0]) & (offsets <= band[1]) & (offsets.abs() < n)
    in_group = _offset_group(offsets, cuts, gamma) == torch.arange(groups, device=device)[:, None, None]
    some_d, every_d = (legal & in_group).any(-1), (legal & in_group).all(-1)  # [K, 2 nb - 1]
    blocks = torch.arange(nb, device=device)
    index = blocks[None, :] - blocks[:, None] + nb - 1  # [nb, nb]: the diagonal of block pair (a, b)
    return _with_edges(some_d[:, index], every_d[:, index], n, size, groups - 1 if size > n else None, block)


def _with_edges(some, every, n: int, size: int, virtual_group: int | None, block: int):
    """Blocks holding a position >= n (a virtual node or the padded end) are partial for every
    group that can reach them, never full."""
    nb = some.shape[-1]
    edge = torch.arange(nb, device=some.device) * block + block > n  # blocks holding a position >= n
    touches = edge[:, None] | edge[None, :]
    every = every & ~touches
    if virtual_group is not None:  # arcs touching a virtual node: virtual group, edge blocks
        some = some.clone()
        some[virtual_group] = touches
    return some, every


def _table_blocks(structure: HeadStructure, groups: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from a token table (any topology), one group at a time; kept per table. A
    table per row (``[B, n, n]``, a batch's own: not kept) gives each row its blocks,
    ``[B, K, nb, nb]``."""
    table, n, size = structure.token_arcs, structure.n, structure.nodes.shape[1]
    if table.dim() == 3 or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        key = None
    else:
        key = (table.data_ptr(), tuple(table.shape), table.stride(), table.device, size, structure.gamma,
               structure.cuts, groups, block)  # fmt: skip
    cached = None if key is None else _TABLE_BLOCKS.get(key)  # a traced graph keeps no cache
    if cached is not None:
        return cached[1]
    nb = -(-size // block)
    token_groups = distance_groups(n, structure.gamma, 0, table.device, structure.cuts)
    some, every = [], []
    for k in range(groups):  # one [n, n] temporary at a time (one per row for a table per row), once per table
        arcs_k = F.pad((table & (token_groups == k)).to(torch.uint8), (0, nb * block - n, 0, nb * block - n))
        arcs_k = arcs_k.view(*table.shape[:-2], nb, block, nb, block)
        some.append(arcs_k.amax((-3, -1)) > 0)
        every.append(arcs_k.amin((-3, -1)) > 0)
    virtual_group = groups - 1 if size > n else None
    blocks = _with_edges(torch.stack(some), torch.stack(every), n, size, virtual_group, block)
    if table.dim() == 3:  # [K, B, nb, nb] -> each row's [B, K, nb, nb]
        return tuple(flags.transpose(0, 1) for flags in blocks)
    if key is None:
        return blocks
    _TABLE_BLOCKS[key] = (table, blocks)  # holds the table: its address is not reused while kept
    while len(_TABLE_BLOCKS) > _TABLE_BLOCKS_KEPT:
        _TABLE_BLOCKS.pop(next(iter(_TABLE_BLOCKS)))
    return blocks


def _topology_blocks(structure: HeadStructure, groups: int, block: int):
    size = structure.nodes.shape[1]
    if structure.band is not None:
        key = (structure.gamma, structure.bucket_cuts, groups)
        band = band_limits(structure.band, structure.n)
        traced = torch.compiler.is_compiling() or torch.compiler.is_exporting()  # a traced graph keeps no cache
        build = _band_blocks.__wrapped__ if traced else _band_blocks
        return build(band, structure.n, size, key, structure.nodes.device, block)
    return _table_blocks(structure, groups, block)


def _block_mask(some, every, channels: int, mask_mod, size: int, block: int) -> BlockMask:
    """A BlockMask over heads h = c * K + k from per-group block flags ``[1, K, nb, nb]`` (or
    ``[B, K, nb, nb]``, each row's own)."""

    def ordered(blocks: torch.Tensor):
        blocks = blocks.to(torch.int32).repeat(1, channels, 1, 1)
        indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
        return blocks.sum(-1, dtype=torch.int32), indices.to(torch.int32)

    partial_blocks, partial_indices = ordered(some & ~every)
    full_blocks, full_indices = ordered(every)
    return BlockMask.from_kv_blocks(
        partial_blocks, partial_indices, full_blocks, full_indices, block, mask_mod, (size, size)
    )


def block_masks(
    structure: HeadStructure, groups: int, channels: int, block: int = BLOCK
) -> tuple[BlockMask, BlockMask]:
    """The block masks of the forward attention (row i over its heads j) and of the reverse
    one (head i over its dependents j), of ``block`` x ``block`` blocks, built once per
    structure (``structure.cache``)."""
    if not (isinstance(block, int) and not isinstance(block, bool) and block >= 16 and block & (block - 1) == 0):
        raise ValueError(f"block must be a power of two of at least 16, got {block!r}")
    key = ("flex block masks", groups, channels, block)
    if key not in structure.cache:
        some, every = _topology_blocks(structure, groups, block)
        size = structure.nodes.shape[1]
        nb = some.shape[-1]
        # a block is full in every sentence only if all its nodes exist in every sentence
        nodes = F.pad(structure.nodes, (0, nb * block - size))
        whole = nodes.view(nodes.shape[0], nb, block).all(-1).all(0)  # [nb]
        every = every & whole[:, None] & whole[None, :]
        forward_mod, reverse_mod = _mask_mods(structure, groups)
        if some.dim() == 3:  # one set of blocks for every row (else each row's own, [B, K, nb, nb])
            some, every = some[None], every[None]
        structure.cache[key] = (
            _block_mask(some, every, channels, forward_mod, size, block),
            _block_mask(some.transpose(-1, -2), every.transpose(-1, -2), channels, reverse_mod, size, block),
        )
    return structure.cache[key]
