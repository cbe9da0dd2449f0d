"""The labels' marginal of the tempered target: heads and globals summed out in closed form.

Given the labels z, every head H_i^c and global G_i of p_beta ∝ q^(1 - beta) gamma^beta is
independent (``inference.smc.tempered.target``), so

    log p_beta(z) = (1 - beta) log q_z(z) + beta b(z)
                    + sum_{c, i has a head} log sum_j q_h[c, i, j]^(1 - beta) exp(beta T[k(i, j), c, z_i, z_j])
                    + sum_{real i} log sum_m q_g[i, m]^(1 - beta) exp(beta binary[m, z_i])      + const

with b(z) the unary, ``Pairwise`` and user log-potentials of the labels. At beta = 0 it is
log q_z(z) (q's rows are normalised), at beta = 1 the CRF's collapsed log-potential, whose
sum over z is log Z. Tempered SMC weighs the labels alone with it: the heads' and
globals' sampling noise never enters the weights (Rao-Blackwellisation; docs/benchmarks.md
has what it saves). The head terms cost O(C N^2) per particle:
``head_pass`` computes them for several betas from one gather of the scores, and draws
the heads at one of them.
"""

from __future__ import annotations

import torch

from inference.smc.tempered.target import TemperedTarget

__all__ = ["label_terms", "head_pass", "global_pass", "terms_at", "current_terms"]


# entries of one chunk of head logits [systems, P, C, N, N]: bounds the move's memory
CHUNK_ENTRIES = 2**22
# the head score of an arc the topology forbids: finite, so lerp never meets inf - inf, and
# beta >= MIN_BETA makes its weight exp(beta FORBIDDEN) exactly 0
FORBIDDEN = -1e30
MIN_BETA = 1e-20


