"""Batched Gibbs moves of ``inference.TemperedSMC`` in torch: every sentence, replicate and
particle at once, and every variable of a block updated together.

The target at inverse temperature beta is p_beta ∝ q^(1 - beta) gamma^beta
(``inference.tempered_target``). A sweep is two exact block updates, each leaving p_beta
invariant:

1. heads and globals given the labels: every H_i^c and G_i is conditionally independent
   given z, so all are drawn at once from
   ``log p(H_i^c = j | z) = beta T[k(i, j), c, z_i, z_j] + (1 - beta) log q_h[c, i, j] + const``
   (and likewise for G_i with ``binary[m, z_i]``);
2. labels given the heads and globals: Z_i and Z_j are conditionally independent unless
   an arc joins them (a chosen head i -> h_i^c, or a ``Pairwise`` arc). The labels are
   updated in rounds over a random colouring of that graph (Jones and Plassmann): each
   node draws a priority, and a round updates, all at once, every node not yet updated
   whose priority beats those of its neighbours not yet updated (an independent set).
   The sets depend on the priorities and the heads alone, never on z, so each round is an
   exact block update; a fixed number of rounds (``rounds``) keeps the loop free of host
   reads (nodes left over wait for the next sweep). A user factor (its ``log_potential``
   alone) couples every label: the labels are then updated one node at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.tempered_target import TemperedTarget, sample_categorical

__all__ = ["sweep", "sample_heads", "sample_globals", "update_labels", "label_logits"]

# entries of one chunk of head logits [systems, P, C, N, N]: bounds the move's memory
CHUNK_ENTRIES = 2**22


def _column(beta: torch.Tensor, dims: int, dtype) -> torch.Tensor:
    """``[S]`` as ``[S, 1, ..., 1]`` with ``dims`` trailing ones."""
    return beta.to(dtype).reshape(-1, *([1] * dims))


def sweep(target: TemperedTarget, z, h, g, beta, rounds: int, generator=None):
    """One Gibbs sweep at inverse temperatures ``beta [S]``: heads and globals, then labels."""
    h = sample_heads(target, z, beta, generator)
    g = sample_globals(target, z, beta, generator)
    z = update_labels(target, z, h, g, beta, rounds, generator)
    return z, h, g


def sample_heads(target: TemperedTarget, z, beta, generator=None) -> torch.Tensor:
    """``h [S, P, C, N]`` drawn from p_beta(h | z), a chunk of systems at a time."""
    S, P, N = z.shape
    K, C, d, _ = target.table.shape
    # the flat index of T[k(i, j), c, 0, 0] for every (c, i, j); z_i d + z_j is added per particle
    base = (target.groups[None] * C + torch.arange(C, device=z.device)[:, None, None]) * (d * d)  # [C, N, N]
    arcs = target.per_system(target.arcs)
    log_qh = torch.where(arcs[:, None], target.per_system(target.log_qh), 0.0)
    has_head = target.per_system(target.has_head)
    flat_table = target.table.reshape(-1)
    step = max(1, CHUNK_ENTRIES // max(1, P * C * N * N))
    heads = []
    for start in range(0, S, step):
        part = slice(start, start + step)
        zs = z[part]
        index = base + (zs[:, :, None, :, None] * d + zs[:, :, None, None, :])  # [s, P, C, N, N]
        b = _column(beta[part], 4, flat_table.dtype)
        logits = b * flat_table[index] + (1 - b) * log_qh[part, None]
        logits = logits.masked_fill(~arcs[part, None, None], float("-inf"))
        drawn = sample_categorical(logits, generator)
        heads.append(torch.where(has_head[part, None, None], drawn, 0))
    return torch.cat(heads)


def sample_globals(target: TemperedTarget, z, beta, generator=None):
    """``g [S, P, n]`` drawn from p_beta(g | z), or None without global variables."""
    if target.binary is None:
        return None
    n = target.mask.shape[1]
    mask = target.per_system(target.mask)
    log_qg = torch.where(mask[..., None], target.per_system(target.log_qg), 0.0)
    b = _column(beta, 3, target.binary.dtype)
    logits = b * target.binary.T[z[..., :n]] + (1 - b) * log_qg[:, None]
    return torch.where(mask[:, None], sample_categorical(logits, generator), 0)


def _fast_messages(target: TemperedTarget, z, h, g) -> torch.Tensor:
    """``[S, P, N, d]`` log-potential of each label value of each node given every other
    variable, from the unary, ternary, global and ``Pairwise`` factors."""
    S, P, N = z.shape
    K, C, d, _ = target.table.shape
    has_head = target.per_system(target.has_head)[:, None, None, :, None]  # [S, 1, 1, N, 1]
    channel = torch.arange(C, device=z.device)[:, None, None]
    labels = torch.arange(d, device=z.device)
    group = target.groups[torch.arange(N, device=z.device), h]  # [S, P, C, N]: k(i, h_i^c)
    head_label = z[:, :, None, :].expand_as(h).gather(-1, h)
    row = (group[..., None] * C + channel) * d  # [S, P, C, N, 1]
    # from i's own heads: T[k, c, a, z_{h_i^c}] over a; T transposed so a runs fastest
    outgoing = target.table.transpose(-1, -2).reshape(-1)[(row + head_label[..., None]) * d + labels]
    messages = torch.where(has_head, outgoing, 0.0).sum(2)
    # from the nodes j that chose i: T[k(j, i), c, z_j, a], added at i = h_j^c
    incoming = target.table.reshape(-1)[(row + z[:, :, None, :, None]) * d + labels]
    incoming = torch.where(has_head, incoming, 0.0).reshape(S, P, C * N, d)
    messages = messages.scatter_add(2, h.reshape(S, P, C * N, 1).expand(-1, -1, -1, d), incoming)
    messages = messages + target.per_system(target.unary)[:, None]
    n = target.mask.shape[1]
    if target.binary is not None:
        glob = torch.where(target.per_system(target.mask)[:, None, :, None], target.binary[g], 0.0)
        messages = messages + F.pad(glob, (0, 0, 0, N - n))
    if target.pairwise:
        one_hot = F.one_hot(z[..., :n], d).to(messages.dtype).reshape(S * P, n, d)
        inputs, mask = target.per_particle(target.inputs, P), target.per_particle(target.mask, P)
        for factor in target.pairwise:  # its closed-form message at a one-hot q is the conditional
            pair = factor.message(one_hot, inputs, mask).reshape(S, P, n, d)
            messages = messages + F.pad(pair, (0, 0, 0, N - n))
    return messages


def _user_messages(target: TemperedTarget, z, node: int) -> torch.Tensor:
    """``[S, P, d]`` the user factors' log-potential of each value of ``node``'s label."""
    d = target.table.shape[2]
    values = []
    for a in range(d):
        trial = z.clone()
        trial[..., node] = a
        values.append(sum(target.factor_log_potential(f, trial) for f in target.user))
    return torch.stack(values, -1)


def label_logits(target: TemperedTarget, z, h, g, beta, node: int | None = None) -> torch.Tensor:
    """``[S, P, N, d]`` log p_beta(Z_i = a | everything else) up to a constant per node.
    With user factors, their terms are added for ``node`` only (None: for every node, one
    at a time)."""
    messages = _fast_messages(target, z, h, g)
    if target.user:
        extra = torch.zeros_like(messages)
        for i in range(z.shape[-1]) if node is None else [node]:
            extra[:, :, i] = _user_messages(target, z, i).to(messages.dtype)
        messages = messages + extra
    nodes = target.per_system(target.nodes)[..., None]
    log_qz = torch.where(nodes, target.per_system(target.log_qz), 0.0)
    b = _column(beta, 3, messages.dtype)
    return b * messages + (1 - b) * log_qz[:, None]


def _neighbour_priority(target: TemperedTarget, priority, h) -> torch.Tensor:
    """``[S, P, N]`` the largest priority among each node's neighbours (-1: none): its own
    heads, the nodes whose head it is, and its ``Pairwise`` arcs."""
    S, P, N = priority.shape
    C = h.shape[2]
    has_head = target.per_system(target.has_head)[:, None, None, :].expand_as(h)
    from_heads = priority[:, :, None, :].expand_as(h).gather(-1, h)
    best = torch.where(has_head, from_heads, -1.0).amax(2)
    dependents = torch.where(has_head, priority[:, :, None, :].expand_as(h), -1.0).reshape(S, P, C * N)
    best = best.scatter_reduce(2, h.reshape(S, P, C * N), dependents, "amax")
    if target.pairwise_adjacency is not None:
        n = target.mask.shape[1]
        adjacent = target.per_system(target.pairwise_adjacency)[:, None]  # [S, 1, n, n]
        pair = torch.where(adjacent, priority[:, :, None, :n], -1.0).amax(-1)
        best = torch.maximum(best, F.pad(pair, (0, N - n), value=-1.0))
    return best


def update_labels(target: TemperedTarget, z, h, g, beta, rounds: int, generator=None) -> torch.Tensor:
    """``z [S, P, N]`` after ``rounds`` rounds of block updates on independent sets (one node
    per round, every node in turn, with user factors)."""
    S, P, N = z.shape
    nodes = target.per_system(target.nodes)[:, None].expand(S, P, N)
    if target.user:
        for i in range(N):
            chosen = nodes & (torch.arange(N, device=z.device) == i)
            z = torch.where(chosen, sample_categorical(label_logits(target, z, h, g, beta, node=i), generator), z)
        return z
    priority = torch.rand(S, P, N, device=z.device, generator=generator)
    waiting = nodes.clone()
    for _ in range(rounds):
        active = torch.where(waiting, priority, -1.0)
        chosen = waiting & (priority > _neighbour_priority(target, active, h))
        z = torch.where(chosen, sample_categorical(label_logits(target, z, h, g, beta), generator), z)
        waiting = waiting & ~chosen
    return z
