"""The reference Probabilistic Transformer iteration (pt-spec.md §2.2), restated
independently from the spec: dense per-group distance masks, -1e9 mask constants,
the head logits times d, heads-then-labels order, unnormalised output logits.
Dropout, damping and step sizes are the released configs' no-ops (p = 0, beta = 0,
alpha = 1)."""

import torch


def distance_masks(n: int, gamma: int, dists=None) -> torch.Tensor:
    """[2 (gamma + 1), n, n] 0/1: first half heads to the right at distance 1..gamma,
    >gamma; second half the same to the left (the transpose). ``dists``: the reference's
    cut points between buckets ("2, 4": {1}, {2, 3}, [4, inf)), gamma = len(dists)."""
    right = []
    for bucket in range(gamma + 1):
        m = torch.zeros(n, n)
        for i in range(n):
            for j in range(i + 1, n):
                of = min(j - i, gamma + 1) - 1 if dists is None else sum(1 for c in dists if c <= j - i)
                if of == bucket:
                    m[i, j] = 1
        right.append(m)
    return torch.stack(right + [m.T for m in right])


def reference_logits(
    embedding_rows,
    valid,
    U,
    V,
    iterations,
    d,
    damping_z=0.0,
    damping_h=0.0,
    stepsize_z=1.0,
    stepsize_h=1.0,
    dists=None,
):
    """embedding_rows [B, n, d] (S[w_i]), valid [B, n] 0/1, U/V [K, d, r, h].

    Damping and step sizes as the reference code has them (pt-spec.md §2.2): the logits are
    damped raw (M := beta M_prev + (1 - beta) new), the head cache starts as a tensor of
    ones and is stored after masking, P_z_prev is kept before the padding mask."""
    B, n, _ = embedding_rows.shape
    K = U.shape[0]
    gamma = K // 2 - 1
    dist = distance_masks(n, gamma, dists).to(embedding_rows.dtype)
    v = valid.to(embedding_rows.dtype)
    logits = embedding_rows * v[..., None]
    h = U.shape[-1]
    m_h_prev = torch.ones(B, h, n, n, dtype=embedding_rows.dtype)  # the code's initial cache
    p_z_prev = p_h_prev = None
    for t in range(iterations):
        p_z = torch.softmax(logits, -1)
        if t > 0:
            p_z = (1 - stepsize_z) * p_z_prev + stepsize_z * p_z
        p_z_prev = p_z
        p_z = p_z * v[..., None]
        A = torch.einsum("zia,karh->zkihr", p_z, U)  # dependent-side projections
        Bp = torch.einsum("zjb,kbrh->zkjhr", p_z, V)  # head-side projections
        F = torch.einsum("kij,zkihr,zkjhr->zhij", dist, A, Bp) * d
        F = damping_h * m_h_prev + (1 - damping_h) * F
        eye = torch.eye(n, dtype=F.dtype)
        F = F - 1e9 * eye
        pad = (1 - v)[:, None, :, None] + (1 - v)[:, None, None, :]
        F = torch.where(pad > 0, torch.full_like(F, -1e9), F)
        m_h_prev = F
        p_h = torch.softmax(F, -1)
        if t > 0:
            p_h = (1 - stepsize_h) * p_h_prev + stepsize_h * p_h
        p_h_prev = p_h
        from_head = torch.einsum("zhij,kij,karh,zkjhr->zia", p_h, dist, U, Bp)
        from_dependents = torch.einsum("zhji,kji,kbrh,zkjhr->zib", p_h, dist, V, A)
        new = embedding_rows * v[..., None] + from_head + from_dependents
        logits = damping_z * logits + (1 - damping_z) * new
    return logits
