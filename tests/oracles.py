"""Independent brute-force oracles, written from the maths in DESIGN.md, not from
the library: they read only the raw parameters (unary, ternary_u/v, binary) and
the topology's arc mask, and recompute distance groups and potentials themselves.
"""

import itertools
import math

import torch


def buckets(crf) -> tuple:
    """``(gamma, cuts)`` of a CRF for ``group_of``."""
    return crf.gamma, crf.distance_cuts


def group_of(i: int, j: int, n: int, gamma: int, cuts=None) -> int:
    """Distance group of dependent i and head j (virtual nodes are >= n). With ``cuts``
    (distance buckets' cut points), the bucket of |j - i| is the number of cuts <= it."""
    if i >= n or j >= n:
        return 2 * (gamma + 1)
    delta = j - i
    if cuts is not None and tuple(cuts) != tuple(range(2, gamma + 2)):
        bucket = len([c for c in cuts if c <= abs(delta)])
        return bucket if delta > 0 else gamma + 1 + bucket
    a = min(abs(delta), gamma + 1)
    return a - 1 if delta > 0 else gamma + a


def _tables(crf):
    u = crf.ternary_u.detach().double()
    v = crf.ternary_v.detach().double()
    T = torch.einsum("kcar,kcbr->kcab", u, v)
    S = crf.unary.detach().double()
    Bm = crf.binary.detach().double() if crf.global_labels else None
    return S, T, Bm


def arcs_of(crf, n, row_mask):
    """Legal (i, j) arcs for one sentence: topology arcs between existing nodes. The
    topology is data (its per-row arcs, built for the sentence's real length, are checked
    against their own oracle in tests/graphs/test_topology.py)."""
    N = crf.topology.num_nodes(n)
    topo = crf.topology.arcs(torch.tensor([[bool(m) for m in row_mask]]))[0]
    exists = [bool(row_mask[i]) if i < n else True for i in range(N)]
    return [[j for j in range(N) if topo[i, j] and exists[i] and exists[j]] for i in range(N)], exists


def _label_terms(crf, tokens_row, mask_row, z):
    """For a labelling z of all nodes: the unary score, and per (c, i) the list of
    log phi(H_i^c = j, z_i, z_j) over legal j (empty: no head variable)."""
    S, T, Bm = _tables(crf)
    n = len(tokens_row)
    heads, exists = arcs_of(crf, n, mask_row)
    score = sum(S[tokens_row[i], z[i]].item() for i in range(n) if mask_row[i])
    arc_scores = {}
    for c in range(crf.channels):
        for i, legal in enumerate(heads):
            if legal:
                arc_scores[c, i] = [T[group_of(i, j, n, *buckets(crf)), c, z[i], z[j]].item() for j in legal]
    globals_ = []
    if Bm is not None:
        globals_ = [[Bm[m, z[i]].item() for m in range(crf.global_labels)] for i in range(n) if mask_row[i]]
    return score, arc_scores, globals_, heads, exists


def brute_force(crf, tokens_row, mask_row):
    """log Z, z/h/g marginals of one sentence by summing over every labelling of the
    existing nodes, with each head and global variable summed in closed form given
    the labels (they are conditionally independent given z)."""
    n = len(tokens_row)
    N, d, C = crf.topology.num_nodes(n), crf.labels, crf.channels
    _, exists = arcs_of(crf, n, mask_row)
    live = [i for i in range(N) if exists[i]]
    log_w, records = [], []
    for values in itertools.product(range(d), repeat=len(live)):
        z = [0] * N
        for i, a in zip(live, values):
            z[i] = a
        score, arc_scores, globals_, heads, _ = _label_terms(crf, tokens_row, mask_row, z)
        total = score
        total += sum(torch.tensor(s).logsumexp(0).item() for s in arc_scores.values())
        total += sum(torch.tensor(s).logsumexp(0).item() for s in globals_)
        log_w.append(total)
        records.append((z, arc_scores, globals_, heads))
    log_w = torch.tensor(log_w, dtype=torch.float64)
    log_z = log_w.logsumexp(0)
    w = (log_w - log_z).exp()
    zm = torch.zeros(N, d, dtype=torch.float64)
    hm = torch.zeros(C, N, N, dtype=torch.float64)
    gm = torch.zeros(n, max(crf.global_labels, 1), dtype=torch.float64)
    for weight, (z, arc_scores, globals_, heads) in zip(w, records):
        for i in live:
            zm[i, z[i]] += weight
        for (c, i), s in arc_scores.items():
            hm[c, i, heads[i]] += weight * torch.tensor(s).softmax(0)
        for k, i in enumerate([i for i in range(n) if mask_row[i]]):
            gm[i] += weight * torch.tensor(globals_[k]).softmax(0) if globals_ else 0
    return log_z.item(), zm, hm, (gm if crf.global_labels else None)