def label_terms(target: TemperedTarget, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log q_z(z), b(z))``, each ``[S, P]`` float64: the labels' proposal and the unary,
    ``Pairwise`` and user log-potentials."""
    S, P, N = z.shape
    nodes = target.per_system(target.nodes)[:, None]
    unary = target.per_system(target.unary)[:, None].expand(S, P, N, -1).gather(-1, z[..., None]).squeeze(-1)
    potential = torch.where(nodes, unary, 0.0).double().sum(-1)
    for factor in [*target.pairwise, *target.user]:
        potential = potential + target.factor_log_potential(factor, z).double()
    log_qz = target.per_system(target.log_qz)[:, None].expand(S, P, N, -1).gather(-1, z[..., None]).squeeze(-1)
    return torch.where(nodes, log_qz, 0.0).double().sum(-1), potential


def _weight(beta: torch.Tensor, dims: int, dtype) -> torch.Tensor:

    return beta.to(dtype).reshape(-1, *([1] * dims)).clamp(min=MIN_BETA)


def _row_terms(logits, scores_minus_log_q, keep, derivative: bool, sample: bool, generator):
    """From one chunk's logits ``[..., k]`` (overwritten): the sum over kept rows of each
    row's log-normaliser ``[s, P]`` float64, optionally the sum of its beta-derivative
    (the rows' expectations of ``scores_minus_log_q``), optionally a draw per row."""
    largest = logits.amax(-1, keepdim=True)
    weights = logits.sub_(largest).exp_()
    drawn = slope = None
    if derivative:
        expectation = (weights * scores_minus_log_q).sum(-1)
    if sample:
        cumulative = weights.cumsum_(-1)
        total = cumulative[..., -1]
        u = torch.rand(total.shape + (1,), device=logits.device, dtype=logits.dtype, generator=generator)
        drawn = torch.searchsorted(cumulative, u.mul_(total[..., None])).squeeze(-1)
    else:
        total = weights.sum(-1)
    normaliser = torch.where(keep, largest.squeeze(-1) + total.log(), 0.0).double()
    normaliser = normaliser.flatten(2).sum(-1)
    if derivative:
        slope = torch.where(keep, expectation / total, 0.0).double().flatten(2).sum(-1)
    return normaliser, slope, drawn


def head_tables(target: TemperedTarget):
    """What the head sampler reads, built once per layout: ``rows [d, C, (K + 1) d]`` with
    ``rows[a, c, k d + b] = T[k, c, a, b]`` and a last block of -inf (the column of every arc
    the topology forbids, FORBIDDEN); ``columns [S, N, N]``, k(i, j) d on arcs and K d elsewhere;
    ``log_qh [S, N, C, N]`` (0 off the arcs: the -inf column rules them out)."""
    K, C, d, _ = target.table.shape
    forbidden = target.table.new_full((d, C, d), FORBIDDEN)
    rows = torch.cat([target.table.permute(2, 1, 0, 3).reshape(d, C, K * d), forbidden], -1)
    arcs = target.per_system(target.arcs)
    columns = torch.where(arcs, target.groups * d, K * d)
    log_qh = torch.where(arcs[:, None], target.per_system(target.log_qh), 0.0).permute(0, 2, 1, 3).contiguous()
    return rows, columns, log_qh


def head_pass(
    target: TemperedTarget, z, betas, sample: int | None = None, derivative: int | None = None, generator=None
):
    """For labels ``z [S, P, N]`` and inverse temperatures ``betas`` (a list of ``[S]``):
    ``(normalisers, slope, h)``: the head terms of log p_beta(z) for each beta (``[S, P]``
    float64), their beta-derivative at ``betas[derivative]`` (or None), heads ``[S, P, C, N]``
    drawn from p_beta(h | z) at ``betas[sample]`` (or None). A chunk of systems at a time."""

    S, P, N = z.shape
    C = target.table.shape[1]
    rows, columns, log_qh = target.cached("head_tables", lambda: head_tables(target))
    keep = target.per_system(target.has_head)[:, None, :, None]  # [S, 1, N, 1]: rows (i, c) that exist
    step = max(1, CHUNK_ENTRIES // max(1, P * C * N * N))
    normalisers, slopes, heads = [[] for _ in betas], [], []
    for start in range(0, S, step):
        part = slice(start, start + step)
        zs = z[part]
        s = zs.shape[0]
        index = (columns[part, None] + zs[:, :, None, :])[:, :, :, None, :].expand(s, P, N, C, N)
        scores = rows[zs].gather(-1, index)  # [s, P, N(i), C, N(j)]: T[k(i, j), c, z_i, z_j]
        difference = scores - log_qh[part, None] if derivative is not None else None
        for k, beta in enumerate(betas):
            logits = torch.lerp(log_qh[part, None], scores, _weight(beta[part], 4, scores.dtype))
            normaliser, slope, drawn = _row_terms(
                logits, difference, keep[part], derivative == k, sample == k, generator
            )
            normalisers[k].append(normaliser)
            if slope is not None:
                slopes.append(slope)
            if drawn is not None:
                heads.append(torch.where(keep[part], drawn, 0).transpose(-1, -2))  # [s, P, C, N]
    normalisers = [torch.cat(parts) for parts in normalisers]
    return normalisers, torch.cat(slopes) if slopes else None, torch.cat(heads) if heads else None


def global_pass(
    target: TemperedTarget, z, betas, sample: int | None = None, derivative: int | None = None, generator=None
):
    """``head_pass`` for the global variables: ``(normalisers, slope, g [S, P, n])``; zeros
    and None without global variables."""
    S, P, _ = z.shape
    if target.binary is None:
        zero = torch.zeros(S, P, dtype=torch.float64, device=z.device)
        return [zero for _ in betas], zero if derivative is not None else None, None
    n = target.mask.shape[1]
    keep = target.per_system(target.mask)[:, None, :]  # [S, 1, n]
    log_qg = torch.where(keep[..., None], target.per_system(target.log_qg)[:, None], 0.0)
    scores = target.binary.T[z[..., :n]]  # [S, P, n, G]
    difference = scores - log_qg if derivative is not None else None
    normalisers, slope, drawn = [], None, None
    for k, beta in enumerate(betas):
        logits = torch.lerp(log_qg.expand_as(scores), scores, _weight(beta, 3, scores.dtype))
        normaliser, own_slope, own_draw = _row_terms(logits, difference, keep, derivative == k, sample == k, generator)
        normalisers.append(normaliser)
        slope = own_slope if own_slope is not None else slope
        drawn = torch.where(keep, own_draw, 0) if own_draw is not None else drawn
    return normalisers, slope, drawn


def terms_at(target: TemperedTarget, z, beta, generator=None):
    """``(head terms, global terms, h, g)`` of labels ``z`` at ``beta``, the heads and
    globals drawn there."""
    heads, _, h = head_pass(target, z, [beta], sample=0, generator=generator)
    glob, _, g = global_pass(target, z, [beta], sample=0, generator=generator)
    return heads[0], glob[0], h, g


def current_terms(target: TemperedTarget, z, beta, following=None, generator=None):
    """``(terms, pending, slope)``: the head and global terms of labels ``z`` at ``beta``;
    with the schedule's ``following`` beta, ``pending`` = ``terms_at`` there (one pass, slope
    None); without it (an adaptive schedule), the beta-derivative of those terms (pending None)."""
    betas = [beta] if following is None else [beta, following]
    sample, derivative = (None, 0) if following is None else (1, None)
    heads, slope_h, h = head_pass(target, z, betas, sample, derivative, generator)
    glob, slope_g, g = global_pass(target, z, betas, sample, derivative, generator)
    current = heads[0] + glob[0]
    if following is None:
        return current, None, slope_h + slope_g
    return current, (heads[1], glob[1], h, g), None
