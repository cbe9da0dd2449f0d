"""The Gibbs moves (inference.smc.tempered.gibbs_moves) leave p_beta invariant."""

import itertools

import pytest
import scipy.stats
import torch

import inference
from inference.smc.tempered import gibbs_moves
from inference.smc.tempered.target import compile_target
from tests import oracles
from tests.builders import tempered_case as make_case

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- invariance: exact draws of p_beta, moves, chi-square ---------------------------------


def enumerated_p_beta(crf, tokens_row, mask_row, q, beta):
    """Every labelling of the existing nodes with its log p_beta mass (heads and globals
    summed given the labels), written from the oracle's tables, and the exact conditionals
    of each head and global given the labels."""
    S, T, Bm = oracles._tables(crf)
    n = len(tokens_row)
    heads, exists = oracles.arcs_of(crf, n, mask_row)
    live = [i for i in range(len(exists)) if exists[i]]
    labellings, masses, conditionals = [], [], []
    for values in itertools.product(range(crf.labels), repeat=len(live)):
        z = [0] * len(exists)
        for i, a in zip(live, values):
            z[i] = a
        mass = sum((1 - beta) * q["z"][i, z[i]].log() + beta * (S[tokens_row[i], z[i]] if i < n else 0.0) for i in live)
        rows = {}
        for c in range(crf.channels):
            for i, legal in enumerate(heads):
                if legal:
                    group = [oracles.group_of(i, j, n, *oracles.buckets(crf)) for j in legal]
                    row = torch.stack(
                        [(1 - beta) * q["h"][c, i, j].log() + beta * T[k, c, z[i], z[j]] for j, k in zip(legal, group)]
                    )
                    mass = mass + row.logsumexp(0)
                    rows["h", c, i] = (legal, row.softmax(0))
        if Bm is not None:
            for i in range(n):
                if mask_row[i]:
                    row = (1 - beta) * q["g"][i].log() + beta * Bm[:, z[i]]
                    mass = mass + row.logsumexp(0)
                    rows["g", i] = (list(range(crf.global_labels)), row.softmax(0))
        labellings.append(z)
        masses.append(float(mass))
        conditionals.append(rows)
    return labellings, torch.tensor(masses, dtype=torch.float64), conditionals


def random_proposal(crf, tokens, mask, generator):
    B, n = tokens.shape
    N, d, C, G = crf.topology.num_nodes(n), crf.labels, crf.channels, crf.global_labels

    def rows(*shape):
        return torch.distributions.Dirichlet(torch.ones(shape[-1], dtype=torch.float64)).sample(shape[:-1])

    torch.manual_seed(int(torch.randint(1000, (1,), generator=generator)))
    return inference.Posterior(z=rows(B, N, d), h=rows(B, C, N, N), g=rows(B, n, G) if G else None)


@pytest.mark.parametrize("kind", ["global", "pairwise", "user", "virtual"])
def test_moves_leave_p_beta_invariant(kind):
    crf, tokens, mask = make_case(kind)
    tokens, mask = tokens[1:, :3], mask[1:, :3]  # three tokens: 27 labellings
    generator = torch.Generator().manual_seed(5)
    proposal = random_proposal(crf, tokens, mask, generator)
    beta, draws = 0.6, 4000
    target = compile_target(crf, tokens, mask, proposal, 0.0, 1)
    q = {"z": target.log_qz[0].exp(), "h": target.log_qh[0].exp()}
    if crf.global_labels:
        q["g"] = target.log_qg[0].exp()
    labellings, masses, conditionals = enumerated_p_beta(crf, tokens[0].tolist(), mask[0].tolist(), q, beta)
    if kind == "user":  # the oracle's masses lack the extra factors: add them
        bonus = torch.tensor([0.7 * beta * (z[0] == z[1]) for z in labellings], dtype=torch.float64)
        masses = masses + bonus
    if kind == "pairwise":
        factor = crf.factors[0]
        arcs = factor.topology.arcs(mask)[0].nonzero().tolist()  # the topology is data
        table = factor.table.detach()
        masses = masses + torch.tensor(
            [beta * sum(float(table[oracles.group_of(i, j, 3, 0), z[i], z[j]]) for i, j in arcs) for z in labellings],
            dtype=torch.float64,
        )
    probs = (masses - masses.logsumexp(0)).exp()
    chosen = torch.multinomial(probs, draws, replacement=True, generator=generator)
    z = torch.tensor([labellings[k] for k in chosen.tolist()])[None]
    N = z.shape[-1]
    h = torch.zeros(1, draws, crf.channels, N, dtype=torch.long)
    g = torch.zeros(1, draws, 3, dtype=torch.long) if crf.global_labels else None
    for p, k in enumerate(chosen.tolist()):
        for key, (values, row) in conditionals[k].items():
            value = values[int(torch.multinomial(row, 1, generator=generator))]
            if key[0] == "h":
                h[0, p, key[1], key[2]] = value
            else:
                g[0, p, key[1]] = value
    with torch.no_grad():
        for _ in range(2):
            z, h, g = gibbs_moves.sweep(target, z, h, g, torch.tensor([beta], dtype=torch.float64), 4, generator)
    index = {tuple(labelling): k for k, labelling in enumerate(labellings)}
    counts = torch.zeros(len(labellings))
    for row in z[0].tolist():
        counts[index[tuple(row)]] += 1
    expected = probs * draws
    kept = expected > 5  # chi-square's validity: pool the rare cells
    rare = [] if kept.all() else [None]  # one pooled cell, if any
    observed = torch.cat([counts[kept], *(counts[~kept].sum()[None] for _ in rare)])
    predicted = torch.cat([expected[kept], *(expected[~kept].sum()[None] for _ in rare)])
    assert scipy.stats.chisquare(observed.numpy(), predicted.numpy()).pvalue > 1e-3
    # and every head row's counts under the exact head marginal of p_beta
    head_marginal = torch.zeros(crf.channels, N, N, dtype=torch.float64)
    for weight, rows in zip(probs, conditionals):
        for key, (values, row) in rows.items():
            if key[0] == "h":
                head_marginal[key[1], key[2], values] += weight * row
    for c in range(crf.channels):
        for i in range(N):
            legal = head_marginal[c, i] > 0
            if legal.sum() > 1:
                observed = torch.bincount(h[0, :, c, i], minlength=N)[legal].double()
                assert (
                    scipy.stats.chisquare(observed.numpy(), (head_marginal[c, i, legal] * draws).numpy()).pvalue > 1e-4
                )
