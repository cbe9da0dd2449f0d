"""Batched Gibbs moves of ``inference.TemperedSMC`` in torch: every sentence, replicate and
particle at once, and every variable of a block updated together.

The target at inverse temperature beta is p_beta ∝ q^(1 - beta) gamma^beta
(``inference.smc.tempered.target``). A sweep is two exact block updates, each leaving p_beta
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

from inference.smc.tempered.collapsed_weights import global_pass, head_pass
from inference.smc.tempered.target import TemperedTarget

__all__ = ["sweep", "sample_heads", "sample_globals", "update_labels", "label_logits"]


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
    """``h [S, P, C, N]`` drawn from p_beta(h | z) (``collapsed_weights.head_pass``: the logits
    ``beta T[k(i, j), c, z_i, z_j] + (1 - beta) log q_h`` by two gathers, the rows of z_i, then
    the column k(i, j) d + z_j of each)."""

    return head_pass(target, z, [beta], sample=0, generator=generator)[2]


def sample_rows(logits: torch.Tensor, generator=None) -> torch.Tensor:
    """One draw per row of ``logits [..., k]`` (overwritten), each row with a finite entry:
    the inverse CDF by binary search in the cumulative weights."""
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    cumulative = logits.cumsum_(-1)
    u = torch.rand(cumulative.shape[:-1] + (1,), device=logits.device, dtype=logits.dtype, generator=generator)
    # u < 1: the first cumulative weight >= u * total has a positive weight of its own
    return torch.searchsorted(cumulative, u.mul_(cumulative[..., -1:])).squeeze(-1)


def sample_globals(target: TemperedTarget, z, beta, generator=None):
    """``g [S, P, n]`` drawn from p_beta(g | z), or None without global variables."""

    return global_pass(target, z, [beta], sample=0, generator=generator)[2]


def _label_tables(target: TemperedTarget):
    """What the label messages read, built once per layout: ``outgoing [(K C + 1) d, d]``, row
    (k C + c) d + b holding T[k, c, :, b]; ``incoming``, row (k C + c) d + a holding T[k, c, a, :];
    each with a last block of zero rows (the rows of nodes without a head); the unary table
    and masked log q_z per system."""
    K, C, d, _ = target.table.shape
    zeros = target.table.new_zeros(d, d)
    outgoing = torch.cat([target.table.transpose(-1, -2).reshape(K * C * d, d), zeros])
    incoming = torch.cat([target.table.reshape(K * C * d, d), zeros])
    nodes = target.per_system(target.nodes)[..., None]
    log_qz = torch.where(nodes, target.per_system(target.log_qz), 0.0)
    return outgoing, incoming, target.per_system(target.unary), log_qz


def _arc_rows(target: TemperedTarget, h) -> torch.Tensor:
    """``[S, P, C, N]`` (k(i, h_i^c) C + c) d for every head, K C d where i has none."""
    K, C, d, _ = target.table.shape
    N = h.shape[-1]
    group = target.groups[torch.arange(N, device=h.device), h]
    rows = (group * C + torch.arange(C, device=h.device)[:, None]) * d
    return torch.where(target.per_system(target.has_head)[:, None, None], rows, K * C * d)


def _fast_messages(target: TemperedTarget, z, h, g, arc_rows=None) -> torch.Tensor:
    """``[S, P, N, d]`` log-potential of each label value of each node given every other
    variable, from the unary, ternary, global and ``Pairwise`` factors."""
    S, P, N = z.shape
    K, C, d, _ = target.table.shape
    outgoing, incoming, unary, _ = target.cached("label_tables", lambda: _label_tables(target))
    arc_rows = _arc_rows(target, h) if arc_rows is None else arc_rows
    head_label = z[:, :, None, :].expand_as(h).gather(-1, h)
    # from i's own heads: T[k(i, h_i^c), c, :, z_{h_i^c}]; from each j whose head is i: T[k, c, z_j, :]
    messages = F.embedding(arc_rows + head_label, outgoing).sum(2)
    received = F.embedding(arc_rows + z[:, :, None, :], incoming).reshape(S, P, C * N, d)
    messages = messages.scatter_add_(2, h.reshape(S, P, C * N, 1).expand(-1, -1, -1, d), received)
    messages = messages.add_(unary[:, None])
    n = target.mask.shape[1]
    if target.binary is not None:
        glob = torch.where(target.per_system(target.mask)[:, None, :, None], target.binary[g], 0.0)
        messages = messages + F.pad(glob, (0, 0, 0, N - n))
    if target.pairwise:
        one_hot = F.one_hot(z[..., :n], d).reshape(S * P, n, d)
        inputs, mask = target.per_particle(target.inputs, P), target.per_particle(target.mask, P)
        for factor in target.pairwise:  # its closed-form message at a one-hot q is the conditional
            # in the factor's own dtype (a half-precision CRF's target is float32)
            pair = factor.message(one_hot.to(factor.table.dtype), inputs, mask).to(messages.dtype)
            pair = pair.reshape(S, P, n, d)
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


def label_logits(target: TemperedTarget, z, h, g, beta, node: int | None = None, arc_rows=None) -> torch.Tensor:
    """``[S, P, N, d]`` log p_beta(Z_i = a | everything else) up to a constant per node.
    With user factors, their terms are added for ``node`` only (None: for every node, one
    at a time)."""
    messages = _fast_messages(target, z, h, g, arc_rows)
    if target.user:
        extra = torch.zeros_like(messages)
        for i in range(z.shape[-1]) if node is None else [node]:
            extra[:, :, i] = _user_messages(target, z, i).to(messages.dtype)
        messages = messages + extra
    log_qz = target.cached("label_tables", lambda: _label_tables(target))[3]
    return torch.lerp(log_qz[:, None], messages, _column(beta, 3, messages.dtype))


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
            z = torch.where(chosen, sample_rows(label_logits(target, z, h, g, beta, node=i), generator), z)
        return z
    priority = torch.rand(S, P, N, device=z.device, generator=generator)
    waiting = nodes.clone()
    arc_rows = _arc_rows(target, h)  # the heads stay fixed while the labels move
    for _ in range(rounds):
        active = torch.where(waiting, priority, -1.0)
        chosen = waiting & (priority > _neighbour_priority(target, active, h))
        drawn = sample_rows(label_logits(target, z, h, g, beta, arc_rows=arc_rows), generator)
        z = torch.where(chosen, drawn, z)
        waiting = waiting & ~chosen
    return z
