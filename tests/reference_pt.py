"""The reference Probabilistic Transformer iteration (pt-spec.md §2.2), restated
independently from the spec: dense per-group distance masks, -1e9 mask constants,
the head logits times d, heads-then-labels order, unnormalised output logits.
Dropout, damping and step sizes are the released configs' no-ops (p = 0, beta = 0,
alpha = 1)."""

import torch


def distance_masks(n: int, gamma: int) -> torch.Tensor:
    """[2 (gamma + 1), n, n] 0/1: first half heads to the right at distance 1..gamma,
    >gamma; second half the same to the left (the transpose)."""
    right = []
    for bucket in range(gamma + 1):
        m = torch.zeros(n, n)
        for i in range(n):
            for j in range(i + 1, n):
                if min(j - i, gamma + 1) - 1 == bucket:
                    m[i, j] = 1
        right.append(m)
    return torch.stack(right + [m.T for m in right])


def reference_logits(embedding_rows, valid, U, V, iterations, d):
    """embedding_rows [B, n, d] (S[w_i]), valid [B, n] 0/1, U/V [K, d, r, h]."""
    B, n, _ = embedding_rows.shape
    K = U.shape[0]
    gamma = K // 2 - 1
    dist = distance_masks(n, gamma).to(embedding_rows.dtype)
    v = valid.to(embedding_rows.dtype)
    logits = embedding_rows * v[..., None]
    for _ in range(iterations):
        p_z = torch.softmax(logits, -1) * v[..., None]
        A = torch.einsum("zia,karh->zkihr", p_z, U)  # dependent-side projections
        Bp = torch.einsum("zjb,kbrh->zkjhr", p_z, V)  # head-side projections
        F = torch.einsum("kij,zkihr,zkjhr->zhij", dist, A, Bp) * d
        eye = torch.eye(n, dtype=F.dtype)
        F = F - 1e9 * eye
        pad = (1 - v)[:, None, :, None] + (1 - v)[:, None, None, :]
        F = torch.where(pad > 0, torch.full_like(F, -1e9), F)
        p_h = torch.softmax(F, -1)
        from_head = torch.einsum("zhij,kij,karh,zkjhr->zia", p_h, dist, U, Bp)
        from_dependents = torch.einsum("zhji,kji,kbrh,zkjhr->zib", p_h, dist, V, A)
        logits = embedding_rows * v[..., None] + from_head + from_dependents
    return logits