def full_enumeration_log_z(crf, tokens_row, mask_row):
    """log Z by listing every joint assignment (z, h, g) of the existing variables."""
    n = len(tokens_row)
    N, d, C, G = crf.topology.num_nodes(n), crf.labels, crf.channels, crf.global_labels
    heads, exists = arcs_of(crf, n, mask_row)
    live = [i for i in range(N) if exists[i]]
    head_vars = [(c, i) for c in range(C) for i in range(N) if heads[i]]
    real = [i for i in range(n) if mask_row[i]]
    S, T, Bm = _tables(crf)
    terms = []
    for zv in itertools.product(range(d), repeat=len(live)):
        z = dict(zip(live, zv))
        for hv in itertools.product(*[heads[i] for (_, i) in head_vars]):
            for gv in itertools.product(range(G), repeat=len(real) if G else 0):
                s = sum(S[tokens_row[i], z[i]].item() for i in real)
                s += sum(T[group_of(i, j, n, *buckets(crf)), c, z[i], z[j]].item() for (c, i), j in zip(head_vars, hv))
                s += sum(Bm[m, z[i]].item() for i, m in zip(real, gv)) if G else 0.0
                terms.append(s)
    return torch.tensor(terms, dtype=torch.float64).logsumexp(0).item()


def log_potential(crf, tokens_row, mask_row, z, h, g=None):
    """The unnormalised log joint of one full assignment (z over nodes, h[c][i], g over tokens)."""
    n = len(tokens_row)
    S, T, Bm = _tables(crf)
    heads, exists = arcs_of(crf, n, mask_row)
    s = sum(S[tokens_row[i], z[i]].item() for i in range(n) if mask_row[i])
    for c in range(crf.channels):
        for i, legal in enumerate(heads):
            if legal:
                j = h[c][i]
                if j not in legal:
                    return -math.inf
                s += T[group_of(i, j, n, *buckets(crf)), c, z[i], z[j]].item()
    if g is not None:
        s += sum(Bm[g[i], z[i]].item() for i in range(n) if mask_row[i])
    return s


def _entropy(p):
    return -torch.special.xlogy(p, p).sum().item()


def mean_field_elbo(crf, tokens_row, mask_row, q_z):
    """ELBO of labels q_z [N, d] with heads and globals at their optimum given q_z:
    E[unary] + H(q_z) + sum_{c,i} log sum_j exp(q_i T q_j) + sum_i log sum_m exp(B q_i)."""
    n = len(tokens_row)
    S, T, Bm = _tables(crf)
    heads, exists = arcs_of(crf, n, mask_row)
    q = q_z.double()
    value = sum((q[i] * S[tokens_row[i]]).sum().item() for i in range(n) if mask_row[i])
    value += sum(_entropy(q[i]) for i in range(len(exists)) if exists[i])
    for c in range(crf.channels):
        for i, legal in enumerate(heads):
            if legal:
                scores = torch.stack([q[i] @ T[group_of(i, j, n, *buckets(crf)), c] @ q[j] for j in legal])
                value += scores.logsumexp(0).item()
    if Bm is not None:
        value += sum((Bm @ q[i]).logsumexp(0).item() for i in range(n) if mask_row[i])
    return value


def mean_field_update(crf, tokens_row, mask_row, q_z):
    """One exact mean-field update of every label from q_z [N, d] (heads and globals at
    their optimum given q_z): returns the new label marginals [N, d] (zero rows for padding)."""
    n = len(tokens_row)
    S, T, Bm = _tables(crf)
    heads, exists = arcs_of(crf, n, mask_row)
    N, d = q_z.shape
    q = q_z.double()
    q_h = {}
    for c in range(crf.channels):
        for i, legal in enumerate(heads):
            if legal:
                scores = torch.stack([q[i] @ T[group_of(i, j, n, *buckets(crf)), c] @ q[j] for j in legal])
                q_h[c, i] = dict(zip(legal, scores.softmax(0)))
    new = torch.zeros(N, d, dtype=torch.float64)
    for i in range(N):
        if not exists[i]:
            continue
        logits = S[tokens_row[i]].clone() if i < n else torch.zeros(d, dtype=torch.float64)
        for (c, dep), choice in q_h.items():
            for head, p in choice.items():
                if dep == i:  # i's own head
                    logits += p * (T[group_of(i, head, n, crf.gamma), c] @ q[head])
                if head == i:  # dep chose i
                    logits += p * (T[group_of(dep, i, n, crf.gamma), c].T @ q[dep])
        if Bm is not None and i < n:
            logits += (Bm @ q[i]).softmax(0) @ Bm
        new[i] = logits.softmax(0)
    return new
