"""Independent brute-force oracles, written from the maths in DESIGN.md, not from
the library: they read only the raw parameters (unary, ternary_u/v, binary) and
the topology's arc mask, and recompute distance groups and potentials themselves.
"""

import itertools
import math

import torch

from graphs import topology


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
    against their own oracle in tests/graphs/topology/test_builtins.py)."""
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


def dense_head_messages(query, key, value, value_rev, scale, structure):
    """float64 messages and lse: each arc's group's projections, a null head of logit 0
    (``dense_attention_reference`` in float64)."""
    return dense_attention_reference(*(t.double() for t in (query, key, value, value_rev)), scale, structure)


def relative_errors(result, expected) -> list[float]:
    """Max-abs error of a kernel's forward, reverse and lse, relative to the largest expected value."""
    return [
        float((ours.double() - theirs).abs().max() / theirs.abs().max())
        for ours, theirs in zip((result.forward, result.reverse, result.lse), expected)
    ]


# Each topology restated as a predicate over (dependent i, head j, n); virtual nodes are >= n.


def full_rule(i, j, n):
    return i < n and j < n


def causal_rule(i, j, n):
    return i < n and j < i


def window_rule(w):
    return lambda i, j, n: i < n and j < n and abs(i - j) <= w


def star_rule(wrap):
    def rule(i, j, n):
        if i < n and j < n:
            return abs(i - j) == 1 or (wrap and n > 2 and {i, j} == {0, n - 1})
        return (i < n) != (j < n)  # token <-> relay

    return rule


def clusters_rule(k, dynamic=False):
    def rule(i, j, n):
        if i < n and j < n:
            return False
        if i >= n and j >= n:
            return True
        token, cluster = (i, j - n) if i < n else (j, i - n)
        return dynamic or token * k // n == cluster

    return rule


def root_rule(i, j, n):
    return i < n and j >= n


def segments_rule(length, causal=False):
    def rule(i, j, n):
        gap = i // length - j // length
        return i < n and j < n and (gap == 1 or (gap == 0 and (j < i or not causal)))

    return rule


TOPOLOGY_CASES = [
    (topology.full(), full_rule, 0),
    (topology.causal(), causal_rule, 0),
    (topology.window(1), window_rule(1), 0),
    (topology.window(3), window_rule(3), 0),
    (topology.star(), star_rule(False), 1),
    (topology.star(wrap=True), star_rule(True), 1),
    (topology.clusters(1), clusters_rule(1), 1),
    (topology.clusters(3), clusters_rule(3), 3),
    (topology.segments(2), segments_rule(2), 0),
    (topology.root(), root_rule, 1),
    (topology.segments(3), segments_rule(3), 0),
    (topology.segments(3, causal=True), segments_rule(3, causal=True), 0),
    (topology.clusters(3, dynamic=True), clusters_rule(3, dynamic=True), 3),
    (topology.parse("segments(4, causal=True)"), segments_rule(4, causal=True), 0),
]


TOPOLOGY_SPECS = ["full", "causal", "window(1)", "segments(2)", "star()", "root()", "window(1) | root()"]


LENGTH_DEPENDENT_SPECS = [
    "clusters(1)",
    "clusters(2)",
    "clusters(3)",
    "clusters(2, dynamic=True)",
    "window(1) | clusters(3)",
]


def kalman(ys, A, Q, H, R, m0, P0):
    """Filtering means [T, D] and the log-evidence of ys [T, E] under
    x_0 ~ N(m0, P0), x_t = A x_{t-1} + N(0, Q), y_t = H x_t + N(0, R)."""
    m, P, log_z, means = m0, P0, 0.0, []
    for y in ys:
        m, P = A @ m, A @ P @ A.T + Q
        S = H @ P @ H.T + R
        log_z += torch.distributions.MultivariateNormal(H @ m, S).log_prob(y).item()
        K = P @ H.T @ torch.linalg.inv(S)
        m, P = m + K @ (y - H @ m), (torch.eye(len(m), dtype=P.dtype) - K @ H) @ P
        means.append(m)
    return torch.stack(means), log_z


def explicit_null_softmax(logits, has_head):
    """The definition: softmax and logsumexp over the logits with a null column appended (0
    where the row has no head, -inf where it has)."""
    B, C, n, _ = logits.shape
    null = torch.where(has_head, -math.inf, 0.0).to(logits.dtype)[:, None, :, None].expand(B, C, n, 1)
    extended = torch.cat([logits, null], -1)
    return extended.softmax(-1)[..., :-1], extended.logsumexp(-1)


def dense_attention_reference(query, key, value, value_rev, scale, structure, bias=None):
    """The messages of head_kernels' docstring, materialised: logits from each arc's own
    group, a null head of logit 0 on rows with no legal head. A group axis of size 1 is
    every group's projection, and the messages come back summed over the groups."""
    shared = query.shape[2] == 1
    K = 2 * (structure.gamma + 1) + (1 if structure.nodes.shape[1] > structure.n else 0)
    query, key, value, value_rev = (t.expand(-1, -1, K, -1, -1) for t in (query, key, value, value_rev))
    one_hot = torch.nn.functional.one_hot(structure.groups, K).to(query.dtype)  # [N, N, K]
    scores = torch.einsum("bikcr,bjkcr,ijk->bcij", query, key, one_hot) * scale
    if bias is not None:
        scores = scores + torch.einsum("kc,ijk->cij", bias, one_hot)
    logits = scores.masked_fill(~structure.arcs[:, None], -math.inf)
    null = torch.where(structure.arcs.any(-1), -math.inf, 0.0).to(query.dtype)[:, None, :, None]
    extended = torch.cat([logits, null.expand(*logits.shape[:-1], 1)], -1)
    probs, lse = extended.softmax(-1)[..., :-1], extended.logsumexp(-1)
    forward = torch.einsum("bcij,ijk,bjkcr->bikcr", probs, one_hot, value)
    reverse = torch.einsum("bcji,jik,bjkcr->bikcr", probs, one_hot, value_rev)
    if shared:
        forward, reverse = forward.sum(2, keepdim=True), reverse.sum(2, keepdim=True)
    return forward, reverse, lse
